"""Test helper: run a model over a batch of sequences through the paged KV cache.

Sequences are prefilled together (optionally in chunks, so later chunks read an earlier
prefix from the cache), then decoded one token per step, all in one flattened batch, with
block tables deliberately scattered over the pool.
"""

from __future__ import annotations

import random

import torch

from infer.attention import AttentionMetadata, allocate_kv_cache
from infer.models.layers import activation_dtype


def run_paged(
    model: torch.nn.Module,
    sequences: list[list[int]],
    prefill_lens: list[int],
    block_size: int = 4,
    chunk: int | None = None,
    seed: int = 0,
    kv_dtype: torch.dtype | None = None,
) -> list[torch.Tensor]:
    """Logits `[len(seq), vocab]` per sequence: tokens `[:prefill_len]` are prefilled (in
    chunks of `chunk`), the rest are fed one decode step at a time; the cache of
    `kv_dtype` (default: the model's)."""
    device = next(model.parameters()).device
    blocks_needed = [(len(s) + block_size - 1) // block_size for s in sequences]
    ids = list(range(sum(blocks_needed) + 3))
    random.Random(seed).shuffle(ids)
    tables, at = [], 0
    for n in blocks_needed:
        tables.append(ids[at:at + n])
        at += n
    allocate_kv_cache(model, len(ids), block_size, kv_dtype or activation_dtype(model))
    done = [0] * len(sequences)
    logits: list[list[torch.Tensor]] = [[] for _ in sequences]
    while any(d < len(s) for d, s in zip(done, sequences)):
        q_lens = []
        for i, seq in enumerate(sequences):
            if done[i] < prefill_lens[i]:
                step = prefill_lens[i] - done[i] if chunk is None else chunk
                q_lens.append(min(step, prefill_lens[i] - done[i]))
            else:
                q_lens.append(min(1, len(seq) - done[i]))
        tokens = [t for i, s in enumerate(sequences) for t in s[done[i]:done[i] + q_lens[i]]]
        positions = [p for i in range(len(sequences)) for p in range(done[i], done[i] + q_lens[i])]
        seq_lens = [d + q for d, q in zip(done, q_lens)]
        meta = AttentionMetadata.build(q_lens, seq_lens, tables, block_size, device)
        with torch.no_grad():
            hidden = model(
                torch.tensor(tokens, device=device), torch.tensor(positions, device=device), meta
            )
            out = model.compute_logits(hidden)
        start = 0
        for i, q in enumerate(q_lens):
            logits[i].append(out[start:start + q])
            start += q
        done = seq_lens
    return [torch.cat(chunks) for chunks in logits]
