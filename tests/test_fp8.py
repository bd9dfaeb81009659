"""FP8 (e4m3) weights made at load (`quantization="fp8"`): the rounding bound of e4m3 per
channel, the FP8 GEMM path (per-token activation scales) against float64 from the FP8
values and their scales, the W8A16 kernel on FP8 weights (GPU), and SmolLM2 served in
FP8. Its perplexity on the fixed text rises 2.4 % with the linear layers in FP8 (W8A8 on
the CPU) and 2.8 % with the LM head in INT8 per row as well (the LM head alone in INT8:
+0.05 %): e4m3 keeps 3 mantissa bits, so a weight is rounded to within 2^-4 of itself,
where INT8 per channel (+0.6 %) rounds to 1/254 of the row's range. The 8-bit target of
1 % is not met by FP8 on this 135M model; the test holds the measured 2.8 % under 3 %."""

from __future__ import annotations

import os

import pytest
import torch
from real_models import smollm2_gguf
from test_quantization import smollm2_perplexities

from infer.models.linear import LinearBase, RowParallelLinear
from infer.quantization.fp8 import FP8, WEIGHT_ONLY_ROWS, Fp8LinearMethod, quantize_fp8

ON_GPU = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"


def test_per_channel_fp8_rounding_is_within_e4m3s_spacing():
    torch.manual_seed(0)
    w = torch.randn(64, 96) * torch.rand(64, 1) * 3
    w[5] = 0
    q, scale = quantize_fp8(w)
    assert q.dtype == FP8 and scale.shape == (64,) and (q[5].float() == 0).all()
    back = q.double() * scale.double()[:, None]
    # 3 mantissa bits: half a step is 2^-4 of the value; below e4m3's normal range
    # (2^-6) the steps are 2^-9 apart
    bound = torch.maximum(w.double().abs() * 2**-4, scale.double()[:, None] * 2**-10)
    assert ((w.double() - back).abs() <= bound + 1e-12).all()
    assert (q.float().abs().amax(dim=1)[torch.arange(64) != 5] == 448).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 33, 80])
def test_fp8_layer_matches_float64_from_the_fp8_values(dtype, rows):
    """On the CPU every step takes the FP8 GEMM; on CUDA steps of up to WEIGHT_ONLY_ROWS
    rows read the FP8 weight with 16-bit activations (the reference follows which)."""
    device = "cuda" if ON_GPU else "cpu"
    torch.manual_seed(rows)
    layer = RowParallelLinear(256, 96, bias=True)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(96, 256))
        layer.bias.copy_(torch.randn(96))
    layer = layer.to(device, dtype)
    Fp8LinearMethod().quantize(layer)
    assert layer.weight.dtype == FP8 and layer.weight_scale.dtype == torch.float32
    x = torch.randn(rows, 256).to(device, dtype)
    y = layer(x)
    w = layer.weight.double() * layer.weight_scale.double()[:, None]
    if device == "cuda" and rows <= WEIGHT_ONLY_ROWS:
        xs = x.double()
    else:
        xq, x_scale = quantize_fp8(x)
        xs = xq.double() * x_scale.double()[:, None]
    ref = xs @ w.T + layer.bias.double()
    assert y.dtype == dtype and y.shape == (rows, 96) and torch.isfinite(y).all()
    assert (y.double() - ref).abs().max().item() < 1e-2 * ref.abs().max().item()


@pytest.mark.skipif(not ON_GPU, reason="FP8 loads need a GPU (Triton's interpreter has none)")
@pytest.mark.parametrize(("m", "n", "k"), [(1, 40, 300), (5, 64, 256), (33, 70, 130)])
def test_w8a16_kernel_reads_fp8_weights(m, n, k):
    from infer.kernels.w8a16_matmul import w8a16_matmul

    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    w, scale = quantize_fp8(torch.randn(n, k, generator=gen))
    y = w8a16_matmul(x.cuda(), w.cuda(), scale.cuda()).cpu()
    ref = x.double() @ (w.double() * scale.double()[:, None]).T
    assert (y.double() - ref).abs().max().item() < 2e-2 * ref.abs().max().item()


