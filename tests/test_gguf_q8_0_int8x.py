"""Q8_0 at one row with x rounded to int8 (kernels/gguf_q8_0_int8x.py; in the interpreter on a
CPU, on the GPU with its dp4a and byte permutes when CUDA is there), against float64 from
gguf's own dequantize of the same blocks: exact (to float32 sums) for the x it rounded, and
within the rounding's bound of the exact product."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from int8x_checks import assert_rounded_product

from infer.kernels import triton_available

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402

pytestmark = pytest.mark.skipif(not triton_available(), reason="triton is not installed")

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRETED else "cpu"


def blocks(n: int, k: int, seed: int) -> np.ndarray:
    """gguf's own Q8_0 quantization of random weights: `[n, k / 32 * 34]` bytes."""
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32) * 0.05
    return gguf.quants.quantize(w, Q.Q8_0)


def dequantized(raw: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(raw, Q.Q8_0)).double()


def words_of(raw: np.ndarray) -> torch.Tensor:
    from infer.kernels.gguf_gemv import row_words

    words = row_words(torch.from_numpy(raw).to(DEVICE))
    assert words is not None
    return words


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16]
                         + ([] if INTERPRETED else [torch.bfloat16]))
# rows not a multiple of the program's; K ending mid step (5 units in steps of 2 and 4),
# K split (the last split short), one unit a step
@pytest.mark.parametrize(("n", "k", "block_n", "units", "split"),
                         [(37, 256, 16, 4, 1), (5, 320, 8, 2, 1), (20, 320, 8, 4, 1),
                          (37, 1024, 16, 2, 3), (64, 512, 32, 1, 2)])
def test_q8_0_int8x_is_the_product_with_its_rounded_x_and_within_the_rounding(
        n, k, block_n, units, split, dtype):
    from infer.kernels.gguf_q8_0_int8x import q8_0_gemv_int8x
    from infer.kernels.int8_rows import quantize_x

    raw = blocks(n, k, seed=n + k)
    gen = torch.Generator().manual_seed(k)
    x = (torch.randn(1, k, generator=gen) * 3).to(dtype)
    quantized = quantize_x(x.to(DEVICE))
    y = q8_0_gemv_int8x(x.to(DEVICE), words_of(raw), k, block_n=block_n, units=units,
                        split=split, quantized=quantized).cpu()
    assert_rounded_product(y, quantized, dequantized(raw), x)


def test_q8_0_int8x_splits_of_k_called_twice_and_rows_past_n():
    """K split over programs, twice in a row (the counters the first launch used are left
    at zero for the second): the same result as no split; a row block past N writes only
    the rows there are."""
    from infer.kernels.gguf_q8_0_int8x import q8_0_gemv_int8x

    n, k = 45, 1024
    words = words_of(blocks(n, k, seed=3))
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    whole = q8_0_gemv_int8x(x, words, k, block_n=16, units=2, split=1).cpu()
    for _ in range(2):
        split = q8_0_gemv_int8x(x, words, k, block_n=16, units=2, split=4).cpu()
        assert (split - whole).abs().max() <= 1e-5 * whole.abs().max()
    fewer = q8_0_gemv_int8x(x, words[:n - 3], k, block_n=32).cpu()
    assert fewer.shape == (1, n - 3)
    assert (fewer - whole[:, :n - 3]).abs().max() <= 1e-5 * whole.abs().max()


def test_q8_0_rows_of_an_odd_number_of_blocks_are_no_whole_words():
    """K = 32 x an odd number: a row is not whole words, so the layer keeps such a weight
    on the exact path (row_words says None)."""
    from infer.kernels.gguf_gemv import row_words

    assert row_words(torch.from_numpy(blocks(4, 96, seed=1))) is None
    assert row_words(torch.from_numpy(blocks(4, 128, seed=1))) is not None
