"""infer's CPU decode attention (`kernels/cpu_attention.cpp`) against the torch reference
path it stands in for, on random paged caches; where it does not apply, the reference
runs."""

from __future__ import annotations

import pytest
import torch

from infer.attention import torch_backend
from infer.attention.metadata import AttentionMetadata
from infer.kernels import cpu_attention, cpu_block_linear

pytestmark = pytest.mark.skipif(not cpu_block_linear.available(),
                                reason="infer's CPU kernels cannot be built here")


@pytest.fixture
def kernel_on():
    """The kernel enabled (as by default) for the test, and again after it."""
    cpu_attention.set_enabled(True)
    yield
    cpu_attention.set_enabled(True)


def _step(lens: list[int], heads: int, kv_heads: int, dim: int, seed: int,
          block_size: int = 16, dtype: torch.dtype = torch.float32):
    """(q, k_cache, v_cache, metadata) of an all-decode step over random blocks."""
    gen = torch.Generator().manual_seed(seed)
    blocks = sum(-(-n // block_size) for n in lens) + 3
    k = torch.randn(blocks, block_size, kv_heads, dim, generator=gen).to(dtype)
    v = torch.randn(blocks, block_size, kv_heads, dim, generator=gen).to(dtype)
    order = torch.randperm(blocks, generator=gen).tolist()
    tables, used = [], 0
    for n in lens:
        count = -(-n // block_size)
        tables.append(order[used:used + count])
        used += count
    meta = AttentionMetadata.build([1] * len(lens), lens, tables, block_size,
                                   torch.device("cpu"))
    q = torch.randn(len(lens), heads, dim, generator=gen).to(dtype)
    return q, k, v, meta


def _reference(q, k, v, meta, scale, **kw) -> torch.Tensor:
    cpu_attention.set_enabled(False)
    try:
        return torch_backend.paged_attention(q, k, v, meta, scale, **kw)
    finally:
        cpu_attention.set_enabled(True)


@pytest.mark.parametrize(("lens", "heads", "kv_heads", "dim"), [
    ([1], 9, 3, 64), ([100], 9, 3, 64), ([16, 17, 1, 250], 9, 3, 64), ([33, 5], 4, 4, 128),
    ([40, 41, 42], 8, 2, 80), ([7], 2, 1, 12)])
def test_the_kernel_gives_the_torch_paths_attention(lens, heads, kv_heads, dim, kernel_on,
                                                    monkeypatch):
    """Sequences of 1 key to several blocks' (block boundaries both sides), GQA groups of 1
    to 4, head sizes off the 8-lane step: within float32 rounding of the reference, and the
    kernel is what ran."""
    q, k, v, meta = _step(lens, heads, kv_heads, dim, seed=len(lens) * dim)
    calls = []
    real = cpu_attention.paged_decode
    monkeypatch.setattr(cpu_attention, "paged_decode",
                        lambda *a: calls.append(1) or real(*a))
    got = torch_backend.paged_attention(q, k, v, meta, dim ** -0.5)
    want = _reference(q, k, v, meta, dim ** -0.5)
    assert calls == [1]
    assert got.shape == want.shape and got.dtype == torch.float32
    assert (got - want).abs().max().item() < 1e-5


@pytest.mark.parametrize("case", ["window", "softcap", "bfloat16", "off"])
def test_what_the_kernel_does_not_cover_takes_the_torch_path(case, kernel_on, monkeypatch):
    q, k, v, meta = _step([20, 3], 4, 2, 64, seed=7,
                          dtype=torch.bfloat16 if case == "bfloat16" else torch.float32)
    kw = {"window": {"sliding_window": 8}, "softcap": {"logit_softcap": 30.0}}.get(case, {})
    if case == "off":
        cpu_attention.set_enabled(False)
    monkeypatch.setattr(cpu_attention, "paged_decode",
                        lambda *a: pytest.fail("the kernel ran"))
    torch_backend.paged_attention(q, k, v, meta, 0.125, **kw)


def test_the_knob_sets_the_kernel_per_engine_and_keeps_greedy_tokens(kernel_on):
    """`cpu_attention_kernel`: each engine sets it (one after another does not inherit it);
    the tiny model's greedy tokens and logprobs match with it off, to float32 rounding."""
    from tiny_model import tiny_model_dir

    from infer import LLM, SamplingParams

    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=1, ignore_eos=True)
    prompts = ["The tiny model says", "Once upon a time there was", "A"]
    outs = {}
    for on in (False, True):
        llm = LLM(str(tiny_model_dir()), device="cpu", num_blocks=64, max_model_len=128,
                  cpu_attention_kernel=on)
        assert cpu_attention._enabled is on
        outs[on] = [(out.token_ids, [lp[t].logprob for t, lp in
                                     zip(out.token_ids, out.logprobs)])
                    for o in llm.generate(prompts, params, use_tqdm=False)
                    for out in o.outputs]
        del llm
    for (tokens, logprobs), (want, want_logprobs) in zip(outs[True], outs[False]):
        assert tokens == want
        assert max(abs(a - b) for a, b in zip(logprobs, want_logprobs)) < 1e-4
