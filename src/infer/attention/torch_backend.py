"""Reference paged attention in plain torch: runs on CPU and GPU, a prefill one sequence at
a time, an all-decode batch in one call (what a CPU serves with).

Correctness first: every faster backend is tested against this one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from infer.attention.graph_metadata import GraphMetadata
from infer.attention.kv_dtype import FP8_KV, UNSCALED, KVScales, as_cache_values
from infer.attention.metadata import AttentionMetadata
from infer.attention.qk_prologue import QKPrologue
from infer.attention.varlen_graph_metadata import VarlenGraphMetadata
from infer.kernels import cpu_attention


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    slot_mapping: torch.Tensor, scales: KVScales = UNSCALED,
) -> None:
    """Store new keys/values `[num_tokens, kv_heads, head_dim]` at their flat slots (an FP8
    cache divided by `scales`, attention/kv_dtype.py)."""
    num_kv_heads, head_dim = k_cache.shape[-2:]
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    _store(k_cache.view(-1, num_kv_heads, head_dim), slot_mapping,
           as_cache_values(k, k_cache.dtype, scales[0]))
    _store(v_cache.view(-1, num_kv_heads, head_dim), slot_mapping,
           as_cache_values(v, v_cache.dtype, scales[1]))


def _store(cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor) -> None:
    if cache.dtype == FP8_KV:  # (a CPU has no index_copy_ of float8: copy the bytes)
        cache, x = cache.view(torch.uint8), x.view(torch.uint8)
    cache.index_copy_(0, slots, x)


def write_kv_with_prologue(
    k_cache: torch.Tensor, v_cache: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
    v: torch.Tensor, slot_mapping: torch.Tensor, positions: torch.Tensor,
    prologue: QKPrologue, scales: KVScales = UNSCALED,
) -> torch.Tensor:
    """The prologue's modules one by one, then the store; returns the new q. On a CPU the
    RoPE and the store in one call where it applies (`cpu_attention.rope_store`, which
    stores unscaled values)."""
    if scales == UNSCALED and cpu_attention.takes_rope_store(q, k, k_cache, prologue.rotary):
        q, k = prologue.normed(q, k)
        return cpu_attention.rope_store(q, k, v, prologue.rotary, positions, slot_mapping,
                                        k_cache, v_cache)
    q, k = prologue.apply(positions, q, k)
    write_kv(k_cache, v_cache, k, v, slot_mapping, scales)
    return q


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
) -> torch.Tensor:
    """Causal attention of new queries `[num_tokens, heads, head_dim]` over the cache.

    The new tokens' keys/values must already be in the cache. Returns
    `[num_tokens, heads, head_dim]` in q's dtype; softmax is computed in float32.
    """
    num_heads, head_dim = q.shape[1:]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    if all(n == 1 for n in meta.query_lens_host):
        return _decode_attention(q, k_cache, v_cache, meta, scale, sliding_window,
                                 logit_softcap)
    out = torch.empty_like(q)
    start = 0
    for i, (q_len, s_len) in enumerate(zip(meta.query_lens_host, meta.seq_lens_host)):
        if q_len == 0:
            continue
        num_blocks = (s_len + block_size - 1) // block_size
        blocks = meta.block_tables[i, :num_blocks]
        # [kv_heads, s_len, head_dim] and [heads, q_len, head_dim]
        keys = _float(_gather(k_cache, blocks).flatten(0, 1)[:s_len]).transpose(0, 1)
        values = _float(_gather(v_cache, blocks).flatten(0, 1)[:s_len]).transpose(0, 1)
        queries = _float(q[start:start + q_len]).transpose(0, 1)
        visible = None  # [q_len, s_len]; None: causal from the first key (no cached prefix)
        if q_len != s_len or sliding_window is not None or logit_softcap:
            q_pos = torch.arange(s_len - q_len, s_len, device=q.device).unsqueeze(1)
            k_pos = torch.arange(s_len, device=q.device).unsqueeze(0)
            visible = k_pos <= q_pos
            if sliding_window is not None:
                visible &= q_pos - k_pos < sliding_window
        if logit_softcap:
            queries = queries.view(num_kv_heads, group, q_len, head_dim)
            scores = torch.matmul(queries, keys.transpose(1, 2).unsqueeze(1)) * scale
            scores = torch.tanh(scores / logit_softcap) * logit_softcap
            probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
            ctx = torch.matmul(probs, values.unsqueeze(1)).view(num_heads, q_len, head_dim)
        else:  # torch's fused kernel: no [heads, q_len, s_len] scores in memory
            ctx = F.scaled_dot_product_attention(
                queries.unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0), attn_mask=visible,
                is_causal=visible is None, scale=scale, enable_gqa=True)[0]
        out[start:start + q_len] = ctx.transpose(0, 1)
        start += q_len
    return out


def _decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None,
    logit_softcap: float | None,
) -> torch.Tensor:
    """All sequences decode one token: one batched attention over block tables padded to
    the longest sequence, padding masked out (instead of a Python loop per sequence).
    Without a softcap, through torch's fused `scaled_dot_product_attention`; on a CPU where
    it can, in one call of infer's own kernel (`kernels/cpu_attention.py`)."""
    if cpu_attention.takes(q, k_cache):
        return cpu_attention.paged_decode(q, k_cache, v_cache, meta.block_tables,
                                          meta.seq_lens, scale, sliding_window, logit_softcap)
    num_seqs, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    lengths = meta.seq_lens_host
    max_len = max(lengths)
    num_blocks = (max_len + block_size - 1) // block_size
    blocks = meta.block_tables[:, :num_blocks]
    # [seqs, kv_heads, len, head_dim]
    keys = _float(_gather(k_cache, blocks).flatten(1, 2)[:, :max_len].transpose(1, 2))
    values = _float(_gather(v_cache, blocks).flatten(1, 2)[:, :max_len].transpose(1, 2))
    visible = None  # [seqs, len]; None: every key (one sequence's own, unwindowed)
    if sliding_window is not None or min(lengths) != max_len:
        k_pos = torch.arange(max_len, device=q.device).unsqueeze(0)
        last = meta.seq_lens.long().unsqueeze(1) - 1  # the query's own position
        visible = k_pos <= last
        if sliding_window is not None:
            visible &= last - k_pos < sliding_window
    if not logit_softcap:
        out = F.scaled_dot_product_attention(
            _float(q).unsqueeze(2), keys, values, scale=scale, enable_gqa=True,
            attn_mask=None if visible is None else visible[:, None, None, :])
        return _as(out.view(num_seqs, num_heads, head_dim), q.dtype)
    queries = _float(q).view(num_seqs, num_kv_heads, group, head_dim)
    scores = torch.matmul(queries, keys.transpose(2, 3)) * scale  # [seqs, kvh, g, len]
    scores = torch.tanh(scores / logit_softcap) * logit_softcap
    if visible is not None:
        scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs, values)  # [seqs, kvh, g, head_dim]
    return out.reshape(num_seqs, num_heads, head_dim).to(q.dtype)