def test_fp8_smollm2_perplexity_and_text():
    from infer import LLM, SamplingParams

    before, after, quantized = smollm2_perplexities("fp8")
    linears = [m for m in quantized.modules() if isinstance(m, LinearBase)]
    assert all(m.weight.dtype == FP8 for m in linears)
    # Not the 1 % for 8 bits (docs/performance.md): W8A8 in e4m3 raised it 1.8 % on
    # an AVX2 CPU, 2.0 % / 4.3 % on an AVX-512 one with two / one threads, 5.8 % with every
    # product in float64: 70 tokens' perplexity moves that much with the bf16 rounding of
    # products that agree to 0.4 %. A wrong scale or layout costs orders of magnitude.
    assert abs(after - before) / before < 0.07, (before, after)
    llm = LLM(str(smollm2_gguf()), device="cpu", quantization="fp8", max_model_len=512,
              num_blocks=64)
    assert llm.engine.info.quantization == "fp8"
    [out] = llm.generate("The capital of France is",
                         SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
    assert "Paris" in out.outputs[0].text


@pytest.mark.skipif(not ON_GPU, reason="FP8 stores need a GPU (Triton's interpreter has none)")
@pytest.mark.parametrize(("m", "k"), [(1, 4096), (70, 300), (3, 14336), (2, 20000)])
def test_row_quantization_kernel_equals_the_eager_one(m, k):
    from infer.kernels.fp8_quant import fp8_quantize_rows

    gen = torch.Generator().manual_seed(k)
    x = (torch.randn(m, k, generator=gen) * torch.rand(m, 1, generator=gen) * 10)
    x[0, :] = 0  # a row of zeros: scale 1
    x = x.to(torch.bfloat16).cuda()
    q, scale = fp8_quantize_rows(x)
    want_q, want_scale = quantize_fp8(x)
    assert torch.equal(scale, want_scale)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))


@pytest.mark.skipif(not ON_GPU, reason="FP8 rows: a GPU's (the interpreter has no FP8)")
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize(("rows", "k"), [(1, 4096), (17, 4096), (32, 1000), (5, 64)])
def test_the_norms_fp8_rows_are_fp8_quantize_rows_of_its_output(residual, rows, k):
    """`rmsnorm(..., fp8_rows=True)` (and the fused residual add's): its FP8 rows and scales
    are `fp8_quantize_rows` of the output it returns, bit for bit (a zero row: scale 1)."""
    from infer.kernels.fp8_quant import fp8_quantize_rows
    from infer.kernels.rmsnorm import fused_add_rmsnorm, rmsnorm

    gen = torch.Generator().manual_seed(rows + k)
    x = (torch.randn(rows, k, generator=gen) * 3).to("cuda", torch.bfloat16)
    x[-1] = 0 if rows > 1 else x[-1]
    w = (torch.rand(k, generator=gen) + 0.5).to("cuda", torch.bfloat16)
    if residual:
        r = torch.randn(rows, k, generator=gen).to("cuda", torch.bfloat16)
        r[-1] = -x[-1] if rows > 1 else r[-1]
        out, _, (q, scale) = fused_add_rmsnorm(x, r.clone(), w, 1e-6, fp8_rows=True)
    else:
        out, (q, scale) = rmsnorm(x, w, 1e-6, fp8_rows=True)
    want_q, want_scale = fp8_quantize_rows(out)
    assert torch.equal(q.view(torch.int8), want_q.view(torch.int8))
    assert torch.equal(scale, want_scale)
    plain = (fused_add_rmsnorm(x, r.clone(), w, 1e-6)[0] if residual else rmsnorm(x, w, 1e-6))
    assert torch.equal(out, plain)


@pytest.mark.skipif(not ON_GPU, reason="FP8 rows: a GPU's (the interpreter has no FP8)")
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize(("rows", "inter"), [(1, 14336), (20, 14336), (32, 1000), (3, 64)])
def test_the_activations_fp8_rows_are_fp8_quantize_rows_of_its_output(act, rows, inter):
    """`gated_rows(..., fp8_rows=True)`: its FP8 rows and scales are `fp8_quantize_rows` of
    the output it returns, bit for bit, and that output is the plain launch's (a zero
    row: scale 1)."""
    from infer.kernels.activation import gated_rows
    from infer.kernels.fp8_quant import fp8_quantize_rows

    gen = torch.Generator().manual_seed(rows + inter)
    gate_up = (torch.randn(rows, 2 * inter, generator=gen) * 4).to("cuda", torch.bfloat16)
    if rows > 1:
        gate_up[-1, :inter] = 0  # act(0) * up: a row of zeros
    out, (q, scale) = gated_rows(gate_up, act, fp8_rows=True)
    want_q, want_scale = fp8_quantize_rows(out)
    assert torch.equal(q.view(torch.int8), want_q.view(torch.int8))
    assert torch.equal(scale, want_scale) and (rows == 1 or scale[-1] == 1)
    assert torch.equal(out, gated_rows(gate_up, act))


