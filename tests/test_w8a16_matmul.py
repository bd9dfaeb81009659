"""The W8A16 Triton matmul (in the interpreter on the CPU; on the GPU with
INFER_TEST_DEVICE=cuda) against float64 computed from the int8 weights and their scales."""

from __future__ import annotations

import os

import pytest
import torch

from infer.kernels import triton_available

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRETED else "cpu"
# The interpreter's bfloat16 dot is not faithful (numpy has no bfloat16); the GPU run
# covers bfloat16.
DTYPES = [torch.float32, torch.float16] + ([] if INTERPRETED else [torch.bfloat16])
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("m", "n", "k"), [(1, 40, 300), (5, 64, 256), (33, 70, 130),
                                           (70, 96, 64)])
def test_w8a16_matches_float64_from_the_integers(dtype, m, n, k):
    from infer.kernels.w8a16_matmul import w8a16_matmul

    gen = torch.Generator().manual_seed(m * 1000 + n)
    x = torch.randn(m, k, generator=gen).to(dtype)
    w = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen)
    scale = (torch.rand(n, generator=gen) * 0.02).to(dtype)
    y = w8a16_matmul(x.to(DEVICE), w.to(DEVICE), scale.to(DEVICE)).cpu()
    ref = x.double() @ (w.double() * scale.double()[:, None]).T
    assert y.dtype == dtype and y.shape == (m, n)
    error = (y.double() - ref).abs().max().item() / ref.abs().max().item()
    assert error < TOLERANCE[dtype], error


@pytest.mark.parametrize("rows", [1, 20, 100])  # on CUDA, 100 rows take the cuBLAS path
def test_int8_layers_on_the_test_device(rows):
    from infer.models.linear import ColumnParallelLinear
    from infer.quantization.int8 import Int8WeightOnlyLinearMethod

    dtype = torch.float32 if DEVICE == "cpu" else torch.bfloat16
    gen = torch.Generator().manual_seed(rows)
    layer = ColumnParallelLinear(64, 48, bias=False)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(48, 64, generator=gen))
    layer = layer.to(DEVICE, dtype)
    Int8WeightOnlyLinearMethod().quantize(layer)
    x = torch.randn(rows, 64, generator=gen).to(DEVICE, dtype)
    y = layer(x).cpu().double()
    ref = x.cpu().to(torch.bfloat16).double() @ (
        layer.weight.cpu().double() * layer.weight_scale.cpu().double()[:, None]).T
    assert (y - ref).abs().max().item() < 2e-2 * ref.abs().max().item()


@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("m", "n", "k", "block"), [(1, 200, 300, (128, 128)),
                                                    (7, 64, 256, (32, 64)),
                                                    (3, 40, 96, (24, 48))])
def test_w8a16_with_a_scale_per_tile(dtype, m, n, k, block):
    """Block-wise scales (FP8 checkpoints), on int8 weights in the interpreter, FP8 on a
    GPU; the weight's sides are not whole tiles in the first case; in the last, the
    kernel's blocks straddle scale tiles (a scale gathered per weight)."""
    from infer.kernels.w8a16_matmul import w8a16_matmul

    gen = torch.Generator().manual_seed(m + n)
    x = torch.randn(m, k, generator=gen).to(dtype)
    if DEVICE == "cuda":
        w = (torch.randn(n, k, generator=gen) * 100).to(torch.float8_e4m3fn)
    else:
        w = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen)
    rows, cols = block
    scale = torch.rand(-(-n // rows), -(-k // cols), generator=gen) * 0.02
    y = w8a16_matmul(x.to(DEVICE), w.to(DEVICE), scale.to(DEVICE), block).cpu()
    tiles = scale.double().repeat_interleave(rows, 0)[:n].repeat_interleave(cols, 1)[:, :k]
    ref = x.double() @ (w.double() * tiles).T
    error = (y.double() - ref).abs().max().item() / ref.abs().max().item()
    assert y.dtype == dtype and error < TOLERANCE[dtype], error


@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
@pytest.mark.parametrize(("m", "gemv", "split", "block"), [
    (1, True, 1, None), (1, True, 3, None), (1, False, 2, None), (6, False, 4, None),
    (1, True, 2, (32, 64)), (1, True, 1, (24, 48)), (5, False, 3, (32, 64))])
def test_every_launch_of_the_kernel(m, gemv, split, block):
    """The dot-free one-row path, K split over programs (float32 partials summed), with
    per-channel and per-tile scales (scaled per K step, or gathered per weight)."""
    from infer.kernels.w8a16_matmul import _matmul

    n, k = 72, 520
    gen = torch.Generator().manual_seed(m + split)
    x = torch.randn(m, k, generator=gen)
    w = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen)
    if block is None:
        scale = torch.rand(n, generator=gen) * 0.02
        weights = w.double() * scale.double()[:, None]
    else:
        rows, cols = block
        scale = torch.rand(-(-n // rows), -(-k // cols), generator=gen) * 0.02
        weights = w.double() * scale.double().repeat_interleave(rows, 0)[:n].repeat_interleave(
            cols, 1)[:, :k]
    y = _matmul(x.to(DEVICE), w.to(DEVICE), scale.to(DEVICE), block, block_n=16, block_k=64,
                split=split, one_row_gemv=gemv, num_warps=4, num_stages=2).cpu()
    ref = x.double() @ weights.T
    assert y.shape == (m, n) and y.dtype == torch.float32
    assert (y.double() - ref).abs().max().item() < 1e-5 * ref.abs().max().item()
