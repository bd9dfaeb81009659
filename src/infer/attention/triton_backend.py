"""Paged attention on the Triton kernels: `TritonAttentionBackend` and the functions it calls.

Unlike the reference, nothing here synchronises with the device or depends on sequence
lengths for its launch shapes when `meta.decode_splits` is set (or the batch is not all
decodes: the prefill launch depends only on the longest query), so a step whose sequences
all bring the same number of tokens can be captured in a CUDA graph.

Per op by size: sequences that bring at least `DENSE_PREFILL_MIN_TOKENS` new tokens go
through torch's fused SDPA (cuDNN first, then flash) on keys and values gathered from
their blocks; everything else through our kernels. Measured on the H100
(`benchmarks/prefill_attention.py`, Llama-3.1-8B heads): 2048 tokens without a prefix
0.196 ms (flash) vs 0.251 ms ours; 2048 after 6144 cached 0.915 ms (cuDNN) vs 1.440 ms;
8192 at once 1.03 ms vs 2.83 ms; but one 512-token prompt 0.22 ms vs 0.049 ms, and
sixteen of them 2.2 ms vs 0.25 ms (SDPA goes one sequence at a time).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from infer.attention.graph_metadata import GraphMetadata
from infer.attention.kv_dtype import UNSCALED, KVScales, inverses
from infer.attention.metadata import AttentionMetadata
from infer.attention.qk_prologue import QKPrologue
from infer.attention.varlen_graph_metadata import VarlenGraphMetadata
from infer.kernels.kv_store import store_kv
from infer.kernels.paged_attention import (
    MAX_DECODE_QUERIES,
    default_num_splits,
    paged_decode,
    paged_prefill,
    prefill_block_q,
)
from infer.kernels.rope_kv_store import rope_store_kv

DENSE_PREFILL_MIN_TOKENS = 2048
_SDPA_PRIORITY = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
                  SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    slot_mapping: torch.Tensor, scales: KVScales = UNSCALED,
) -> None:
    store_kv(k_cache, v_cache, k, v, slot_mapping, inverses(scales))


def write_kv_with_prologue(
    k_cache: torch.Tensor, v_cache: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
    v: torch.Tensor, slot_mapping: torch.Tensor, positions: torch.Tensor,
    prologue: QKPrologue, scales: KVScales = UNSCALED,
) -> torch.Tensor:
    """One kernel for the q/k norms, RoPE and the store when the model's kernels are
    Triton's (`prologue.fusable`); q is changed in place."""
    if not prologue.fusable:
        q, k = prologue.apply(positions, q, k)
        store_kv(k_cache, v_cache, k, v, slot_mapping, inverses(scales))
        return q
    norm = prologue.q_norm
    return rope_store_kv(
        q, k, v, k_cache, v_cache, slot_mapping, positions, prologue.rotary.cos,
        prologue.rotary.sin, None if norm is None else norm.weight,
        None if norm is None else prologue.k_norm.weight,
        0.0 if norm is None else norm.eps, 0.0 if norm is None else norm.offset,
        inverses(scales))


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
    scale: float, sliding_window: int | None = None, logit_softcap: float | None = None,
) -> torch.Tensor:
    if meta.prefill_tiles is not None:  # a captured step of any shape: one fixed launch
        return paged_prefill(q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens,
                             meta.block_tables, 0, scale, sliding_window, logit_softcap,
                             tile_start=meta.prefill_tiles, max_tiles=meta.max_prefill_tiles)
    first = meta.num_seqs
    if sliding_window is None and logit_softcap is None:
        # The trailing run of long sequences (the scheduler puts new prefills last).
        while first > 0 and meta.query_lens_host[first - 1] >= DENSE_PREFILL_MIN_TOKENS:
            first -= 1
    if first == meta.num_seqs:
        return paged_attention_kernels(q, k_cache, v_cache, meta, scale, sliding_window,
                                       logit_softcap, num_splits=meta.decode_splits,
                                       split_counters=meta.split_counters)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    start = sum(meta.query_lens_host[:first])
    if first > 0:
        paged_prefill(q[:start], k_cache, v_cache, meta.query_start_loc[:first + 1],
                      meta.seq_lens[:first], meta.block_tables[:first],
                      max(meta.query_lens_host[:first]), scale, out=out[:start])
    for i in range(first, meta.num_seqs):
        q_len, s_len = meta.query_lens_host[i], meta.seq_lens_host[i]
        dense_prefill(q[start:start + q_len], k_cache, v_cache, meta.block_tables[i], s_len,
                      scale, out[start:start + q_len])
        start += q_len
    return out


