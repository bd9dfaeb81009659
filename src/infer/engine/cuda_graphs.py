"""Steps replayed from captured CUDA graphs: decode, or any fixed number of tokens per sequence.

A step of `n` sequences that each bring `tokens_per_seq` new tokens (1 for a decode step,
k + 1 when verifying k speculative tokens) runs the graph captured for the smallest batch
size `>= n`: the step's inputs are copied into static buffers sized for
`max_batch * tokens_per_seq` tokens; rows `n..size-1` are padding (see
`infer.attention.graph_metadata`: nothing is written to the cache, their outputs are
ignored). Graphs of all sizes share one memory pool and the same static buffers, captured
from the largest down. The attention backend supplies the attention buffers
(`init_graph_metadata`); this file owns the token ids and positions.

Capture needs a backend whose launches never synchronise with the host or change shape
with the sequence lengths: the Triton backend, with a fixed split-K factor per size for
decode. On a CPU the same buffers and padding run eagerly (`capture=False`), so tests
cover everything but the capture itself.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from infer.attention.graph_metadata import GraphMetadata


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, then multiples of 8, up to (and including) max_num_seqs."""
    sizes = [s for s in (1, 2, 4) if s < max_num_seqs]
    sizes += list(range(8, max_num_seqs, 8))
    return [*sizes, max_num_seqs]


class DecodeGraphs:
    """Graphs keyed by batch size, for `attn.query_len` tokens per sequence."""

    def __init__(
        self, model: nn.Module, attn: GraphMetadata, device: torch.device,
        capture: bool = True,
    ) -> None:
        self.model = model
        self.attn = attn
        self.tokens_per_seq = attn.query_len
        self.device = device
        self.sizes = graph_batch_sizes(attn.max_batch)
        n = self.sizes[-1] * self.tokens_per_seq
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.hidden: dict[int, torch.Tensor] = {}  # graph outputs (or eager results)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool: object = None  # the graphs' memory pool (other graphs may share it)
        self.capture_seconds = 0.0
        self.steps = 0  # steps served through the static buffers
        if capture:
            self._capture_all()

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    def fits(self, query_lens: list[int]) -> bool:
        """Whether a step with these per-sequence token counts can run here."""
        q = self.tokens_per_seq
        return 0 < len(query_lens) <= self.max_batch and all(n == q for n in query_lens)

    def _forward(self, size: int) -> torch.Tensor:
        tokens = size * self.tokens_per_seq
        return self.model(self.input_ids[:tokens], self.positions[:tokens],
                          self.attn.metadata(size))

    @torch.inference_mode()
    def _capture_all(self) -> None:
        start = time.perf_counter()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for size in reversed(self.sizes):
                self._forward(size)  # compile the kernels and warm the allocator first
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                    self.hidden[size] = self._forward(size)
                self.pool = graph.pool()
                self.graphs[size] = graph
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        self.capture_seconds = time.perf_counter() - start

    def run(
        self, input_ids: list[int] | torch.Tensor, positions: list[int], seq_lens: list[int],
        block_tables: list[list[int]],
    ) -> torch.Tensor:
        """Hidden states `[n * tokens_per_seq, hidden]` of one step of n <= max_batch
        sequences (flattened, sequence by sequence). `input_ids` may already be on the
        device (the tokens the step before sampled)."""
        n = len(seq_lens)
        size = next(s for s in self.sizes if s >= n)
        self.steps += 1
        tokens, real = size * self.tokens_per_seq, n * self.tokens_per_seq
        pad = tokens - real
        on_device = isinstance(input_ids, torch.Tensor)
        host_ids = [0] * tokens if on_device else input_ids + [0] * pad
        ids, pos = self.attn.prepare_replay(size, seq_lens, block_tables,
                                            [host_ids, positions + [0] * pad])
        if on_device:
            self.input_ids[:real].copy_(input_ids)
        else:
            self.input_ids[:tokens].copy_(ids)
        self.positions[:tokens].copy_(pos)
        if size in self.graphs:
            self.graphs[size].replay()
            return self.hidden[size][:real]
        with torch.inference_mode():
            return self._forward(size)[:real]