def _gather(cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """`cache[blocks]` (blocks of any shape) through `index_select`, which costs a CPU
    decode step's layers less than indexing does (~5 against ~13 us a call)."""
    return cache.index_select(0, blocks.flatten()).view(*blocks.shape, *cache.shape[1:])


def _float(x: torch.Tensor) -> torch.Tensor:
    return _as(x, torch.float32)


def _as(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x.to(dtype)`, without the call when it is one already: a CPU decode step pays
    microseconds for each of its ~1,700 torch operations (SmolLM2), no-ops included."""
    return x if x.dtype == dtype else x.to(dtype)


class TorchAttentionBackend:
    """The reference backend. It plans on host lengths (`meta.seq_lens_host`), so its
    steps cannot be captured in CUDA graphs."""

    name = "torch"

    # The step's metadata, the KV store and the attention: this module's functions.
    build_metadata = staticmethod(AttentionMetadata.build)
    write_kv = staticmethod(write_kv)
    write_kv_with_prologue = staticmethod(write_kv_with_prologue)
    forward = staticmethod(paged_attention)

    def init_graph_metadata(
        self, max_batch: int, query_len: int, max_seq_len: int, block_size: int,
        num_kv_heads: int, device: torch.device, split_keys: bool = False,
        catch_up: bool = False,
    ) -> GraphMetadata:
        raise ValueError("decode graphs need attention_backend='triton'")

    def init_varlen_graph_metadata(
        self, max_tokens: int, max_seqs: int, max_seq_len: int, block_size: int,
        num_heads: int, num_kv_heads: int, head_dim: int, device: torch.device,
    ) -> VarlenGraphMetadata:
        raise ValueError("graphs of mixed steps need attention_backend='triton'")
