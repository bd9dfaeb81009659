"""The residual add and RMSNorm in the epilogue of the projection before them
(`kernels/add_norm.py` through `gemv.gemv_add_norm` and `rows_mma(..., norm=)`; the
interpreter on the CPU, the GPU with INFER_TEST_DEVICE=cuda): the residual bit for bit the
product then `fused_add_rmsnorm`'s, the norm too under the interpreter and within two
ulps on a GPU (its squares summed in another order), float64's add and norm within
rounding; the counter left at 0; rows the epilogue does not take go to the norm's own
launch."""

from __future__ import annotations

import os

import pytest
import torch

from infer.kernels import triton_available

pytestmark = pytest.mark.skipif(not triton_available(), reason="triton is not installed")

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRETED else "cpu"
EIGHT_BIT = [torch.int8] + ([torch.float8_e4m3fn] if DEVICE == "cuda" else [])
EPS = 1e-5
ULP = {torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}


def _same_norm(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Bit for bit under the interpreter; on a GPU within two ulps of each value (the sum
    of squares in another order moves 1 / rms by float32 rounding, and `x * w` rounds
    twice)."""
    if INTERPRETED or DEVICE == "cpu":
        return torch.equal(got, want)
    return bool(((got.float() - want.float()).abs()
                 <= 2 * ULP[want.dtype] * want.float().abs() + 1e-6).all())


def _weight(n: int, k: int, wdtype: torch.dtype, gen: torch.Generator):
    """(weight, scale or None, the float64 weight it stands for), on DEVICE."""
    if wdtype in (torch.float16, torch.bfloat16):
        w = (torch.randn(n, k, generator=gen) * 0.05).to(wdtype)
        return w.to(DEVICE), None, w.double()
    w = torch.randint(-100, 100, (n, k), dtype=torch.int8, generator=gen).to(wdtype)
    scale = torch.rand(n, generator=gen) * 1e-3 + 1e-4
    return w.to(DEVICE), scale.to(DEVICE), w.double() * scale.double()[:, None]


@pytest.mark.parametrize("wdtype", [torch.bfloat16, torch.float16, *EIGHT_BIT])
@pytest.mark.parametrize(("n", "k", "offset"), [
    (37, 300, 0.0), (64, 2048, 1.0), (130, 96, 0.0), (1000, 64, 0.0)])
def test_the_add_and_norm_are_the_gemv_then_the_fused_add_norm(n, k, offset, wdtype):
    """Channels past the last program's block, K off the step, Gemma's `1 + w`, a row
    wider than the last program's warps hold at once."""
    from infer.kernels import launch_counters
    from infer.kernels.add_norm import COUNTERS
    from infer.kernels.gemv import gemv, gemv_add_norm
    from infer.kernels.rmsnorm import fused_add_rmsnorm

    gen = torch.Generator().manual_seed(n + k)
    dtype = torch.float16 if wdtype == torch.float16 else torch.bfloat16
    x = torch.randn(1, k, generator=gen).to(dtype).to(DEVICE)
    w, scale, dense = _weight(n, k, wdtype, gen)
    residual = torch.randn(1, n, generator=gen).to(dtype).to(DEVICE)
    norm_w = (torch.rand(n, generator=gen) + 0.5).to(dtype).to(DEVICE)
    want_res = residual.clone()
    want, _ = fused_add_rmsnorm(gemv(x, w, scale=scale), want_res, norm_w, EPS, offset)
    for _ in range(2):  # the second launch finds the counter as the first did
        got_res = residual.clone()
        got = gemv_add_norm(x, w, got_res, norm_w, EPS, offset, scale)
        assert got.shape == (1, n) and got.dtype == dtype
        assert torch.equal(got_res, want_res) and _same_norm(got, want)
    device = torch.empty(0, device=DEVICE).device
    assert int(launch_counters("gemv_add_norm", device, COUNTERS).abs().sum()) == 0
    h = residual.double().cpu() + x.double().cpu() @ dense.T
    ref = h / (h.pow(2).mean(-1, keepdim=True) + EPS).sqrt() * (norm_w.double().cpu() + offset)
    assert (got_res.double().cpu() - h).abs().max() <= 2e-2 * h.abs().max()
    assert (got.double().cpu() - ref).abs().max() <= 3e-2 * ref.abs().max()


@pytest.mark.parametrize(("dtype", "prompts"), [
    ("float32", ["The tiny model says"]),
    ("float16", ["The tiny model says", "Once upon", "A list: one, two,"])])
def test_a_model_with_the_add_and_norm_in_its_projections_keeps_its_tokens(dtype, prompts,
                                                                          count_calls):
    """`add_norm_epilogue`: a Llama model's decode steps (one row through the GEMV, three
    16-bit rows through rows_mma) launch no add + norm kernel of their own (every norm
    with a residual is in the projection before it), a prompt's step still does, and
    greedy tokens and logprobs are those with it off (on a GPU, the logprobs within
    rounding while the tokens agree)."""
    from tiny_model import tiny_model_dir

    import infer.kernels.rmsnorm as rmsnorm
    from infer import LLM, SamplingParams

    calls = count_calls(rmsnorm, "fused_add_rmsnorm")
    params = SamplingParams(max_tokens=4, temperature=0.0, logprobs=2, ignore_eos=True)
    outs = {}
    for on in (True, False):
        llm = LLM(str(tiny_model_dir()), device=DEVICE, dtype=dtype, num_blocks=64,
                  max_model_len=128, kernel_backend="triton", add_norm_epilogue=on,
                  cuda_graphs=False, async_scheduling=False)
        layers = len(llm.engine.core.runner.model.model.layers)
        calls.clear()
        outs[on] = [(out.token_ids, [lp[t].logprob for t, lp in zip(out.token_ids,
                                                                   out.logprobs)])
                    for o in llm.generate(prompts, params, use_tqdm=False)
                    for out in o.outputs]
        # Per step: the output projection's norm in each layer, the down projection's in
        # the next layer or the final norm: 2 * layers; the prompts' step and, when off,
        # the three decode steps.
        assert len(calls) == 2 * layers * (1 if on else 4), (on, len(calls))
        del llm
    if DEVICE == "cpu":
        assert outs[True] == outs[False]
    for (tokens, lps), (want_tokens, want_lps) in zip(outs[True], outs[False]):
        assert tokens[0] == want_tokens[0]
        for token, lp, want_token, want_lp in zip(tokens, lps, want_tokens, want_lps):
            if token != want_token:
                break
            assert lp == pytest.approx(want_lp, abs=2e-2)


@pytest.mark.parametrize(("m", "n", "k", "splits", "weight_first", "offset", "eight_bit"), [
    (5, 100, 256, 1, True, 0.0, False), (3, 72, 384, 3, True, 1.0, False),
    (8, 40, 256, 2, False, 0.0, False), (2, 130, 300, 1, True, 0.0, True),
    (7, 64, 512, 2, True, 0.0, True)])
def test_few_rows_add_and_norm_in_the_tensor_core_launch(m, n, k, splits, weight_first,
                                                          offset, eight_bit):
    """`rows_mma(..., norm=)`: rows_mma then `fused_add_rmsnorm` at the same launch
    (ragged channels, K slices, 8-bit weights, rows by two and one left over), float64's
    within rounding, the counter left at 0."""
    from infer.kernels import launch_counters
    from infer.kernels.add_norm import COUNTERS
    from infer.kernels.rmsnorm import fused_add_rmsnorm
    from infer.kernels.rows_mma import rows_mma

    gen = torch.Generator().manual_seed(m + n + k)
    x = torch.randn(m, k, generator=gen).to(torch.float16).to(DEVICE)
    w, scale, dense = _weight(n, k, torch.int8 if eight_bit else torch.float16, gen)
    if eight_bit:
        scale = scale.to(torch.float16)
        dense = w.double().cpu() * scale.double().cpu()[:, None]
    residual = torch.randn(m, n, generator=gen).to(torch.float16).to(DEVICE)
    norm_w = (torch.rand(n, generator=gen) + 0.5).to(torch.float16).to(DEVICE)
    launch = dict(splits=splits, weight_first=weight_first, block_n=64, block_k=128)
    want_res = residual.clone()
    want, _ = fused_add_rmsnorm(rows_mma(x, w, scale, **launch), want_res, norm_w, EPS,
                                offset)
    for _ in range(2):
        got_res = residual.clone()
        got = rows_mma(x, w, scale, norm=(got_res, norm_w, EPS, offset), **launch)
        assert got.shape == (m, n) and torch.equal(got_res, want_res)
        assert _same_norm(got, want)
    device = torch.empty(0, device=DEVICE).device
    assert int(launch_counters("rows_mma_add_norm", device, COUNTERS).abs().sum()) == 0
    h = residual.double().cpu() + x.double().cpu() @ dense.T
    ref = h / (h.pow(2).mean(-1, keepdim=True) + EPS).sqrt() * (norm_w.double().cpu() + offset)
    assert (got.double().cpu() - ref).abs().max() <= 1e-2 * ref.abs().max()


def test_the_epilogue_takes_a_row_or_two_a_load_within_its_threads_share():
    """`rows_at_once`: two rows a load where two rows' share of a thread fits
    FLOATS_PER_THREAD, one where one does, none past it or past MAX_ROWS rows."""
    from infer.kernels.add_norm import FLOATS_PER_THREAD, MAX_ROWS, rows_at_once

    assert (FLOATS_PER_THREAD, MAX_ROWS) == (32, 8)
    assert rows_at_once(4096, 1, 8) == 1  # 16 floats a thread
    assert rows_at_once(4096, 5, 4) == 1  # 32 a thread: one row a load
    assert rows_at_once(2048, 5, 4) == 2  # 16 a thread
    assert rows_at_once(3000, 2, 8) == 2  # 4,096 columns (a power of 2): 16 a thread
    assert rows_at_once(8192, 1, 4) == 0  # 64 a thread
    assert rows_at_once(2048, 9, 4) == 0  # more rows than MAX_ROWS


@pytest.mark.parametrize(("rows", "bias", "fused"), [
    (1, False, True), (5, False, True), (9, False, False), (1, True, False)])
def test_a_deferred_projection_is_added_and_normalised_in_its_launch_or_after_it(
        rows, bias, fused, count_calls):
    """An RMSNorm given a `DeferredMatmul` and a residual: where the projection's kernel
    takes the rows (one row to the GEMV, up to MAX_ROWS to rows_mma, no bias) no norm
    launch of its own, else the projection then the norm; either way the norm of the sum
    and the sum, as with the projection's output given."""
    import infer.kernels.rmsnorm as rmsnorm
    from infer.models.layers import RMSNorm
    from infer.models.linear import DeferredMatmul, RowParallelLinear, set_triton_gemv

    gen = torch.Generator().manual_seed(rows + 10 * bias)
    layer = RowParallelLinear(256, 96, bias=bias)
    norm = RMSNorm(96, EPS)
    with torch.no_grad():
        for p in (*layer.parameters(), *norm.parameters()):
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1 + (1.0 if p is norm.weight else 0))
    layer, norm = layer.to(DEVICE, torch.float16), norm.to(DEVICE, torch.float16)
    norm.use_triton = True
    set_triton_gemv(layer, True, 16)
    x = torch.randn(rows, 256, generator=gen).to(DEVICE, torch.float16)
    residual = torch.randn(rows, 96, generator=gen).to(DEVICE, torch.float16)
    want_res = residual.clone()
    want, _ = norm(layer(x), want_res)
    calls = count_calls(rmsnorm, "fused_add_rmsnorm")
    got_res = residual.clone()
    got, got_res = norm(DeferredMatmul(layer, x), got_res)
    assert len(calls) == (0 if fused else 1)
    assert torch.equal(got_res, want_res) and _same_norm(got, want)


