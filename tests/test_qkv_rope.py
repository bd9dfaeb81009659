"""The q/k/v projection with RoPE and the KV store in its epilogue (`kernels/qkv_rope.py`;
the interpreter on the CPU, the GPU with INFER_TEST_DEVICE=cuda) against the GEMV then
`rope_store_kv` at the same launch: q and the caches bit for bit, float64's within
rounding."""

from __future__ import annotations

import os

import pytest
import torch

from infer.kernels import triton_available

pytestmark = pytest.mark.skipif(not triton_available(), reason="triton is not installed")

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRETED else "cpu"


def _tables(head_dim: int, positions: int = 64):
    angles = (torch.arange(float(positions))[:, None]
              / 10000 ** (torch.arange(head_dim // 2) / (head_dim // 2)))
    return angles.cos().to(DEVICE), angles.sin().to(DEVICE)


@pytest.mark.parametrize("eight_bit", [False, True])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "k", "slot"), [
    (4, 2, 16, 64, 37), (6, 2, 32, 96, 5), (8, 8, 8, 48, -1), (3, 1, 64, 128, 0)])
def test_the_epilogue_is_the_projection_then_rope_and_the_store(heads, kv_heads, head_dim, k,
                                                                slot, eight_bit):
    """Head counts whose pairs do not fill the last program, GQA and not, a slot of -1
    (nothing stored), 16-bit and INT8 weights."""
    from infer.kernels.gemv import gemv
    from infer.kernels.qkv_rope import qkv_rope
    from infer.kernels.rope_kv_store import rope_store_kv

    gen = torch.Generator().manual_seed(heads * 100 + head_dim + k)
    dtype = torch.float16
    n = (heads + 2 * kv_heads) * head_dim
    x = torch.randn(1, k, generator=gen).to(dtype).to(DEVICE)
    if eight_bit:
        w = torch.randint(-100, 100, (n, k), dtype=torch.int8, generator=gen).to(DEVICE)
        scale = (torch.rand(n, generator=gen) * 1e-2 + 1e-3).to(dtype).to(DEVICE)
    else:
        w = (torch.randn(n, k, generator=gen) * 0.1).to(dtype).to(DEVICE)
        scale = None
    caches = [torch.randn(6, 8, kv_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
              for _ in range(2)]
    cos, sin = _tables(head_dim)
    positions = torch.tensor([41], device=DEVICE)
    slots = torch.tensor([slot], device=DEVICE)
    want_caches = [c.clone() for c in caches]
    qkv = gemv(x, w, scale=scale)
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    want_q = rope_store_kv(
        qkv[:, :q_size].reshape(1, heads, head_dim).clone(),
        qkv[:, q_size:q_size + kv_size].reshape(1, kv_heads, head_dim),
        qkv[:, q_size + kv_size:].reshape(1, kv_heads, head_dim), *want_caches, slots,
        positions, cos, sin)
    got_caches = [c.clone() for c in caches]
    got_q = qkv_rope(x, w, scale, heads, kv_heads, *got_caches, slots, positions, cos, sin)
    assert got_q.shape == (1, heads, head_dim)
    assert torch.equal(got_q, want_q)
    for got, want, before in zip(got_caches, want_caches, caches):
        assert torch.equal(got, want)
        assert (slot < 0) == torch.equal(got, before)
    # float64: q's first head, rotated at position 41
    dense = w.double().cpu() * (1.0 if scale is None else scale.double().cpu()[:, None])
    y = (x.double().cpu() @ dense.T)[0, :head_dim]
    c, s = cos[41].double().cpu(), sin[41].double().cpu()
    h = head_dim // 2
    ref = torch.cat([y[:h] * c - y[h:] * s, y[h:] * c + y[:h] * s])
    assert (got_q[0, 0].double().cpu() - ref).abs().max() <= 4e-3 * ref.abs().max()


@pytest.mark.parametrize("graphs", [False, True])
def test_a_model_with_rope_in_its_qkv_projection_keeps_its_tokens(graphs, count_calls):
    """`qkv_rope_epilogue`: a Llama model's one-token decode steps launch no RoPE + store
    kernel (the prompt's step does), greedy tokens and logprobs those with it off; with
    the decode graphs' static buffers too (captured on a GPU, run eagerly on the CPU)."""
    from tiny_model import tiny_model_dir

    import infer.attention.triton_backend as triton_backend
    from infer import LLM, SamplingParams

    if graphs and DEVICE == "cpu":
        pytest.skip("CUDA graphs on a GPU only")
    calls = count_calls(triton_backend, "rope_store_kv")
    params = SamplingParams(max_tokens=4, temperature=0.0, logprobs=0, ignore_eos=True)
    outs = {}
    for on in (True, False):
        llm = LLM(str(tiny_model_dir()), device=DEVICE, num_blocks=64, max_model_len=128,
                  kernel_backend="triton", attention_backend="triton",
                  qkv_rope_epilogue=on, cuda_graphs=graphs, async_scheduling=False)
        layers = len(llm.engine.core.runner.model.model.layers)
        calls.clear()
        out = llm.generate(["The tiny model says"], params, use_tqdm=False)[0].outputs[0]
        if not graphs:  # (a captured graph's launches are not Python calls)
            assert len(calls) == layers * (1 if on else 4), (on, len(calls))
        outs[on] = (out.token_ids, [lp[t].logprob for t, lp in zip(out.token_ids,
                                                                  out.logprobs)])
        del llm
    assert outs[True][0] == outs[False][0]
    assert outs[True][1] == pytest.approx(outs[False][1], abs=0 if DEVICE == "cpu" else 2e-2)
