"""Steps replayed from captured CUDA graphs: decode, or any fixed number of tokens per sequence.

A step of `n` sequences that each bring `tokens_per_seq` new tokens (1 for a decode step,
k + 1 when verifying k speculative tokens) runs the graph captured for the smallest batch
size `>= n`: the step's inputs are copied into static buffers sized for
`max_batch * tokens_per_seq` tokens; rows `n..size-1` are padding (see
`infer.attention.graph_metadata`: nothing is written to the cache, their outputs are
ignored). Graphs of all sizes share one memory pool and the same static buffers, captured
from the largest down. The attention backend supplies the buffers, token ids and
positions included (`init_graph_metadata`: one host-to-device copy a step).

Capture needs a backend whose launches never synchronise with the host or change shape
with the sequence lengths: the Triton backend, with a fixed split-K factor per size for
decode.

`MixedGraphs` does the same for steps of any shape (prefill chunks beside decodes), keyed
by token count: one fixed attention launch covers any mix of sequences
(`infer.attention.varlen_graph_metadata`).

On a CPU the same buffers and padding run eagerly (`capture=False`), so tests cover
everything but the capture itself.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import nullcontext

import torch
from torch import nn

from infer.attention.graph_metadata import GraphMetadata
from infer.attention.varlen_graph_metadata import VarlenGraphMetadata
from infer.kernels.row_skip import first_row_skipped_where


@torch.inference_mode()
def capture_graphs(
    sizes: list[int], forward: Callable[[int], torch.Tensor],
    graphs: dict[int, torch.cuda.CUDAGraph], outputs: dict[int, torch.Tensor],
    device: torch.device, pool: object = None,
) -> tuple[object, float]:
    """Capture `forward(size)` for every size, largest first, into `graphs` and their
    outputs into `outputs`, all in one memory pool (`pool`, or a new one); returns the
    pool and the seconds it took."""
    start = time.perf_counter()
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for size in reversed(sizes):
            forward(size)  # compile the kernels and warm the allocator first
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                outputs[size] = forward(size)
            pool = graph.pool()
            graphs[size] = graph
    torch.cuda.current_stream(device).wait_stream(stream)
    torch.cuda.synchronize(device)
    return pool, time.perf_counter() - start


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, then multiples of 8, up to (and including) max_num_seqs."""
    sizes = [s for s in (1, 2, 4) if s < max_num_seqs]
    sizes += list(range(8, max_num_seqs, 8))
    return [*sizes, max_num_seqs]


def token_buckets(max_tokens: int, smallest: int = 16) -> list[int]:
    """Powers of two up to 256, then four sizes per doubling (at most 25 % padding), up to
    and including max_tokens."""
    sizes, size = [], smallest
    while size < max_tokens:
        sizes.append(size)
        size += size if size < 256 else 1 << (size.bit_length() - 3)
    return [*sizes, max_tokens]


