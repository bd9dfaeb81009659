"""The token bitmask kernel (in the Triton interpreter on the CPU) and its torch path vs a
plain loop over bits: on a subset of rows or all, vocab widths that are not multiples of
32, logits wider and narrower than 32 * words, float32 and bfloat16."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from infer.kernels import triton_available
from infer.kernels.reference import apply_token_bitmask_ref

# conftest.py sets TRITON_INTERPRET (1 unless INFER_TEST_DEVICE asks for a GPU run).
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRETED else "cpu"


def _kernel():
    if not triton_available():
        pytest.skip("triton is not installed")
    from infer.kernels.token_bitmask import apply_token_bitmask

    return apply_token_bitmask


def _torch_path():
    return apply_token_bitmask_ref  # the engine's path where the kernel does not run


def expected(logits: torch.Tensor, masks: torch.Tensor, rows: list[int] | None) -> np.ndarray:
    """Token j of row r is allowed iff j < 32 * words and bit j % 32 of word j // 32 is 1."""
    out = logits.float().cpu().numpy().copy()
    words = masks.cpu().numpy().astype(np.int64) & 0xFFFFFFFF
    for r in range(len(masks)) if rows is None else rows:
        for j in range(out.shape[1]):
            if j >= 32 * words.shape[1] or not (int(words[r, j // 32]) >> (j % 32)) & 1:
                out[r, j] = -np.inf
    return out


def random_masks(rows: int, words: int, seed: int) -> torch.Tensor:
    gen = np.random.default_rng(seed)
    # Dense, sparse and all-ones/all-zeros words, with bit 31 (the sign) set often.
    raw = gen.integers(0, 2**32, size=(rows, words), dtype=np.uint64)
    sparse = raw & gen.integers(0, 2**32, size=(rows, words), dtype=np.uint64)
    raw = np.where(gen.random((rows, words)) < 0.5, raw, sparse)
    raw[gen.random((rows, words)) < 0.1] = 0xFFFFFFFF
    raw[gen.random((rows, words)) < 0.1] = 0
    return torch.from_numpy(raw.astype(np.uint32).view(np.int32).copy()).to(DEVICE)


CASES = [  # (logits rows, vocab width, mask words, rows masked or None for all)
    (4, 100, 4, None),          # width < 32 * words, not a multiple of 32 (the engine's)
    (5, 96, 3, [0, 2, 4]),      # exactly 32 * words, a subset
    (3, 70, 2, [1]),            # wider than 32 * words: the tail is disallowed
    (6, 33, 2, [5, 0, 3]),      # unsorted subset
    (3, 4100, 129, None),       # more than one program's block of words per row
    (2, 4200, 100, [1]),        # a block past the mask's words entirely
]


@pytest.mark.parametrize("apply", [_kernel, _torch_path], ids=["triton", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES)
def test_matches_a_loop_over_bits(apply, dtype: torch.dtype,
                                  case: tuple[int, int, int, list[int] | None]) -> None:
    apply = apply()
    n_rows, width, words, rows = case
    logits = torch.randn(n_rows, width, device=DEVICE).to(dtype)
    masks = random_masks(n_rows, words, seed=width)
    want = expected(logits, masks, rows)
    index = None if rows is None else torch.tensor(rows, device=DEVICE)
    apply(logits, masks, index)
    assert logits.dtype == dtype
    np.testing.assert_array_equal(logits.float().cpu().numpy(), want)


@pytest.mark.parametrize("apply", [_kernel, _torch_path], ids=["triton", "torch"])
def test_in_place_on_a_strided_view_and_fewer_mask_rows(apply) -> None:
    """Rows of a wider buffer (stride > width); masks for the first rows only."""
    apply = apply()
    buffer = torch.randn(4, 80, device=DEVICE)
    logits = buffer[:, :50]
    masks = random_masks(3, 2, seed=1)
    want = expected(logits, masks, None)
    untouched = buffer[:, 50:].clone()
    apply(logits, masks, None)
    np.testing.assert_array_equal(buffer[:, :50].cpu().numpy(), want)  # row 3 as it was
    assert torch.equal(buffer[:, 50:], untouched)


@pytest.mark.parametrize("apply", [_kernel, _torch_path], ids=["triton", "torch"])
def test_no_rows_is_a_no_op(apply) -> None:
    apply = apply()
    logits = torch.randn(2, 40, device=DEVICE)
    before = logits.clone()
    apply(logits, random_masks(2, 2, seed=2), torch.zeros(0, dtype=torch.int64, device=DEVICE))
    assert torch.equal(logits, before)
