"""The installed package's version: `infer --version` and the server's GET /version."""

from __future__ import annotations


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("infer")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "(not installed)"
