"""Static attention inputs that captured CUDA graphs read, for one query length.

Graphs are captured once per batch size over these buffers; a replay only rewrites their
contents. Every sequence of a graph brings the same number of new tokens, `query_len`
(1 for a decode step, k + 1 when verifying k speculative tokens): sequence `i` of a graph
of `batch` rows owns tokens `i * query_len .. (i + 1) * query_len - 1` and attends over
`seq_lens[i]` tokens, the last `query_len` of them new.

Rows past the step's sequences are padding: slot -1 (nothing is written to the cache),
length `query_len`, block ids zero (or an earlier step's), so their queries read keys of
blocks that exist; their outputs are ignored.

With `catch_up` (a draft's two-token graphs for rounds queued ahead) each sequence's first
token is one the draft's cache may already hold: `advance(..., done_below=k)` by fewer
than k tokens marks it done (slot -1; for a lone sequence `first_row_skipped`, which the
graphs' two-row GEMVs read: `kernels/row_skip.py`).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from infer.attention.metadata import AttentionMetadata, new_token_slots
from infer.attention.step_staging import StepStaging, write_rows
from infer.attention.table_packer import TablePacker
from infer.kernels import triton_available


class GraphMetadata:
    def __init__(
        self, max_batch: int, query_len: int, max_blocks_per_seq: int, block_size: int,
        device: torch.device, decode_splits: Callable[[int], int] | None = None,
        num_kv_heads: int = 0, token_rows: int = 2, catch_up: bool = False,
    ) -> None:
        if query_len < 1:
            raise ValueError(f"query_len must be >= 1, got {query_len}")
        if catch_up and query_len != 2:
            raise ValueError(f"catch_up goes with two tokens a sequence, not {query_len}")
        self.catch_up = catch_up
        self.max_batch = max_batch
        self.query_len = query_len
        self.block_size = block_size
        self.device = device
        # Split-K factor per batch size: a captured launch cannot change shape.
        self.decode_splits = decode_splits
        self.split_counters = (torch.zeros(max_batch * num_kv_heads, dtype=torch.int32,
                                           device=device) if decode_splits else None)
        tokens = max_batch * query_len
        # int64 rows: the slots, then `token_rows` of the model's own inputs (e.g. ids and
        # positions); int32: the lengths, the first-row flag, the packed block tables.
        self._tables_at = max_batch + 1
        self.staging = StepStaging(1 + token_rows, tokens,
                                   self._tables_at + max_batch * max_blocks_per_seq, device)
        self.slot_mapping = self.staging.i64[0]
        self.slot_mapping.fill_(-1)
        self.token_rows = self.staging.i64[1:]
        self.seq_lens = self.staging.i32[:max_batch]
        self.seq_lens.fill_(query_len)
        self.first_row_skipped = self.staging.i32[max_batch:self._tables_at]
        self.query_start_loc = torch.arange(max_batch + 1, dtype=torch.int32,
                                            device=device) * query_len
        self.block_tables = torch.zeros(max_batch, max_blocks_per_seq, dtype=torch.int32,
                                        device=device)
        self._tables = TablePacker(max_batch, max_blocks_per_seq)

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
        token_rows: list[list[int] | None],
    ) -> None:
        """Write one step of `len(seq_lens) <= batch` sequences into the buffers of a graph
        of `batch` rows, and `token_rows[i]` (host ints, at most `batch * query_len`, the
        rest zero) into `self.token_rows[i]`; a None row is zeroed, for the caller to fill
        on the device."""
        q, bs = self.query_len, self.block_size
        tokens, n = batch * q, len(seq_lens)
        i64, i32 = self.staging.host()
        write_rows(i64[1:], token_rows, tokens)
        i32[:n] = seq_lens
        i32[n:batch] = q
        i32[self.max_batch] = 0  # first_row_skipped
        at = self._tables_at
        width = self._tables.pack(block_tables, batch, i32[at:])
        if q == 1:  # the common case, in numpy
            tables = i32[at:at + batch * width].reshape(batch, width)
            last = i32[:n].astype(np.int64) - 1
            i64[0, :n] = tables[np.arange(n), last // bs] * bs + last % bs
        else:
            i64[0, :n * q] = new_token_slots([q] * n, seq_lens, block_tables, bs)
        i64[0, n * q:tokens] = -1
        self.staging.send_with_tables(at, batch, width, self.block_tables)

    def compile_advance(self) -> None:
        """Compile `advance`'s kernel now (while graphs are captured), where it runs."""
        if self.block_tables.is_cuda and triton_available():
            from infer.kernels.advance_step import compile_for

            compile_for(self.block_tables.device, self.query_len, self.block_size,
                        self.block_tables.shape[1])

    def advance(self, n: int, offsets: torch.Tensor, positions: torch.Tensor,
                done_below: int = 0) -> None:
        """Move the first `n` sequences of the step just prepared `offsets[i]` tokens on,
        on the device (a step whose lengths only the device knows yet): their lengths, the
        positions of their new tokens (`positions`, this step's row of them) and those
        tokens' cache slots. Their block tables must already cover where they move to.
        `done_below` (with `catch_up`): see above."""
        assert not done_below or self.catch_up, "done_below needs catch_up graphs"
        q, bs = self.query_len, self.block_size
        if offsets.is_cuda and triton_available():
            from infer.kernels.advance_step import advance_step

            advance_step(offsets, self.seq_lens, positions, self.slot_mapping,
                         self.block_tables, q, bs, done_below, self.first_row_skipped)
            return
        self.seq_lens[:n] += offsets.to(torch.int32)
        moved = positions[:n * q]
        moved += offsets[:, None].expand(n, q).reshape(-1)
        sequence_of_token = torch.arange(n, device=moved.device).repeat_interleave(q)
        blocks = self.block_tables[sequence_of_token, moved // bs]
        slots = self.slot_mapping[:n * q]
        slots.copy_(blocks.long() * bs + moved % bs)
        if done_below:
            done = offsets < done_below
            slots[::q].masked_fill_(done, -1)
            self.first_row_skipped.copy_(done[:1] & (n == 1))
