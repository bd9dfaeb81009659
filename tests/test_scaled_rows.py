"""An INT8 embedding table's rows scaled in one launch (kernels/scaled_rows.py): bit for bit
the torch lookup the INT8 method runs on the CPU, in the interpreter on the CPU and on the
GPU with CUDA."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from infer.kernels import triton_available

pytestmark = pytest.mark.skipif(not triton_available(), reason="triton is not installed")

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRETED else "cpu"


def _torch_rows(ids, table, scale, dtype):
    return (F.embedding(ids, table).float() * scale[ids, None].float()).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("dim", [64, 576, 5000])  # one block, a masked block, two blocks
def test_int8_rows_match_the_torch_lookup(dim, dtype, bf16_rounds_to_nearest):
    from infer.kernels.scaled_rows import scaled_rows

    gen = torch.Generator().manual_seed(dim)
    table = torch.randint(-127, 128, (50, dim), generator=gen, dtype=torch.int8)
    table[3] = 127
    table[4] = -127
    scale = (torch.rand(50, generator=gen) * 0.02 + 1e-4).to(dtype)
    ids = torch.tensor([[3, 4, 0], [49, 3, 17]])
    table, scale, ids = table.to(DEVICE), scale.to(DEVICE), ids.to(DEVICE)
    got = scaled_rows(ids, table, scale, dtype)
    assert got.shape == (2, 3, dim) and got.dtype == dtype
    assert torch.equal(got, _torch_rows(ids, table, scale, dtype))
    # against float64 too: one rounding of the exact product
    want = (table.double()[ids] * scale.double()[ids, None]).to(dtype)
    assert torch.equal(got, want)


def test_a_table_row_slice_and_no_ids():
    from infer.kernels.scaled_rows import scaled_rows

    table = torch.randint(-127, 128, (8, 96), dtype=torch.int8)[:, :64].to(DEVICE)
    scale = torch.rand(8).to(DEVICE)
    ids = torch.tensor([7, 0]).to(DEVICE)
    assert torch.equal(scaled_rows(ids, table, scale, torch.float32),
                       _torch_rows(ids, table, scale, torch.float32))
    empty = scaled_rows(ids[:0], table, scale, torch.float32)
    assert empty.shape == (0, 64)


@pytest.mark.skipif(DEVICE != "cuda", reason="the INT8 method looks rows up this way on CUDA")
def test_the_int8_method_embeds_through_the_kernel():
    from torch import nn

    from infer.kernels.scaled_rows import scaled_rows
    from infer.quantization.int8 import Int8WeightOnlyLinearMethod

    layer = nn.Module()
    layer.weight = nn.Parameter(torch.randn(30, 128, dtype=torch.bfloat16, device=DEVICE),
                                requires_grad=False)
    Int8WeightOnlyLinearMethod().quantize(layer)
    ids = torch.tensor([5, 29, 0], device=DEVICE)
    got = layer.quant_method.embed(layer, ids)
    assert torch.equal(got, scaled_rows(ids, layer.weight, layer.weight_scale, torch.bfloat16))
    assert torch.equal(got, _torch_rows(ids, layer.weight, layer.weight_scale,
                                        torch.bfloat16))