class DecodeGraphs:
    """Graphs keyed by batch size, for `attn.query_len` tokens per sequence."""

    def __init__(
        self, model: nn.Module, attn: GraphMetadata, device: torch.device,
        capture: bool = True, pool: object = None, logits: bool = False,
        float_logits: bool = True, last_token_logits: bool = False,
    ) -> None:
        """`logits`: the graphs compute every row's logits too (`last_logits`, of the rows
        `logit_rows` gives; float32, or without `float_logits` as
        `model.compute_logits(as_float=False)` gives them); `last_token_logits`: only
        each sequence's last token's (a draft's two-token forward samples only those)."""
        self.model = model
        self.attn = attn
        self.with_logits = logits
        self.float_logits = float_logits
        self.last_token_logits = last_token_logits
        self.logits: dict[int, torch.Tensor] = {}  # captured with `hidden`, when with_logits
        self.last_logits: torch.Tensor | None = None  # the last run's, when with_logits
        self.tokens_per_seq = attn.query_len
        self.device = device
        self.sizes = graph_batch_sizes(attn.max_batch)
        self.input_ids, self.positions = attn.token_rows  # filled by attn.prepare_replay
        self.hidden: dict[int, torch.Tensor] = {}  # graph outputs (or eager results)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = pool  # the graphs' memory pool (other graphs may share it)
        self.capture_seconds = 0.0
        self.steps = 0  # steps served through the static buffers
        self._ones = torch.ones(attn.max_batch, dtype=torch.long, device=device)
        self._last_run: tuple[int, int] | None = None  # (n, size) of the last step run
        if capture:
            self.pool, self.capture_seconds = capture_graphs(
                self.sizes, self._forward, self.graphs, self.hidden, device, pool)

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    def fits(self, query_lens: list[int]) -> bool:
        """Whether a step with these per-sequence token counts can run here."""
        q = self.tokens_per_seq
        return 0 < len(query_lens) <= self.max_batch and all(n == q for n in query_lens)

    def _forward(self, size: int) -> torch.Tensor:
        tokens = size * self.tokens_per_seq
        with (first_row_skipped_where(self.attn.first_row_skipped) if self.attn.catch_up
              else nullcontext()):
            hidden = self.model(self.input_ids[:tokens], self.positions[:tokens],
                                self.attn.metadata(size))
        if self.with_logits:  # the captured call is the last, so its buffer stays
            q = self.tokens_per_seq
            rows = hidden[q - 1::q] if self.last_token_logits else hidden
            self.logits[size] = self.model.compute_logits(rows, self.float_logits)
        return hidden

    def logit_rows(self, n: int) -> list[int]:
        """The rows of a step of n sequences whose logits the graphs compute."""
        q = self.tokens_per_seq
        if self.last_token_logits:
            return [i * q + q - 1 for i in range(n)]
        return list(range(n * q))

    def run(
        self, input_ids: list[int] | torch.Tensor, positions: list[int], seq_lens: list[int],
        block_tables: list[list[int]], offsets: torch.Tensor | None = None,
        done_below: int = 0, follows: bool = False,
    ) -> torch.Tensor:
        """Hidden states `[n * tokens_per_seq, hidden]` of one step of n <= max_batch
        sequences (flattened, sequence by sequence). `input_ids` may already be on the
        device (the tokens the step before sampled). `offsets` (on the device, `[n]`): each
        sequence is that many tokens further on than `positions` and `seq_lens` say (and
        `done_below`: `GraphMetadata.advance`'s). `follows`: the last step run here, each
        sequence one token on (a proposal round's next one-token forward; ids on the
        device): the buffers are moved on the device, not written from the host again."""
        n = len(seq_lens)
        size = next(s for s in self.sizes if s >= n)
        self.steps += 1
        real = n * self.tokens_per_seq
        on_device = isinstance(input_ids, torch.Tensor)
        if follows:
            assert on_device and self._last_run == (n, size) and self.tokens_per_seq == 1, (
                "follows: one token on from the last step run here, its ids on the device")
            self.input_ids[:real].copy_(input_ids)
            self.attn.advance(n, self._ones[:n], self.positions)
        else:
            self.attn.prepare_replay(size, seq_lens, block_tables,
                                     [None if on_device else input_ids, positions])
            if on_device:
                self.input_ids[:real].copy_(input_ids)
            if offsets is not None:
                self.attn.advance(n, offsets, self.positions, done_below)
        self._last_run = (n, size)
        if size in self.graphs:
            self.graphs[size].replay()
            hidden = self.hidden[size]
        else:
            with torch.inference_mode():
                hidden = self._forward(size)
        self.last_logits = (self.logits[size][:n if self.last_token_logits else real]
                            if self.with_logits else None)
        return hidden[:real]


class MixedGraphs:
    """Graphs keyed by token count (`token_buckets`), for steps of up to `attn.max_seqs`
    sequences that each bring at most `attn.max_query_len` tokens."""

    def __init__(
        self, model: nn.Module, attn: VarlenGraphMetadata, device: torch.device,
        capture: bool = True, pool: object = None,
    ) -> None:
        self.model = model
        self.attn = attn
        self.device = device
        self.sizes = token_buckets(attn.max_tokens)
        self.tokens = attn.token_rows  # row 0: token ids, row 1: positions
        self.hidden: dict[int, torch.Tensor] = {}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = pool
        self.capture_seconds = 0.0
        self.steps = 0
        if capture:
            self.pool, self.capture_seconds = capture_graphs(
                self.sizes, self._forward, self.graphs, self.hidden, device, pool)

    def fits(self, query_lens: list[int]) -> bool:
        return self.attn.fits(query_lens)

    def _forward(self, size: int) -> torch.Tensor:
        return self.model(self.tokens[0, :size], self.tokens[1, :size],
                          self.attn.metadata(size))

    def run(
        self, input_ids: list[int] | torch.Tensor, positions: list[int], query_lens: list[int],
        seq_lens: list[int], block_tables: list[list[int]],
    ) -> torch.Tensor:
        """Hidden states `[n, hidden]` of one step of n tokens. `input_ids` may already be
        on the device."""
        n = len(positions)
        size = next(s for s in self.sizes if s >= n)
        self.steps += 1
        on_device = isinstance(input_ids, torch.Tensor)
        self.attn.prepare_replay(size, query_lens, seq_lens, block_tables,
                                 [None if on_device else input_ids, positions])
        if on_device:
            self.tokens[0, :n].copy_(input_ids)
        if size in self.graphs:
            self.graphs[size].replay()
            return self.hidden[size][:n]
        with torch.inference_mode():
            return self._forward(size)[:n]
