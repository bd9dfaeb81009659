"""What one forward pass needs to know about the batch it attends over.

The batch is *flattened*: the new tokens of every sequence sit back to back in one
`[num_tokens]` vector (sequence 0's tokens, then sequence 1's, ...). A prefill, a prefill
chunk, a decode step and a prefix-cache hit are all the same thing here: sequence `i`
brings `query_lens[i]` new tokens and attends over `seq_lens[i]` tokens in total, the
last `query_lens[i]` of which are its new ones (so `seq_lens[i] - query_lens[i]` tokens
of context are already in the cache).

KV cache layout (per layer): `[num_blocks, block_size, num_kv_heads, head_dim]`.
Token `p` of a sequence lives in block `block_tables[i, p // block_size]`, row
`p % block_size`; its flat slot is `block * block_size + row`. `slot_mapping[t]` is the
slot that new token `t` is written to (-1: do not write, e.g. padding).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from infer.transfer import to_device


@dataclass
class AttentionMetadata:
    # [num_seqs + 1] int32, prefix sums of query_lens (on the model's device).
    query_start_loc: torch.Tensor
    # [num_seqs] int32: context + new tokens per sequence (on the model's device).
    seq_lens: torch.Tensor
    # [num_seqs, max_blocks_per_seq] int32 block ids (on the model's device).
    block_tables: torch.Tensor
    # [num_tokens] int64 cache slot of each new token (on the model's device).
    slot_mapping: torch.Tensor
    block_size: int
    # Host copies, so backends can plan without synchronising with the device.
    query_lens_host: list[int]
    seq_lens_host: list[int]
    # Split-K factor for an all-decode batch (None: the backend picks from the lengths).
    # CUDA-graph replays fix it, since a captured launch cannot change shape.
    decode_splits: int | None = None
    # int32 zeros, one per (sequence, kv head), that a split decode launch leaves at zero:
    # its last split to finish then combines the partials (graphs: one launch fewer).
    split_counters: torch.Tensor | None = None
    # Graphs of steps of any shape (`varlen_graph_metadata`): int32 [num_seqs + 1] prefix
    # sums of each sequence's query tiles, and the launch size that covers any step of
    # this many tokens. The host lists then hold placeholders.
    prefill_tiles: torch.Tensor | None = None
    max_prefill_tiles: int = 0

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_host)

    @property
    def num_tokens(self) -> int:
        return int(sum(self.query_lens_host))

    @staticmethod
    def build(
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> AttentionMetadata:
        """Build metadata from plain lists (the engine's step output, or a test)."""
        if not (len(query_lens) == len(seq_lens) == len(block_tables)):
            raise ValueError("query_lens, seq_lens and block_tables must have one entry per seq")
        for q_len, s_len, table in zip(query_lens, seq_lens, block_tables):
            if q_len > s_len or len(table) * block_size < s_len:
                raise ValueError(
                    f"sequence of {s_len} tokens ({q_len} new) does not fit "
                    f"{len(table)} blocks of {block_size}"
                )
        slots = new_token_slots(query_lens, seq_lens, block_tables, block_size)
        starts = [0]
        for q_len in query_lens:
            starts.append(starts[-1] + q_len)
        return AttentionMetadata(
            query_start_loc=to_device(torch.tensor(starts, dtype=torch.int32), device),
            seq_lens=to_device(torch.tensor(seq_lens, dtype=torch.int32), device),
            block_tables=to_device(padded_block_tables(block_tables), device),
            slot_mapping=to_device(torch.tensor(slots, dtype=torch.int64), device),
            block_size=block_size,
            query_lens_host=list(query_lens),
            seq_lens_host=list(seq_lens),
        )


def new_token_slots(query_lens: list[int], seq_lens: list[int],
                    block_tables: list[list[int]], block_size: int) -> list[int]:
    """The cache slot of every new token, sequence by sequence (a sequence's new tokens
    are its last `query_lens[i]` of `seq_lens[i]`)."""
    slots: list[int] = []
    for q, n, table in zip(query_lens, seq_lens, block_tables):
        slots += [table[p // block_size] * block_size + p % block_size for p in range(n - q, n)]
    return slots


def padded_block_tables(block_tables: list[list[int]], rows: int | None = None
                        ) -> torch.Tensor:
    """Host int32 `[rows, longest table]`, zero-padded (rows past the tables are all zero)."""
    rows = len(block_tables) if rows is None else rows
    width = max(map(len, block_tables), default=0)
    out = np.empty(rows * width, dtype=np.int32)
    pack_block_tables(block_tables, rows, out)
    return torch.from_numpy(out.reshape(rows, width))


def pack_block_tables(block_tables: list[list[int]], rows: int, out: np.ndarray) -> int:
    """Write the tables into `out` as int32 `[rows, longest table]`, row-major and
    zero-padded (rows past the tables are all zero); returns the width.

    Built through numpy from one flat copy: a step's tables hold batch x context / block
    size ids, and a nested-list torch.tensor of them costs milliseconds at batch 256."""
    lens = np.fromiter(map(len, block_tables), dtype=np.int64, count=len(block_tables))
    width = int(lens.max()) if len(lens) else 0
    view = out[:rows * width].reshape(rows, width)
    view.fill(0)
    if width:
        flat = np.fromiter(itertools.chain.from_iterable(block_tables), dtype=np.int32,
                           count=int(lens.sum()))
        view[:len(block_tables)][np.arange(width) < lens[:, None]] = flat
    return width