@pytest.mark.skipif(not ON_GPU, reason="FP8 rows: a GPU's (the interpreter has no FP8)")
def test_an_fp8_models_steps_with_x_quantized_where_made_match_without(monkeypatch):
    """`fp8_norm_rows` / `fp8_act_rows`: a tiny FP8 model's batch of 20 greedy sequences
    (steps of 17-32 rows, FP8 x FP8) gives the tokens it gives without; each q/k/v and
    gate_up projection of such a step takes the norm's rows, each down projection the
    activation's (no quantizing launch of their own): of a layer's four launches, the
    o projection's alone is left with both."""
    from tiny_model import tiny_model_dir

    from infer import LLM, SamplingParams
    from infer.kernels import fp8_quant

    prompts = [[(7 * i + j) % 200 + 3 for j in range(5 + i % 4)] for i in range(20)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    runs = {}
    for norm, act in [(False, False), (True, False), (False, True), (True, True)]:
        llm = LLM(str(tiny_model_dir()), device="cuda", num_blocks=64, max_model_len=128,
                  quantization="fp8", fp8_norm_rows=norm, fp8_act_rows=act,
                  cuda_graphs=False)
        launches = []
        real = fp8_quant.fp8_quantize_rows
        monkeypatch.setattr(fp8_quant, "fp8_quantize_rows",
                            lambda x, real=real, seen=launches: seen.append(len(x)) or real(x))
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        monkeypatch.setattr(fp8_quant, "fp8_quantize_rows", real)
        runs[norm, act] = ([o.outputs[0].token_ids for o in outs],
                           len([n for n in launches if n == 20]))
    tokens, launches = runs[False, False]
    assert launches > 0 and launches % 4 == 0
    assert runs[True, False] == (tokens, launches // 2)
    assert runs[False, True] == (tokens, launches * 3 // 4)
    assert runs[True, True] == (tokens, launches // 4)


def test_the_fp8_norm_rows_are_the_steps_fp8_by_fp8_takes():
    """`_fp8_x_rows`, hand-computed: past the weight-only rows (16, or the tensor-core
    rows if more; from 1 with fp8_decode_activations) and fp8_wgmma's, up to fp8_mma_rows;
    `set_fp8_norms` gives them to the norms before a projection of an FP8 model only."""
    from infer.models.layers import RMSNorm
    from infer.models.linear import ColumnParallelLinear, _fp8_x_rows, set_fp8_norms

    assert _fp8_x_rows(16, False, 32, 0) == range(17, 33)
    assert _fp8_x_rows(24, False, 32, 0) == range(25, 33)
    assert _fp8_x_rows(16, True, 32, 0) == range(1, 33)
    assert _fp8_x_rows(16, True, 32, 8) == range(9, 33)
    assert _fp8_x_rows(16, False, 0, 0) == range(17, 1)  # empty: FP8 x FP8 off
    attention = torch.nn.Module()
    attention.q_norm = RMSNorm(16, 1e-6, feeds_projection=False)
    model = torch.nn.ModuleList([RMSNorm(64, 1e-6), ColumnParallelLinear(64, 64, bias=False),
                                 attention])
    set_fp8_norms(model, range(17, 33))
    assert model[0].fp8_rows == range(0)  # no FP8 layer
    Fp8LinearMethod().quantize(model[1])
    set_fp8_norms(model, range(17, 33))
    assert model[0].fp8_rows == range(17, 33) and attention.q_norm.fp8_rows == range(0)


def test_an_fp8_models_norms_and_activations_round_for_the_layers_they_feed():
    """In a Llama model made FP8 (`quantize_model`: its LM head INT8), every norm before a
    q/k/v or gate_up projection hands out FP8 rows and no int8 halves, the final norm the
    int8 halves its INT8 LM head takes and no FP8 rows, every gated activation FP8 rows
    for its down projection (`set_8bit_kernels`); none in a bfloat16 model, nor in an MLP
    wider than one program's row."""
    from infer.kernels.fp8_quant import ROW_IN_REGISTERS
    from infer.models import config_from_hf, model_class
    from infer.models.layers import GatedMLP, RMSNorm
    from infer.models.linear import set_8bit_kernels, set_fp8_activations
    from infer.quantization import quantize_model

    cfg = config_from_hf(dict(model_type="llama", vocab_size=32, hidden_size=64,
                              intermediate_size=96, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2))
    plain = model_class(cfg)(cfg)
    model = model_class(cfg)(cfg)
    assert quantize_model(model, "fp8") == "fp8"
    for m in (plain, model):
        set_8bit_kernels(m, 16, False, 32, int8_mma_rows=64, int8_x16_gemv=True,
                         fp8_norm_rows=True, fp8_act_rows=True)
    norms = {name: (m.fp8_rows, m.x16_rows) for name, m in model.named_modules()
             if isinstance(m, RMSNorm)}
    assert norms.pop("model.norm") == (range(0), range(1, 65))
    assert len(norms) == 4 and set(norms.values()) == {(range(17, 33), range(0))}
    mlps = [m.fp8_rows for m in model.modules() if isinstance(m, GatedMLP)]
    assert mlps == [range(17, 33)] * 2
    wide = GatedMLP(64, ROW_IN_REGISTERS + 16, "silu")  # rows wider than one program holds
    Fp8LinearMethod().quantize(wide.down_proj)
    set_fp8_activations(wide, range(17, 33))
    assert wide.fp8_rows == range(0)
    assert {(m.fp8_rows, m.x16_rows) for m in plain.modules()
            if isinstance(m, RMSNorm)} == {(range(0), range(0))}
    assert {m.fp8_rows for m in plain.modules() if isinstance(m, GatedMLP)} == {range(0)}
