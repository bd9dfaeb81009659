"""Q4_K at one row with x rounded to int8 (kernels/gguf_q4k_int8x.py; in the interpreter on the
CPU, on the GPU with its dp4a when CUDA is there), against float64 from gguf's own
dequantize of the same blocks: exact (to float32 sums) for the x it rounded, and within the
rounding's bound of the exact product."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from infer.kernels import triton_available

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402
from test_gguf_models import random_kquant_blocks  # noqa: E402

pytestmark = pytest.mark.skipif(not triton_available(), reason="triton is not installed")

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRETED else "cpu"


def blocks(n: int, k: int, seed: int) -> np.ndarray:
    return random_kquant_blocks(n * k, Q.Q4_K, np.random.default_rng(seed)).reshape(n, -1)


def dequantized(raw: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(raw, Q.Q4_K)).double()


def min_terms(raw: np.ndarray) -> torch.Tensor:
    """`-dmin * m` of each weight's sub-block: the blocks dequantized with every nibble 0."""
    zero = raw.reshape(-1, 144).copy()
    zero[:, 16:] = 0
    return dequantized(zero.reshape(raw.shape))


def test_quantize_x_rounds_each_block_of_32_to_int8_steps():
    from infer.kernels.int8_rows import quantize_x

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, 256, generator=gen) * 3
    x[0, 32:64] = 0  # a block of zeros: step 0, values 0
    x[0, 64:96] *= 1e4  # large values
    x[0, 100] = -x[0, 96:128].abs().max() * 2  # the block's largest is negative
    xq, side = (t.cpu() for t in quantize_x(x.to(DEVICE)))
    dx, xsum = side[:, :2].reshape(-1), side[:, 2:].reshape(-1)  # steps, sums of each pair
    blocks_x = x.reshape(8, 32).double()
    amax = blocks_x.abs().amax(dim=1)
    assert torch.allclose(dx.double(), amax / 127, rtol=1e-6, atol=0)
    assert xq.dtype == torch.int8 and xq.abs().max() <= 127
    assert xq[100] == -127
    error = (xq.double().reshape(8, 32) * dx.double()[:, None] - blocks_x).abs()
    assert (error <= dx.double()[:, None] * (0.5 + 1e-5)).all()
    assert not xq[32:64].any() and dx[1] == 0
    assert torch.allclose(xsum.double(), blocks_x.sum(dim=1), rtol=1e-5, atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16]
                         + ([] if INTERPRETED else [torch.bfloat16]))
# rows not a multiple of the program's; K ending mid step (3 and 5 super-blocks), K split
# (the last split short, or mid step)
@pytest.mark.parametrize(("n", "k", "block_n", "units", "split"),
                         [(37, 768, 16, 2, 1), (64, 512, 32, 1, 1), (5, 1280, 8, 4, 1),
                          (37, 1280, 16, 1, 2), (70, 1792, 32, 2, 3)])
def test_q4k_int8x_is_the_product_with_its_rounded_x_and_within_the_rounding(
        n, k, block_n, units, split, dtype):
    from infer.kernels.gguf_gemv import gemv_words
    from infer.kernels.gguf_q4k_int8x import q4k_gemv_int8x
    from infer.kernels.int8_rows import quantize_x

    raw = blocks(n, k, seed=n + k)
    words = gemv_words(torch.from_numpy(raw).to(DEVICE), Q.Q4_K)
    gen = torch.Generator().manual_seed(k)
    x = (torch.randn(1, k, generator=gen) * 3).to(dtype)
    quantized = quantize_x(x.to(DEVICE))
    y = q4k_gemv_int8x(x.to(DEVICE), words, k, block_n=block_n, units=units, split=split,
                       quantized=quantized).cpu()
    assert y.shape == (1, n) and y.dtype == dtype and torch.isfinite(y).all()
    xq, side = (t.cpu().double() for t in quantized)
    dx = side[:, :2].reshape(-1)
    rounded = (xq.reshape(-1, 32) * dx[:, None]).reshape(1, k)
    w, w0, exact_x = dequantized(raw), min_terms(raw), x.double()
    # The kernel's sum: the int8 products by sub-block scale, the min term by exact sums.
    ref = rounded @ w.T - (rounded - exact_x) @ w0.T
    tolerance = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    scale = ref.abs().max().item()
    assert (y.double() - ref).abs().max().item() <= tolerance * scale
    # Against the exact product: within the rounding's bound, sum_i |d sc q_i| step_i / 2.
    exact = exact_x @ w.T
    steps = dx.repeat_interleave(32)[None, :]
    bound = (steps / 2) @ (w - w0).abs().T
    assert ((y.double() - exact).abs() <= bound + tolerance * scale).all()
    assert (y.double() - exact).abs().max() > 0  # x was rounded: not the exact product


def test_q4k_int8x_splits_of_k_made_here_and_called_twice():
    """K split over programs, twice in a row: the counters the first launch used are left
    at zero for the second, which gives the same result as the first and as no split."""
    from infer.kernels.gguf_gemv import gemv_words
    from infer.kernels.gguf_q4k_int8x import q4k_gemv_int8x

    n, k = 45, 2048
    raw = blocks(n, k, seed=3)
    words = gemv_words(torch.from_numpy(raw).to(DEVICE), Q.Q4_K)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    whole = q4k_gemv_int8x(x, words, k, block_n=16, units=2, split=1).cpu()
    for _ in range(2):
        split = q4k_gemv_int8x(x, words, k, block_n=16, units=2, split=4).cpu()
        assert (split - whole).abs().max() <= 1e-5 * whole.abs().max()


def test_q4k_int8x_writes_every_row_and_only_those():
    from infer.kernels.gguf_gemv import gemv_words
    from infer.kernels.gguf_q4k_int8x import q4k_gemv_int8x

    n, k = 70, 256
    raw = blocks(n, k, seed=1)
    words = gemv_words(torch.from_numpy(raw).to(DEVICE), Q.Q4_K)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(1))
    y = q4k_gemv_int8x(x.to(DEVICE), words[:n - 3], k, block_n=32).cpu()
    ref = x.double() @ dequantized(raw[:n - 3]).T
    assert y.shape == (1, n - 3)
    assert ((y.double() - ref).abs() < 0.05 * ref.abs().max()).all()
