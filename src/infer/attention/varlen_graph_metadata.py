"""Static attention inputs that captured CUDA graphs of steps of any shape read.

A graph of `tokens` rows serves any step of at most that many new tokens over at most
`max_seqs` sequences, whatever each sequence brings (a prefill chunk, one decode token, a
chunk after a cached prefix). Sequence `i` owns rows `query_start_loc[i]` to
`query_start_loc[i + 1]`; sequences past the step's are padding with no rows (length 0),
rows past its tokens are padding with slot -1 (nothing is written to the cache).

Attention launches a fixed number of programs per kv head (`max_tiles(tokens)`); each
finds its sequence and query tile from `tile_start`, the prefix sums of every sequence's
tiles of `block_q` tokens, and the programs past the last tile do nothing. Every sequence
holds at least one token, so a step has at most `tokens / block_q + min(max_seqs, tokens)`
tiles.
"""

from __future__ import annotations

import torch

from infer.attention.metadata import AttentionMetadata, new_token_slots
from infer.attention.step_staging import StepStaging, write_rows
from infer.attention.table_packer import TablePacker


class VarlenGraphMetadata:
    def __init__(
        self, max_tokens: int, max_seqs: int, max_blocks_per_seq: int, block_size: int,
        block_q: int, max_query_len: int, device: torch.device, token_rows: int = 2,
    ) -> None:
        self.max_tokens = max_tokens
        self.max_seqs = max_seqs
        self.block_size = block_size
        self.block_q = block_q
        # Longest query a graph takes (longer ones take another path of the backend).
        self.max_query_len = max_query_len
        self.device = device
        # int64 rows: the slots, then `token_rows` of the model's own inputs (e.g. ids and
        # positions); int32: query starts, tile starts, lengths, the step's packed tables.
        seqs = max_seqs
        self.staging = StepStaging(1 + token_rows, max_tokens,
                                   3 * seqs + 2 + seqs * max_blocks_per_seq, device)
        self.slot_mapping = self.staging.i64[0]
        self.slot_mapping.fill_(-1)
        self.token_rows = self.staging.i64[1:]
        self.query_start_loc = self.staging.i32[:seqs + 1]
        self.tile_start = self.staging.i32[seqs + 1:2 * seqs + 2]
        self.seq_lens = self.staging.i32[2 * seqs + 2:3 * seqs + 2]
        self.block_tables = torch.zeros(max_seqs, max_blocks_per_seq, dtype=torch.int32,
                                        device=device)
        self._tables = TablePacker(max_seqs, max_blocks_per_seq)

    def fits(self, query_lens: list[int]) -> bool:
        return (0 < len(query_lens) <= self.max_seqs and sum(query_lens) <= self.max_tokens
                and max(query_lens) <= self.max_query_len)

    def max_tiles(self, tokens: int) -> int:
        return -(-tokens // self.block_q) + min(self.max_seqs, tokens)

    def metadata(self, tokens: int) -> AttentionMetadata:
        """What a graph of `tokens` rows is captured with: views of the buffers."""
        seqs = self.max_seqs
        return AttentionMetadata(
            query_start_loc=self.query_start_loc, seq_lens=self.seq_lens,
            block_tables=self.block_tables, slot_mapping=self.slot_mapping[:tokens],
            block_size=self.block_size,
            # Only the kernels read the lengths (from the device); the host lists are
            # placeholders of the right sizes that must not steer anything.
            query_lens_host=[tokens] + [0] * (seqs - 1), seq_lens_host=[tokens] * seqs,
            prefill_tiles=self.tile_start, max_prefill_tiles=self.max_tiles(tokens),
        )

    def prepare_replay(
        self, tokens: int, query_lens: list[int], seq_lens: list[int],
        block_tables: list[list[int]], token_rows: list[list[int] | None],
    ) -> None:
        """Write one step into the buffers of a graph of `tokens` rows, and `token_rows[i]`
        (host ints, at most `tokens`, the rest zero) into `self.token_rows[i]`; a None row is
        zeroed, for the caller to fill on the device."""
        bs, bq, seqs, n = self.block_size, self.block_q, self.max_seqs, len(query_lens)
        starts, tiles = [0], [0]
        for q in query_lens:
            starts.append(starts[-1] + q)
            tiles.append(tiles[-1] + -(-q // bq))
        i64, i32 = self.staging.host()
        write_rows(i64[1:], token_rows, tokens)
        i64[0, :starts[-1]] = new_token_slots(query_lens, seq_lens, block_tables, bs)
        i64[0, starts[-1]:tokens] = -1
        i32[:n + 1] = starts
        i32[n + 1:seqs + 1] = starts[-1]
        i32[seqs + 1:seqs + n + 2] = tiles
        i32[seqs + n + 2:2 * seqs + 2] = tiles[-1]
        i32[2 * seqs + 2:2 * seqs + 2 + n] = seq_lens
        i32[2 * seqs + 2 + n:3 * seqs + 2] = 0
        at = 3 * seqs + 2
        width = self._tables.pack(block_tables, n, i32[at:])
        self.staging.send_with_tables(at, n, width, self.block_tables)
