"""Token bitmasks for kernel tests, built and read one token at a time (the grammar
library's layout: bit t % 32 of int32 word t // 32 set means token t is allowed)."""

from __future__ import annotations

import numpy as np
import torch


def random_token_masks(rows: int, n_cols: int, seed: int = 0) -> torch.Tensor:
    """int32 [rows, words]: row 0 allows every token, row 1 only token 40 (past the first
    word), the others random bits (about a third set)."""
    gen = torch.Generator().manual_seed(seed)
    words = (n_cols + 31) // 32
    bits = torch.rand(rows, 32 * words, generator=gen) < 0.35
    bits[0] = True
    if rows > 1:
        bits[1] = False
        bits[1, 40] = True
    weights = 1 << np.arange(32, dtype=np.int64)
    packed = (bits.view(rows, words, 32).numpy().astype(np.int64) * weights).sum(-1)
    return torch.from_numpy(packed.astype(np.uint32).view(np.int32))


def allowed_by(masks: torch.Tensor, n_cols: int) -> torch.Tensor:
    """bool [rows, n_cols]: whether each row's mask allows each token."""
    words = masks.numpy().view(np.uint32).astype(np.int64)
    cols = np.arange(n_cols)
    return torch.from_numpy((words[:, cols // 32] >> (cols % 32)) & 1 == 1)