def paged_attention_kernels(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
    scale: float, sliding_window: int | None = None, logit_softcap: float | None = None,
    num_splits: int | None = None, split_counters: torch.Tensor | None = None,
) -> torch.Tensor:
    """Our kernels only, same contract as `torch_backend.paged_attention`: a batch of pure
    decodes takes the split-K decode kernel, and so does a graph's step of several tokens
    for every sequence when its metadata splits keys (`verify_decode_attention`); anything
    else the varlen prefill kernel."""
    assert k_cache.shape[1] == meta.block_size, (k_cache.shape, meta.block_size)
    assert q.shape[0] == meta.num_tokens, (q.shape, meta.num_tokens)
    query_len = meta.query_lens_host[0] if meta.num_seqs else 0
    if (meta.num_seqs and all(n == query_len for n in meta.query_lens_host)
            and (query_len == 1 or (meta.decode_splits is not None
                 and query_len <= MAX_DECODE_QUERIES))):
        if num_splits is None:
            longest = max(meta.seq_lens_host)
            if sliding_window is not None:
                longest = min(longest, sliding_window)
            num_splits = default_num_splits(meta.num_seqs, k_cache.shape[2], longest,
                                            q.device)
        return paged_decode(q, k_cache, v_cache, meta.seq_lens, meta.block_tables, scale,
                            sliding_window, logit_softcap, num_splits,
                            split_counters=split_counters, query_len=query_len)
    return paged_prefill(q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens,
                         meta.block_tables, max(meta.query_lens_host, default=0), scale,
                         sliding_window, logit_softcap)


def dense_prefill(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
    seq_len: int, scale: float, out: torch.Tensor,
) -> None:
    """One sequence's new tokens `q` [q_len, H, D] (its last q_len positions) attend
    causally over its `seq_len` cached tokens, written into `out`."""
    q_len, block_size = q.shape[0], k_cache.shape[1]
    blocks = block_table[:(seq_len + block_size - 1) // block_size]
    k = k_cache[blocks].flatten(0, 1)[:seq_len].to(q.dtype).transpose(0, 1)[None]
    v = v_cache[blocks].flatten(0, 1)[:seq_len].to(q.dtype).transpose(0, 1)[None]
    mask = None
    if q_len < seq_len:  # bottom-right causal: query i sees keys 0 .. seq_len - q_len + i
        pos = torch.arange(seq_len, device=q.device)
        mask = pos[None, :] <= pos[seq_len - q_len:, None]
    with sdpa_kernel(_SDPA_PRIORITY, set_priority=True):
        o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k, v, attn_mask=mask,
                                           is_causal=mask is None, scale=scale,
                                           enable_gqa=True)
    out.copy_(o[0].transpose(0, 1))


class TritonAttentionBackend:
    name = "triton"

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
        # The dense (SDPA) path plans on host lengths, which graph metadata does not hold.
        if query_len >= DENSE_PREFILL_MIN_TOKENS:
            raise ValueError(f"graphs take fewer than {DENSE_PREFILL_MIN_TOKENS} tokens per "
                             f"sequence, got {query_len}")

        def splits(batch: int) -> int:  # enough for the longest sequence a step may hold
            return default_num_splits(batch, num_kv_heads, max_seq_len, device)

        # Decode steps take the split-K launch; steps of several tokens a sequence where
        # asked (`split_keys`), else the prefill kernel.
        return GraphMetadata(max_batch, query_len, -(-max_seq_len // block_size), block_size,
                             device, splits if query_len == 1 or split_keys else None,
                             num_kv_heads, catch_up=catch_up)

    def init_varlen_graph_metadata(
        self, max_tokens: int, max_seqs: int, max_seq_len: int, block_size: int,
        num_heads: int, num_kv_heads: int, head_dim: int, device: torch.device,
    ) -> VarlenGraphMetadata:
        # Longer queries go to SDPA, which plans on host lengths: not in a graph.
        return VarlenGraphMetadata(max_tokens, max_seqs, -(-max_seq_len // block_size),
                                   block_size, prefill_block_q(num_heads, num_kv_heads,
                                                               head_dim),
                                   DENSE_PREFILL_MIN_TOKENS - 1, device)