@pytest.mark.skipif(DEVICE != "cuda", reason="8-bit weights and CUDA graphs on a GPU only")
@pytest.mark.parametrize("quantization", ["none", "int8", "fp8"])
def test_a_graphed_engine_with_the_epilogue_keeps_its_tokens(quantization):
    """`add_norm_epilogue` with CUDA graphs and dependent launch (the defaults), 16-bit,
    INT8 and FP8 weights, one sequence then three: greedy tokens and logprobs those with
    it off, within rounding while the tokens agree."""
    from tiny_model import tiny_model_dir

    from infer import LLM, SamplingParams

    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=0, ignore_eos=True)
    outs = {}
    for on in (True, False):
        llm = LLM(str(tiny_model_dir()), device="cuda", dtype="bfloat16", num_blocks=64,
                  max_model_len=128, quantization=quantization, add_norm_epilogue=on)
        outs[on] = [(out.token_ids, [lp[t].logprob for t, lp in zip(out.token_ids,
                                                                   out.logprobs)])
                    for prompts in (["The tiny model says"],
                                    ["The tiny model says", "Once upon", "One, two,"])
                    for o in llm.generate(prompts, params, use_tqdm=False)
                    for out in o.outputs]
        del llm
    compared = 0
    for (tokens, lps), (want_tokens, want_lps) in zip(outs[True], outs[False]):
        for token, lp, want_token, want_lp in zip(tokens, lps, want_tokens, want_lps):
            if token != want_token:
                break
            assert lp == pytest.approx(want_lp, abs=3e-2)
            compared += 1
    assert compared >= 16
