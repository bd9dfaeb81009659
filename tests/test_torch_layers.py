"""The torch paths of the norms, RoPE and paged attention (what a CPU runs), against
transformers' modules, the textbook formulas and float64 attention."""

from __future__ import annotations

import math

import pytest
import torch

from infer.attention.metadata import AttentionMetadata
from infer.attention.torch_backend import paged_attention
from infer.config import RopeConfig
from infer.kernels.reference import rope_ref
from infer.models.layers import RMSNorm, RotaryEmbedding


@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_float32_rmsnorm_is_transformers_bit_for_bit(offset: float) -> None:
    pytest.importorskip("transformers")
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    torch.manual_seed(0)
    dim, eps = 576, 1e-5
    x = torch.randn(33, dim) * torch.rand(33, 1) * 10
    residual = torch.randn(33, dim)
    norm = RMSNorm(dim, eps, offset)
    hf = (Gemma3RMSNorm if offset else LlamaRMSNorm)(dim, eps=eps)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(dim) * 0.2 + (0.0 if offset else 1.0))
        hf.weight.copy_(norm.weight)
        assert torch.equal(norm(x), hf(x))
        out, summed = norm(x, residual.clone())
        assert torch.equal(summed, residual + x) and torch.equal(out, hf(residual + x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_rotates_the_two_halves(dtype: torch.dtype) -> None:
    """Equal to the textbook form `(x1 cos - x2 sin, x2 cos + x1 sin)` on the same table,
    bit for bit, within one forward (`begin`) or outside one."""
    torch.manual_seed(1)
    head_dim, tokens = 64, 7
    rope = RotaryEmbedding(head_dim, 100, RopeConfig(theta=10000.0))
    q = torch.randn(tokens, 9, head_dim).to(dtype)
    k = torch.randn(tokens, 3, head_dim).to(dtype)
    positions = torch.tensor([0, 1, 5, 17, 42, 43, 99])
    expected = rope_ref(q, k, rope.cos, rope.sin, positions)
    for begun in (False, True):
        if begun:
            rope.begin(positions)
        got = rope(positions, q, k)
        assert all(g.dtype == dtype and torch.equal(g, e) for g, e in zip(got, expected))
        rope.end()


def _attention_f64(q, k_cache, v_cache, table, length, scale, window=None, softcap=None):
    """A query `[heads, head_dim]` at position `length - 1` over its sequence's cache, in
    float64."""
    heads, head_dim = q.shape
    kv_heads = k_cache.shape[2]
    keys = k_cache[table].reshape(-1, kv_heads, head_dim)[:length].double()
    values = v_cache[table].reshape(-1, kv_heads, head_dim)[:length].double()
    out = torch.empty(heads, head_dim, dtype=torch.float64)
    for h in range(heads):
        kv = h // (heads // kv_heads)
        scores = keys[:, kv] @ q[h].double() * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        if window is not None:
            scores[length - 1 - torch.arange(length) >= window] = -math.inf
        out[h] = torch.softmax(scores, 0) @ values[:, kv]
    return out


def _scattered_tables(lengths: list[int], block_size: int, num_blocks: int
                      ) -> list[list[int]]:
    blocks, tables = torch.randperm(num_blocks).tolist(), []
    for length in lengths:
        count = -(-length // block_size)
        tables.append(blocks[:count])
        blocks = blocks[count:]
    return tables


@pytest.mark.parametrize(("lengths", "window"), [
    ([37], None), ([30], 8), ([5, 37, 12], None), ([37, 20, 1], 8)])
def test_decode_attention_equals_float64(lengths: list[int], window: int | None) -> None:
    torch.manual_seed(len(lengths))
    block_size, heads, kv_heads, head_dim = 8, 9, 3, 64
    k_cache = torch.randn(40, block_size, kv_heads, head_dim)
    v_cache = torch.randn(40, block_size, kv_heads, head_dim)
    tables = _scattered_tables(lengths, block_size, 40)
    meta = AttentionMetadata.build([1] * len(lengths), lengths, tables, block_size)
    q = torch.randn(len(lengths), heads, head_dim)
    out = torch.full_like(q, float("nan"))
    out[:] = paged_attention(q, k_cache, v_cache, meta, 0.125, window)
    for i, length in enumerate(lengths):
        expected = _attention_f64(q[i], k_cache, v_cache, tables[i], length, 0.125, window)
        assert (out[i].double() - expected).abs().max() < 1e-5


@pytest.mark.parametrize(("window", "softcap"), [(None, None), (6, None), (None, 30.0),
                                                 (6, 30.0)])
def test_prefill_and_chunk_attention_equals_float64(window, softcap) -> None:
    """A whole prompt (causal from its first key), a chunk after a cached prefix, a
    one-token row and a long prompt, in one step; each query over the keys up to its own."""
    torch.manual_seed(7)
    block_size, heads, kv_heads, head_dim = 8, 6, 2, 32
    query_lens, lengths = [13, 5, 1, 40], [13, 29, 17, 40]
    k_cache = torch.randn(64, block_size, kv_heads, head_dim)
    v_cache = torch.randn(64, block_size, kv_heads, head_dim)
    tables = _scattered_tables(lengths, block_size, 64)
    meta = AttentionMetadata.build(query_lens, lengths, tables, block_size)
    q = torch.randn(sum(query_lens), heads, head_dim)
    out = paged_attention(q, k_cache, v_cache, meta, 0.2, window, softcap)
    row = 0
    for table, q_len, length in zip(tables, query_lens, lengths):
        for position in range(length - q_len, length):
            expected = _attention_f64(q[row], k_cache, v_cache, table, position + 1, 0.2,
                                      window, softcap)
            assert (out[row].double() - expected).abs().max() < 1e-5, (q_len, length, position)
            row += 1
