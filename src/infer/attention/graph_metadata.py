"""Static attention inputs that captured CUDA graphs read, for one query length.

Graphs are captured once per batch size over these buffers; a replay only rewrites their
contents. Every sequence of a graph brings the same number of new tokens, `query_len`
(1 for a decode step, k + 1 when verifying k speculative tokens): sequence `i` of a graph
of `batch` rows owns tokens `i * query_len .. (i + 1) * query_len - 1` and attends over
`seq_lens[i]` tokens, the last `query_len` of them new.

Rows past the step's sequences are padding: slot -1 (nothing is written to the cache),
length `query_len`, block ids zero (or an earlier step's), so their queries read keys of
blocks that exist; their outputs are ignored.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from infer.attention.metadata import AttentionMetadata, new_token_slots, padded_block_tables
from infer.transfer import to_device


class GraphMetadata:
    def __init__(
        self, max_batch: int, query_len: int, max_blocks_per_seq: int, block_size: int,
        device: torch.device, decode_splits: Callable[[int], int] | None = None,
        num_kv_heads: int = 0,
    ) -> None:
        if query_len < 1:
            raise ValueError(f"query_len must be >= 1, got {query_len}")
        self.max_batch = max_batch
        self.query_len = query_len
        self.block_size = block_size
        self.device = device
        # Split-K factor per batch size: a captured launch cannot change shape.
        self.decode_splits = decode_splits
        self.split_counters = (torch.zeros(max_batch * num_kv_heads, dtype=torch.int32,
                                           device=device) if decode_splits else None)
        tokens = max_batch * query_len
        self.slot_mapping = torch.full((tokens,), -1, dtype=torch.long, device=device)
        self.seq_lens = torch.full((max_batch,), query_len, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(max_batch + 1, dtype=torch.int32,
                                            device=device) * query_len
        self.block_tables = torch.zeros(max_batch, max_blocks_per_seq, dtype=torch.int32,
                                        device=device)

    def metadata(self, batch: int) -> AttentionMetadata:
        """What a graph of `batch` sequences is captured with: views of the buffers."""
        q = self.query_len
        return AttentionMetadata(
            query_start_loc=self.query_start_loc[:batch + 1], seq_lens=self.seq_lens[:batch],
            block_tables=self.block_tables[:batch], slot_mapping=self.slot_mapping[:batch * q],
            block_size=self.block_size, query_lens_host=[q] * batch,
            # Only the kernels read the lengths (from the device); the host list must not
            # steer anything, so it holds a placeholder.
            seq_lens_host=[q] * batch,
            decode_splits=self.decode_splits(batch) if self.decode_splits else None,
            split_counters=self.split_counters,
        )

    def prepare_replay(
        self, batch: int, seq_lens: list[int], block_tables: list[list[int]],
        token_rows: list[list[int]],
    ) -> torch.Tensor:
        """Write one step of `len(seq_lens) <= batch` sequences into the buffers of a graph
        of `batch` rows. `token_rows` (host ints, `batch * query_len` each: the model's
        own inputs, e.g. ids and positions) ride in the same host-to-device copy; they come
        back on the device as `[len(token_rows), batch * query_len]`."""
        q, bs = self.query_len, self.block_size
        tokens, pad = batch * q, batch - len(seq_lens)
        if q == 1:  # the common case, without the inner loop
            slots = [t[(n - 1) // bs] * bs + (n - 1) % bs for t, n in zip(block_tables, seq_lens)]
        else:
            slots = new_token_slots([q] * len(seq_lens), seq_lens, block_tables, bs)
        host: list[int] = []
        for row in token_rows:
            host += row
        host += slots + [-1] * (pad * q)
        host += seq_lens + [q] * pad
        rows = to_device(torch.tensor(host, dtype=torch.long), self.device)
        tables = to_device(padded_block_tables(block_tables, batch), self.device)
        at = len(token_rows) * tokens
        self.slot_mapping[:tokens].copy_(rows[at:at + tokens])
        self.seq_lens[:batch].copy_(rows[at + tokens:])
        self.block_tables[:batch, :tables.shape[1]].copy_(tables)
        return rows[:at].view(len(token_rows), tokens)
