"""Weight-only INT4 in groups (`quantization="int4"`): the rounding, the packed layout
against hand-made words, the INT4 GEMV kernel (in the interpreter on the CPU; on the GPU
with INFER_TEST_DEVICE=cuda) and both linear paths against float64 products of the
integers, scales and zeros; SmolLM2's perplexity within 3 % of the unquantized model's
(the 4-bit target) and an engine serving it."""

from __future__ import annotations

import os

import pytest
import torch
from real_models import smollm2_gguf

from infer.kernels import triton_available
from infer.models.linear import LinearBase, MergedColumnParallelLinear, RowParallelLinear
from infer.quantization.int4_weights import (
    Int4WeightOnlyLinearMethod,
    channel_block,
    group_size,
    kernel_layout,
    pack_words,
    quantize_groups,
    unblocked,
    unpack_words,
)

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRETED else "cpu"
needs_triton = pytest.mark.skipif(not triton_available(), reason="triton is not installed")


def _dequantized(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    rows, cols = q.shape
    groups = scale.shape[1]
    w = q.double().view(rows, groups, cols // groups) * scale.double()[..., None] \
        + zero.double()[..., None]
    return w.view(rows, cols)


@pytest.mark.parametrize("group", [32, 64, 128])
def test_each_weight_is_within_half_a_step_of_its_value(group):
    gen = torch.Generator().manual_seed(group)
    w = torch.randn(48, 256, generator=gen) * torch.rand(48, 1, generator=gen) * 3
    w[3, :group] = 0.25  # a constant group
    q, scale, zero = quantize_groups(w, group, torch.bfloat16)
    assert q.dtype == torch.uint8 and int(q.max()) <= 15
    assert scale.shape == zero.shape == (48, 256 // group) and scale.dtype == torch.bfloat16
    err = (w.double() - _dequantized(q, scale, zero)).abs().view(48, -1, group)
    # half a step, and the few weights past the range rounded scale and zero cover
    step = scale.double()[..., None]
    assert (err <= step / 2 + 2 ** -7 * (w.abs().view(48, -1, group).double() + step)).all()
    assert float(err[3, 0].max()) == 0 and (q[3, :group] == 0).all()
    # each group's extremes land on the ends of the range
    lows = q.view(48, -1, group).amin(-1)
    assert (lows == 0).all()


def test_words_hold_a_groups_values_at_its_eighths():
    """Group of 32 (four words): nibble i of word j holds value 4 i + j, lowest bits
    first."""
    q = torch.arange(64, dtype=torch.uint8).remainder(16).view(1, 64)
    q[0, 32:] = torch.tensor([15 - (v % 16) for v in range(32)], dtype=torch.uint8)
    words = pack_words(q, 32)
    assert words.dtype == torch.int32 and words.shape == (1, 8)
    # (read as unsigned: a top nibble of 8 or more sets the sign bit)
    first = [int(w) & 0xFFFFFFFF for w in words[0, :4]]
    # word 0: values 0, 4, 8, ..., 28 -> q 0, 4, 8, 12, 0, 4, 8, 12
    assert first[0] == 0xC840C840 and first[1] == 0xD951D951
    second = int(words[0, 4]) & 0xFFFFFFFF  # values 32, 36, ...: q 15, 11, 7, 3, ...
    assert second == 0x37BF37BF
    assert torch.equal(unpack_words(words, 32), q)
    gen = torch.Generator().manual_seed(1)
    for group in (32, 64, 128):
        q = torch.randint(0, 16, (5, 256), generator=gen, dtype=torch.uint8)
        assert torch.equal(unpack_words(pack_words(q, group), group), q)


def test_kernel_layout_puts_each_block_of_channels_in_one_run():
    """Block b of the words is channels b B .. b B + B - 1, K-major: element [b, r, c] is
    word r of channel b B + c; scales and zeros alike; `unblocked` undoes it. The block
    divides the channels and, for an even count, half of them (a gated MLP's gate and up
    never share one)."""
    gen = torch.Generator().manual_seed(3)
    q, scale, zero = quantize_groups(torch.randn(24, 256, generator=gen), 64, torch.bfloat16)
    words = pack_words(q, 64)
    for block in (1, 4, 8, 24):
        packed, s, z = kernel_layout(q, scale, zero, block)
        assert packed.shape == (24 // block, 32, block) and s.shape == (24 // block, 4, block)
        assert packed.is_contiguous() and s.is_contiguous()
        for b, r, c in ((0, 0, 0), (24 // block - 1, 31, block - 1), (0, 5, block // 2)):
            assert packed[b, r, c] == words[b * block + c, r]
            assert z[b, min(r, 3), c] == zero[b * block + c, min(r, 3)]
        assert torch.equal(unblocked(packed), words) and torch.equal(unblocked(s), scale)
    assert [channel_block(n) for n in (28672, 576, 72, 40, 12, 37)] == [8, 8, 4, 4, 2, 1]


@needs_triton
def test_kernels_give_the_same_sums_for_every_blocking():
    """The blocks change where a channel's words lie, not what is summed: the GEMV's rows
    and `int4_matmul`'s are bit for bit the same for blocks of 1, 2, 8 and all 48
    channels (the layout before blocks), and match float64."""
    from infer.kernels.int4_gemv import int4_gemv
    from infer.kernels.int4_matmul import int4_matmul

    q, scale, zero = _int4_weight(48, 512, 64, 11)
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(11)).to(torch.bfloat16)
    x = x.to(DEVICE)
    ref = x.cpu().double() @ _dequantized(q, scale, zero).T
    gemv, mma = [], []
    for block in (1, 2, 8, 48):
        args = [t.to(DEVICE) for t in kernel_layout(q, scale, zero, block)]
        gemv.append(int4_gemv(x[:2], *args).cpu())
        mma.append(int4_matmul(x, *args).cpu())
    for y in gemv[1:]:
        assert torch.equal(y, gemv[0])
    for y in mma[1:]:
        assert torch.equal(y, mma[0])
    assert (gemv[0].double() - ref[:2]).abs().max() < 1e-2 * ref.abs().max()
    assert (mma[0].double() - ref).abs().max() < 1e-2 * ref.abs().max()


def test_group_size_is_the_largest_that_divides():
    assert group_size(2048) == 128 and group_size(576) == 64 and group_size(96) == 32
    assert group_size(100) is None
    layer = RowParallelLinear(100, 32, bias=False)
    with pytest.raises(ValueError, match="no INT4 group size"):
        Int4WeightOnlyLinearMethod().quantize(layer)


def _int4_weight(n: int, k: int, group: int, seed: int, dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(seed)
    q, scale, zero = quantize_groups(torch.randn(n, k, generator=gen), group, dtype)
    return q, scale, zero


CASES = [  # (n, k, group, launch): rows past N in the last block, K not a multiple of the
    # step, K in one step, wide tiles, the default launch
    (40, 384, 128, (8, 256, 4)), (37, 256, 32, (8, 64, 2)), (70, 1024, 64, (16, 512, 4)),
    (64, 512, 128, (4, 512, 4)), (130, 2048, 128, None)]


@needs_triton
@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_kernel_matches_float64_from_the_integers(case, rows):
    from infer.kernels.gemv import Launch
    from infer.kernels.int4_gemv import int4_gemv

    n, k, group, launch = CASES[case]
    q, scale, zero = _int4_weight(n, k, group, case)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(10 + case))
    args = [t.to(DEVICE) for t in kernel_layout(q, scale, zero)]
    y = int4_gemv(x.to(DEVICE), *args, launch and Launch(*launch)).cpu()
    ref = x.double() @ _dequantized(q, scale, zero).T
    assert y.shape == (rows, n) and y.dtype == torch.float32
    assert (y.double() - ref).abs().max().item() < 1e-5 * ref.abs().max().item()


@needs_triton
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_gate_up_form_is_the_product_then_the_activation(act):
    from infer.kernels.activation import gated_rows
    from infer.kernels.gemv import Launch
    from infer.kernels.int4_gemv import int4_gemv, int4_gemv_gate_up

    q, scale, zero = _int4_weight(2 * 36, 256, 64, 7)
    args = [t.to(DEVICE) for t in kernel_layout(q, scale, zero)]
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    x = x.to(DEVICE)
    for launch in (Launch(8, 128, 4), None):
        y = int4_gemv_gate_up(x, *args, act, launch)
        both = int4_gemv(x, *args, launch and Launch(launch.block_n // 2, 128, 4))
        assert y.shape == (2, 36)
        assert torch.equal(y.cpu(), gated_rows(both, act).cpu())


def _packed_layer(n: int, k: int, seed: int) -> RowParallelLinear:
    """A layer with the CUDA layout (`Int4WeightOnlyLinearMethod.load`) on any device."""
    layer = RowParallelLinear(k, n, bias=True).to(torch.bfloat16)
    with torch.no_grad():
        layer.bias.copy_(torch.randn(n, generator=torch.Generator().manual_seed(seed)))
    q, scale, zero = _int4_weight(n, k, group_size(k), seed)
    Int4WeightOnlyLinearMethod().load(layer, q, scale, zero)
    return layer.to(DEVICE)


@needs_triton
@pytest.mark.parametrize("rows", [1, 2, 5])
def test_packed_layer_matches_float64(rows):
    """One or two rows through the kernel, more through the dequantized weight."""
    layer = _packed_layer(96, 320, rows)
    method = layer.quant_method
    assert layer.weight.dtype == torch.int32 and layer.weight.shape == (12, 40, 8)
    x = torch.randn(rows, 320, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    y = layer(x.to(DEVICE)).cpu()
    w = method.dequantize(layer).cpu().double()
    ref = x.double() @ w.T + layer.bias.cpu().double()
    assert y.dtype == torch.bfloat16 and torch.isfinite(y).all()
    assert (y.double() - ref).abs().max().item() < 8e-3 * ref.abs().max().item()
    gate_up = method.apply_gate_up(layer, x.to(DEVICE), "silu", None)
    assert (gate_up is None) == (rows > 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 33])
def test_cpu_layer_matches_float64(dtype, rows):
    """On the CPU the layer takes torch's packed INT4 kernel, with 16-bit activations."""
    torch.manual_seed(rows)
    layer = RowParallelLinear(192, 64, bias=True).to(dtype)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(64, 192))
        layer.bias.copy_(torch.randn(64))
    dense = layer.weight.detach().double().clone()
    Int4WeightOnlyLinearMethod().quantize(layer)
    assert layer.quant_method.format == "int4" and layer.weight.dtype != dtype
    w = layer.quant_method.dequantize(layer).double()
    assert (w - dense).abs().max().item() < 0.6 * (dense.abs().max().item() * 2 / 15)
    x = torch.randn(rows, 192).to(dtype)
    ref = x.to(torch.bfloat16).double() @ w.T + layer.bias.double()
    y = layer(x)
    assert y.dtype == dtype
    assert (y.double() - ref).abs().max().item() < 2e-2 * ref.abs().max().item()


def test_quantized_as_loaded_is_the_loaded_layer_quantized():
    """Built to quantize at load (`from_float`), a fused layer whose shards arrive one at a
    time holds one byte a value until `finish`, then the weights `quantize` makes of the
    whole float layer."""
    from infer.quantization import method_made_at_load

    gen = torch.Generator().manual_seed(4)
    gate, up = torch.randn(32, 192, generator=gen), torch.randn(32, 192, generator=gen)
    built = MergedColumnParallelLinear(192, [32, 32], quant_method=method_made_at_load(
        "int4")())
    assert built.weight.dtype == torch.uint8 and built.weight.shape == (64, 192)
    for shard, tensor in enumerate((gate, up)):
        built.weight.weight_loader(built.weight, tensor, shard)
    built.quant_method.finish(built)
    whole = MergedColumnParallelLinear(192, [32, 32])
    with torch.no_grad():
        whole.weight.copy_(torch.cat([gate, up]))
    Int4WeightOnlyLinearMethod().quantize(whole)
    assert built.quant_method.format == whole.quant_method.format == "int4"
    assert torch.equal(built.quant_method.dequantize(built),
                       whole.quant_method.dequantize(whole))
    with pytest.raises(ValueError, match="no INT4 group size"):
        RowParallelLinear(100, 32, quant_method=method_made_at_load("int4")())


def test_every_linear_layer_of_a_real_model_is_converted_and_perplexity_within_3_percent(
        monkeypatch):
    """In groups of 32: SmolLM2's only weights here are the GGUF file's Q4_1 blocks of 32
    (the "unquantized" model is their dequantized values), which groups of 32 can
    reproduce, up to the 16-bit rounding of scale and zero (17.18 -> 17.29); coarser
    groups re-quantize one 4-bit grid onto another (64: 26.6, 128 and 64: 29.5)."""
    from test_quantization import smollm2_perplexities

    from infer.quantization import int4_weights

    monkeypatch.setattr(int4_weights, "GROUPS", (32,))
    before, after, quantized = smollm2_perplexities("int4")
    linears = [m for m in quantized.modules() if isinstance(m, LinearBase)]
    assert linears and all(m.quant_method.format == "int4" for m in linears)
    assert any(isinstance(m, MergedColumnParallelLinear) for m in linears)
    assert abs(after - before) / before < 0.03, (before, after)


def test_an_engine_serves_int4_weights():
    from infer import LLM, SamplingParams

    llm = LLM(str(smollm2_gguf()), device="cpu", quantization="int4")
    linears = [m for m in llm.engine.model.modules() if isinstance(m, LinearBase)]
    assert linears and all(m.quant_method.format == "int4" for m in linears)
    [out] = llm.generate("The capital of France is",
                         SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
    assert "Paris" in out.outputs[0].text


@needs_triton
@pytest.mark.parametrize("act", ["", "silu"])
def test_a_set_skip_flag_leaves_the_first_of_two_rows_out(act):
    """Inside `row_skip.first_row_skipped_where(flag)`: flag 1 -> a two-row launch's second
    row is bit for bit its one-row launch and the first (NaN here) is not multiplied; flag
    0 -> both rows as outside."""
    from infer.kernels.int4_gemv import int4_gemv, int4_gemv_gate_up
    from infer.kernels.row_skip import first_row_skipped_where

    q, scale, zero = _int4_weight(2 * 24, 384, 128, 9)
    args = [t.to(DEVICE) for t in kernel_layout(q, scale, zero)]
    x = torch.randn(2, 384, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    x = x.to(DEVICE)

    def product(rows: torch.Tensor) -> torch.Tensor:
        if act:
            return int4_gemv_gate_up(rows, *args, act)
        return int4_gemv(rows, *args)

    both = product(x)
    flag = torch.ones(1, dtype=torch.int32, device=DEVICE)
    poisoned = x.clone()
    poisoned[0] = float("nan")
    with first_row_skipped_where(flag):
        skipped = product(poisoned)
        flag.zero_()
        unskipped = product(x)
    # the NaN row was not multiplied (its output row holds what the allocation held)
    assert not torch.isnan(skipped[0]).all()
    second = skipped[1:]
    assert torch.equal(second, product(x[1:]))
    assert torch.equal(second, both[1:])
    assert torch.equal(unskipped, both)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("rows", "n", "k", "group", "block_k"), [
    (3, 40, 384, 128, 256),  # groups not a multiple of the step, channels past the block
    (5, 64, 256, 32, 64),  # a plane of 16 rows from four groups of 32
    (17, 96, 512, 64, 128),  # 17 rows in a block of 32
    (64, 64, 256, 128, 128)])
def test_matmul_matches_float64(dtype, rows, n, k, group, block_k):
    """`int4_matmul` (3 to 64 rows) against float64 from the integers: TF32 keeps a 16-bit
    x exactly and each weight to 2^-11 (the interpreter multiplies in float32)."""
    from infer.kernels.int4_matmul import int4_matmul

    q, scale, zero = _int4_weight(n, k, group, rows, dtype)
    args = [t.to(DEVICE) for t in kernel_layout(q, scale, zero)]
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(dtype)
    y = int4_matmul(x.to(DEVICE), *args, block_k=block_k).cpu()
    ref = x.double() @ _dequantized(q, scale, zero).T
    assert y.shape == (rows, n) and y.dtype == dtype
    assert (y.double() - ref).abs().max().item() < 8e-3 * ref.abs().max().item()
