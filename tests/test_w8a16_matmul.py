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
