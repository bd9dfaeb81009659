"""Q6_K at one row with x rounded to int8 (kernels/gguf_q6k_int8x.py; in the interpreter on a
CPU, on the GPU with its dp4a and funnel shifts when CUDA is there), against float64 from
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
from test_gguf_models import random_kquant_blocks  # noqa: E402

pytestmark = pytest.mark.skipif(not triton_available(), reason="triton is not installed")

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRETED else "cpu"


def blocks(n: int, k: int, seed: int) -> np.ndarray:
    return random_kquant_blocks(n * k, Q.Q6_K, np.random.default_rng(seed)).reshape(n, -1)


def dequantized(raw: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(raw, Q.Q6_K)).double()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16]
                         + ([] if INTERPRETED else [torch.bfloat16]))
# rows not a multiple of the program's; odd super-blocks (every other one: two bytes into a
# word); K ending mid step (6 super-blocks in steps of 4), K split (the last split short)
@pytest.mark.parametrize(("n", "k", "block_n", "units", "split"),
                         [(37, 512, 16, 2, 1), (5, 1024, 8, 2, 1), (20, 1536, 8, 4, 1),
                          (37, 2048, 16, 2, 3), (64, 1024, 32, 2, 2)])
def test_q6k_int8x_is_the_product_with_its_rounded_x_and_within_the_rounding(
        n, k, block_n, units, split, dtype):
    from infer.kernels.gguf_gemv import gemv_words
    from infer.kernels.gguf_q6k_int8x import q6k_gemv_int8x
    from infer.kernels.int8_rows import quantize_x

    raw = blocks(n, k, seed=n + k)
    words = gemv_words(torch.from_numpy(raw).to(DEVICE), Q.Q6_K)
    gen = torch.Generator().manual_seed(k)
    x = (torch.randn(1, k, generator=gen) * 3).to(dtype)
    quantized = quantize_x(x.to(DEVICE))
    y = q6k_gemv_int8x(x.to(DEVICE), words, k, block_n=block_n, units=units, split=split,
                       quantized=quantized).cpu()
    assert_rounded_product(y, quantized, dequantized(raw), x)


def test_q6k_int8x_splits_of_k_called_twice_and_rows_past_n():
    """K split over programs, twice in a row (the counters the first launch used are left
    at zero for the second): the same result as no split; a row block past N writes only
    the rows there are."""
    from infer.kernels.gguf_gemv import gemv_words
    from infer.kernels.gguf_q6k_int8x import q6k_gemv_int8x

    n, k = 45, 2048
    raw = blocks(n, k, seed=3)
    words = gemv_words(torch.from_numpy(raw).to(DEVICE), Q.Q6_K)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    whole = q6k_gemv_int8x(x, words, k, block_n=16, units=2, split=1).cpu()
    for _ in range(2):
        split = q6k_gemv_int8x(x, words, k, block_n=16, units=2, split=4).cpu()
        assert (split - whole).abs().max() <= 1e-5 * whole.abs().max()
    fewer = q6k_gemv_int8x(x, words[:n - 3], k, block_n=32).cpu()
    assert fewer.shape == (1, n - 3)
    assert (fewer - whole[:, :n - 3]).abs().max() <= 1e-5 * whole.abs().max()
