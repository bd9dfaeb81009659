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

from infer.attention.metadata import AttentionMetadata, new_token_slots, padded_block_tables
from infer.transfer import to_device


class VarlenGraphMetadata:
    def __init__(
        self, max_tokens: int, max_seqs: int, max_blocks_per_seq: int, block_size: int,
        block_q: int, max_query_len: int, device: torch.device,
    ) -> None:
        self.max_tokens = max_tokens
        self.max_seqs = max_seqs
        self.block_size = block_size
        self.block_q = block_q
        # Longest query a graph takes (longer ones take another path of the backend).
        self.max_query_len = max_query_len
        self.device = device
        self.query_start_loc = torch.zeros(max_seqs + 1, dtype=torch.int32, device=device)
        self.tile_start = torch.zeros(max_seqs + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(max_seqs, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(max_seqs, max_blocks_per_seq, dtype=torch.int32,
                                        device=device)
        self.slot_mapping = torch.full((max_tokens,), -1, dtype=torch.long, device=device)

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
        block_tables: list[list[int]], token_rows: list[list[int]],
    ) -> torch.Tensor:
        """Write one step into the buffers of a graph of `tokens` rows. `token_rows` (host
        ints, `tokens` each: the model's own inputs) ride in the same host-to-device copy;
        they come back on the device as `[len(token_rows), tokens]`."""
        bs, bq, pad = self.block_size, self.block_q, self.max_seqs - len(query_lens)
        starts, tiles = [0], [0]
        for q in query_lens:
            starts.append(starts[-1] + q)
            tiles.append(tiles[-1] + -(-q // bq))
        slots = new_token_slots(query_lens, seq_lens, block_tables, bs)
        host: list[int] = []
        for row in token_rows:
            host += row
        host += slots + [-1] * (tokens - len(slots))
        host += starts + [starts[-1]] * pad
        host += tiles + [tiles[-1]] * pad
        host += seq_lens + [0] * pad
        rows = to_device(torch.tensor(host, dtype=torch.long), self.device)
        tables = to_device(padded_block_tables(block_tables), self.device)
        at = len(token_rows) * tokens
        seqs = self.max_seqs
        self.slot_mapping[:tokens].copy_(rows[at:at + tokens])
        at += tokens
        self.query_start_loc.copy_(rows[at:at + seqs + 1])
        self.tile_start.copy_(rows[at + seqs + 1:at + 2 * seqs + 2])
        self.seq_lens.copy_(rows[at + 2 * seqs + 2:])
        self.block_tables[:len(block_tables), :tables.shape[1]].copy_(tables)
        return rows[:len(token_rows) * tokens].view(len(token_rows), tokens)
