"""fp8_sync_mma.py: FP8 weights times 1..32 rows of FP8 x on the synchronous MMA (Gluon),
the weights loaded straight into its register operand and made float16 there.

The kernel runs only on a Hopper GPU (`INFER_TEST_DEVICE=cuda` there; its compile for
sm_90 is in test_kernels_compile_for_sm90.py). On the CPU: which steps an FP8 model sends
to it, and that the norms and activations quantize x for those steps."""

from __future__ import annotations

import pytest
import torch

from infer.kernels import gluon_hopper, triton_available


def _hopper() -> bool:
    return (torch.cuda.is_available() and triton_available()
            and gluon_hopper(torch.device("cuda"), "fp8_sync_mma"))


hopper = pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU and Triton's Gluon")


def _fp8(shape: tuple[int, int], gen: torch.Generator, spread: float) -> torch.Tensor:
    return (torch.randn(shape, generator=gen) * spread).clamp(-448, 448).to(torch.float8_e4m3fn)


@hopper
@pytest.mark.parametrize(("m", "n", "k", "launch"),
                         [(1, 200, 4096, {}), (1, 6144, 4096, dict(block_k=256, splits=3)),
                          (3, 64, 272, {}), (8, 130, 1024, dict(block_k=128, splits=2)),
                          (9, 4096, 14336, {}), (16, 96, 640, dict(block_k=64, splits=1)),
                          (32, 28672, 4096, dict(block_k=512, splits=1)),
                          (17, 100, 4000, dict(block_k=256, splits=5))])
def test_the_kernel_matches_float64(m, n, k, launch):
    """Products of FP8 values exact (float16 holds them), float32 sums, one rounding to
    bfloat16 at the end: within 2^-8 of the float64 result plus 1e-5 of the sum of
    |products|; x's rows a view of wider ones (their stride not K)."""
    from infer.kernels.fp8_sync_mma import fp8_sync_mma

    gen = torch.Generator().manual_seed(m + n + k)
    xq = _fp8((m, k + 32), gen, 80)[:, :k]
    x_scale = torch.rand(m, generator=gen) * 1e-2 + 1e-3
    w = _fp8((n, k), gen, 60)
    scale = torch.rand(n, generator=gen) * 1e-3 + 1e-4
    x64 = xq.double() * x_scale.double()[:, None]
    w64 = w.double() * scale.double()[:, None]
    want = x64 @ w64.T
    bound = x64.abs() @ w64.abs().T
    got = fp8_sync_mma(xq.cuda(), x_scale.cuda(), w.cuda(), scale.cuda(), **launch)
    assert got.shape == (m, n) and got.dtype == torch.bfloat16
    got = got.double().cpu()
    assert ((got - want).abs() <= 2 ** -8 * want.abs() + 1e-5 * bound).all()
    # the K slices' counters were left at zero: the same launch again, the same numbers
    again = fp8_sync_mma(xq.cuda(), x_scale.cuda(), w.cuda(), scale.cuda(), **launch)
    assert torch.equal(again.double().cpu(), got)


@hopper
def test_every_byte_exactly_through_one_hot_rows():
    """Each of W's 256 bytes (NaNs left out) times 1.0 in x, one column a row of x: the
    weight's own value, so every weight met its own x."""
    from infer.kernels.fp8_sync_mma import fp8_sync_mma

    n, k = 64, 256
    w = torch.arange(n * k).remainder(251).to(torch.uint8)
    w = torch.where((w & 0x7F) == 0x7F, torch.zeros_like(w), w).view(torch.float8_e4m3fn)
    w = w.reshape(n, k)
    for rows in (1, 8, 32):
        cols = torch.randperm(k, generator=torch.Generator().manual_seed(rows))[:rows]
        xq = torch.zeros(rows, k)
        xq[torch.arange(rows), cols] = 1.0
        got = fp8_sync_mma(xq.to(torch.float8_e4m3fn).cuda(), torch.ones(rows, device="cuda"),
                           w.cuda(), torch.ones(n, device="cuda")).float().cpu()
        assert torch.equal(got, w.float()[:, cols].T.to(torch.bfloat16).float())


