"""Forwards whose first row may need no outputs, known only on the device: the two-row
GEMVs launched inside `first_row_skipped_where(flag)` leave x's first row out (its output
row unwritten) when the kernel finds `flag` nonzero.

A draft round queued behind its verify step starts with two tokens of its sequence
(`spec/model_drafter.py`): the last draft, whose KV the draft's cache lacks only when the
verdict accepted every draft, and the token the verdict ends on. Otherwise the first
token's KV is in the cache already and its outputs are never read: `GraphMetadata.advance`
sets the flag and the token's cache slot to -1 (nothing stored). The row's garbage stays
in its row: every kernel of a forward works row by row except attention, which reads the
keys of earlier positions from the cache.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

_flag: torch.Tensor | None = None


@contextmanager
def first_row_skipped_where(flag: torch.Tensor) -> Iterator[None]:
    """Within: `skip_flag()` is `flag` (a one-element int32 tensor on the device)."""
    global _flag
    outer, _flag = _flag, flag
    try:
        yield
    finally:
        _flag = outer


def skip_flag() -> torch.Tensor | None:
    """The flag two-row GEMV launches read now (None: outside `first_row_skipped_where`)."""
    return _flag
