"""infer's CPU block kernels (kernels/cpu_block_linear.cpp) against float64: with x rounded
to int8 per 32 values as the kernels round it (a 4-bit block's `b` term by x's exact sum),
the only difference is float32 summation; against the exact x, within that rounding's
error. The blocks' packing against the
values ggml dequantizes; the instruction-set choice; bad shapes refused by name."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from test_gguf_quantized import _blocks, _weight

from infer.kernels import cpu_extension
from infer.kernels.cpu_block_linear import q4_1_linear, q8_0_linear
from infer.kernels.cpu_extension import isa_flags
from infer.quantization.cpu_blocks import (
    Q4BlocksLinearMethod,
    decode_q4_blocks,
    decode_q8_blocks,
    q4_blocks,
)
from infer.quantization.gguf_blocks import GGUFBlocks, int4_groups

pytestmark = pytest.mark.skipif(not cpu_extension.available(),
                                reason="the block kernels do not build on this machine")


def _rounded_x(x: torch.Tensor) -> torch.Tensor:
    """x as the kernels use it, in float64: each 32 values scaled by max|x| / 127 and
    rounded to the nearest integer (ties away from zero or to even: a tie needs x exactly
    between two steps, which random floats do not hit)."""
    blocks = x.double().view(len(x), -1, 32)
    scale = blocks.abs().amax(dim=-1, keepdim=True) / 127
    q = torch.where(scale > 0, torch.round(blocks / scale.clamp_min(1e-300)), 0)
    return (q * scale).view_as(x).double()


def _random_q4(rows: int, cols: int, gen: torch.Generator):
    q = torch.randint(0, 16, (rows, cols), dtype=torch.uint8, generator=gen)
    a = (torch.rand(rows, cols // 32, generator=gen) * 0.02 + 1e-3).half().float()
    b = (-torch.rand(rows, cols // 32, generator=gen) * 0.1).half().float()
    return q, a, b


def _random_q8(rows: int, cols: int, gen: torch.Generator):
    q = torch.randint(-128, 128, (rows, cols // 32, 32), dtype=torch.int8, generator=gen)
    q[0, 0, :4] = -128  # the magnitude int8 cannot hold
    d = (torch.rand(rows, cols // 32, 1, generator=gen) * 0.02 + 1e-3).half()
    blocks = torch.cat([d.view(torch.uint8), q.view(torch.uint8)], dim=-1)
    return blocks.view(rows, -1), (q.double() * d.double()).view(rows, cols)


# rows: each count of the kernel's groups of four and their remainders; cols: an odd number
# of blocks (the loop takes two at a time) and SmolLM2's widths
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9])
@pytest.mark.parametrize(("out", "cols"), [(37, 96), (576, 576), (64, 1536)])
@pytest.mark.parametrize("kind", ["q4", "q8"])
def test_block_matmul_is_the_float64_product_of_the_rounded_x(kind, rows, out, cols):
    gen = torch.Generator().manual_seed(rows * 1000 + out + cols)
    x = torch.randn(rows, cols, generator=gen)
    x[0, :32] = 0  # a block of zeros: scale 0, no division by it
    if kind == "q4":
        q, a, b = _random_q4(out, cols, gen)
        got = q4_1_linear(x, q4_blocks(q, a, b))
        weight = _weight(q, a, b)
        want = _rounded_x(x) @ _weight(q, a, torch.zeros_like(b)).T + \
            x.double().view(rows, -1, 32).sum(-1) @ b.double().T
    else:
        blocks, weight = _random_q8(out, cols, gen)
        got = q8_0_linear(x, blocks)
        want = _rounded_x(x) @ weight.T
    assert got.shape == (rows, out) and got.dtype == torch.float32
    got = got.double()
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    exact = x.double() @ weight.T
    error = (got - exact).norm() / exact.norm()
    assert 1e-5 < error < 0.02, error  # x was rounded (not the exact product), and close


def test_block_matmul_is_the_same_on_any_number_of_threads():
    gen = torch.Generator().manual_seed(1)
    q, a, b = _random_q4(1000, 576, gen)
    blocks, x = q4_blocks(q, a, b), torch.randn(3, 576, generator=gen)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = q4_1_linear(x, blocks)
        torch.set_num_threads(2)
        assert torch.equal(q4_1_linear(x, blocks), one)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q4_K], ids=lambda q: q.name)
def test_4bit_blocks_decode_to_the_values_ggml_dequantizes(qtype):
    """Q4_0 and Q4_1 exactly; Q4_K's products of scales rounded to fp16 (2^-11 relative)."""
    from gguf.quants import dequantize

    raw = _blocks(qtype, 16, 512)
    want = torch.from_numpy(dequantize(raw, qtype)).double().view(16, 512)
    got = decode_q4_blocks(q4_blocks(*int4_groups(GGUFBlocks.of("w", qtype, (16, 512),
                                                                 raw)))).double()
    tolerance = 0 if qtype != Q.Q4_K else 2**-11 * want.abs().max().item()
    assert (got - want).abs().max().item() <= tolerance


def test_q8_0_blocks_decode_to_the_values_ggml_dequantizes():
    from gguf.quants import dequantize

    raw = _blocks(Q.Q8_0, 8, 256)
    want = torch.from_numpy(dequantize(raw, Q.Q8_0)).view(8, 256)
    assert torch.equal(decode_q8_blocks(torch.from_numpy(raw.copy())), want)


def test_long_steps_decode_the_weight_and_stay_exact():
    from infer.quantization import cpu_blocks

    gen = torch.Generator().manual_seed(2)
    q, a, b = _random_q4(48, 64, gen)
    layer = torch.nn.Linear(64, 48, bias=False)
    Q4BlocksLinearMethod().load(layer, q, a, b)
    x = torch.randn(cpu_blocks.DEQUANTIZE_ROWS, 64, generator=gen)
    want = x.double() @ _weight(q, a, b).T
    got = layer.quant_method.apply(layer, x, None).double()
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4)  # x not rounded to int8


def test_bad_shapes_are_refused_by_name():
    blocks = torch.zeros(4, 3 * 20, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="do not match x's 64 columns"):
        q4_1_linear(torch.zeros(1, 64), blocks)
    with pytest.raises(RuntimeError, match="float32"):
        q4_1_linear(torch.zeros(1, 96, dtype=torch.bfloat16), blocks)


def test_the_instruction_set_follows_torchs_capability():
    assert isa_flags("AVX2", "x86_64", {"avx512_vnni"}) == ["-mavx2", "-mfma", "-mf16c"]
    assert "-mavx512vnni" in isa_flags("AVX512", "x86_64", {"avx512_vnni"})
    assert isa_flags("AVX512", "x86_64", set()) == ["-mavx2", "-mfma", "-mf16c"]
    assert isa_flags("DEFAULT", "x86_64", set()) is None
    assert isa_flags("AVX2", "aarch64", set()) is None