@hopper
@pytest.mark.parametrize("rows", [1, 5, 16])
def test_an_fp8_layer_sends_its_steps_there(rows):
    """With `fp8_sync_mma_rows` set, the FP8 method's plain step of x quantizes x by rows
    (`fp8_quantize_rows`) and multiplies in this kernel; its gate_up leaves the activation
    to a launch of its own (None)."""
    from infer.kernels.fp8_quant import fp8_quantize_rows
    from infer.kernels.fp8_sync_mma import fp8_sync_mma
    from infer.models.linear import MergedColumnParallelLinear
    from infer.quantization.fp8 import Fp8LinearMethod

    torch.manual_seed(rows)
    layer = MergedColumnParallelLinear(512, [384, 384])
    with torch.no_grad():
        layer.weight.copy_(torch.randn(768, 512))
    layer = layer.to("cuda", torch.bfloat16)
    Fp8LinearMethod().quantize(layer)
    layer.fp8_sync_mma_rows = 16
    x = torch.randn(rows, 512, device="cuda").to(torch.bfloat16)
    assert layer.forward_gate_up(x, "silu") is None
    xq, x_scale = fp8_quantize_rows(x)
    want = fp8_sync_mma(xq, x_scale, layer.weight, layer.weight_scale)
    assert torch.equal(layer(x), want)


@hopper
def test_an_fp8_models_tokens_match_fp8_x_through_rows_mma():
    """A tiny FP8 model's greedy tokens at 1 and 12 sequences with `fp8_sync_mma_rows`
    are those of `fp8_decode_activations` (x quantized the same way at every decode step,
    multiplied by rows_mma: the same products, summed in another order)."""
    from tiny_model import tiny_model_dir

    from infer import LLM, SamplingParams

    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    for count in (1, 12):
        prompts = [{"prompt_token_ids": [(5 * i + j) % 200 + 3 for j in range(4 + i % 3)]}
                   for i in range(count)]
        tokens = []
        for flags in (dict(fp8_sync_mma_rows=16), dict(fp8_decode_activations=True)):
            llm = LLM(str(tiny_model_dir()), device="cuda", num_blocks=64, max_model_len=128,
                      quantization="fp8", cuda_graphs=False, **flags)
            tokens.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
        assert tokens[0] == tokens[1]


def test_the_norms_and_activations_quantize_for_the_sync_steps():
    """`set_8bit_kernels` with `fp8_sync_mma_rows`: an FP8 model's norms before a q/k/v or
    gate_up projection and its gated activations hand out FP8 rows at 1..that many rows as
    well as at the FP8 x FP8 steps (17..fp8_mma_rows), none at the weight-only rows
    between; the final norm (before the INT8 LM head) none."""
    from infer.models import config_from_hf, model_class
    from infer.models.layers import GatedMLP, RMSNorm
    from infer.models.linear import set_8bit_kernels
    from infer.quantization import quantize_model

    cfg = config_from_hf(dict(model_type="llama", vocab_size=32, hidden_size=64,
                              intermediate_size=96, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2))
    model = model_class(cfg)(cfg)
    assert quantize_model(model, "fp8") == "fp8"
    set_8bit_kernels(model, 16, False, 32, fp8_norm_rows=True, fp8_act_rows=True,
                     fp8_sync_mma_rows=4)
    want = set(range(1, 5)) | set(range(17, 33))
    norms = {name: set(m.fp8_rows) for name, m in model.named_modules()
             if isinstance(m, RMSNorm)}
    assert norms.pop("model.norm") == set()
    assert len(norms) == 4 and all(rows == want for rows in norms.values())
    mlps = [set(m.fp8_rows) for m in model.modules() if isinstance(m, GatedMLP)]
    assert mlps == [want] * 2
    set_8bit_kernels(model, 16, False, 32, fp8_norm_rows=True, fp8_act_rows=True)
    assert all(set(m.fp8_rows) == set(range(17, 33)) for m in model.modules()
               if isinstance(m, GatedMLP))
