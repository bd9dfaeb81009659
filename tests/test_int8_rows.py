"""x rounded to int8 per 32 values (kernels/int8_rows.py) made where x is made: by the
gated activation's launch and by the RMSNorm's, the same bytes as rounding the stored
output apart (`quantize_x`). In the interpreter on the CPU, on the GPU with CUDA."""

from __future__ import annotations

import os

import pytest
import torch

from infer.kernels import triton_available

pytestmark = pytest.mark.skipif(not triton_available(), reason="triton is not installed")

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRETED else "cpu"
DTYPES = [torch.float32, torch.float16] + ([] if INTERPRETED else [torch.bfloat16])


def assert_same_rounding(got: tuple[torch.Tensor, torch.Tensor],
                         want: tuple[torch.Tensor, torch.Tensor]) -> None:
    """The same int8 values and steps; the sums (another kernel's order of adding 32
    float32 values) within float32 rounding."""
    (xq, side), (want_q, want_side) = got, want
    assert torch.equal(xq, want_q)
    assert torch.equal(side[:, :2], want_side[:, :2])
    assert torch.allclose(side[:, 2:], want_side[:, 2:], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("k", [64, 1344])  # one pair of blocks; 42 blocks, programs of 32
def test_the_gated_activation_rounded_in_one_launch(act, k, dtype):
    from infer.kernels.activation import gated_rows
    from infer.kernels.int8_rows import quantize_x

    gen = torch.Generator().manual_seed(k)
    gate_up = (torch.randn(1, 2 * k, generator=gen) * 2).to(DEVICE, dtype)
    gate_up[0, :32] = 0  # a block of zeros (gate 0: act 0)
    got = quantize_x(gate_up, act)
    assert_same_rounding(got, quantize_x(gated_rows(gate_up, act)))
    assert got[0][:32].eq(0).all() and got[1][0, 0] == 0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("k", [64, 576])  # a power of two; SmolLM2's width (blocks past it)
@pytest.mark.parametrize("residual", [False, True])
def test_the_norm_hands_out_its_output_rounded(residual, k, offset, dtype):
    from infer.kernels.int8_rows import quantize_x
    from infer.kernels.rmsnorm import fused_add_rmsnorm, rmsnorm

    gen = torch.Generator().manual_seed(k + int(offset))
    x = torch.randn(1, k, generator=gen).to(DEVICE, dtype)
    weight = (torch.rand(k, generator=gen) + 0.5).to(DEVICE, dtype)
    if residual:
        r = torch.randn(1, k, generator=gen).to(DEVICE, dtype)
        want, want_r = fused_add_rmsnorm(x, r.clone(), weight, 1e-6, offset)
        out, got_r, rounded = fused_add_rmsnorm(x, r.clone(), weight, 1e-6, offset,
                                                int8_rows=True)
        assert torch.equal(got_r, want_r)
    else:
        want = rmsnorm(x, weight, 1e-6, offset)
        out, rounded = rmsnorm(x, weight, 1e-6, offset, int8_rows=True)
    assert torch.equal(out, want)
    assert_same_rounding(rounded, quantize_x(want))


def test_only_one_row_of_whole_block_pairs_takes_int8_rows():
    from infer.kernels.rmsnorm import takes_int8_rows

    assert takes_int8_rows(torch.empty(1, 128)) and takes_int8_rows(torch.empty(1, 1, 64))
    assert not takes_int8_rows(torch.empty(2, 128))
    assert not takes_int8_rows(torch.empty(1, 96))
