"""Decode steps replayed from captured CUDA graphs.

A decode step of `n` sequences runs the graph captured for the smallest batch size
`>= n`: the step's inputs are copied into static buffers, rows `n..size-1` are padding
(slot -1, so nothing is written to the cache; length 1, so attention reads one valid key;
their outputs are ignored). Graphs of all sizes share one memory pool and the same static
buffers, captured from the largest down.

Capture needs a backend whose launches never synchronise with the host or change shape
with the sequence lengths: the Triton backend with a fixed `decode_splits` per size. On a CPU the
same buffers and padding run eagerly (`capture=False`), so tests cover everything but the
capture itself.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch import nn

from infer.attention.metadata import AttentionMetadata, padded_block_tables
from infer.transfer import to_device


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, then multiples of 8, up to (and including) max_num_seqs."""
    sizes = [s for s in (1, 2, 4) if s < max_num_seqs]
    sizes += list(range(8, max_num_seqs, 8))
    return [*sizes, max_num_seqs]


class DecodeGraphs:
    def __init__(
        self, model: nn.Module, max_num_seqs: int, max_blocks_per_seq: int, block_size: int,
        decode_splits: Callable[[int], int], device: torch.device, capture: bool = True,
    ) -> None:
        self.model = model
        self.block_size = block_size
        self.decode_splits = decode_splits
        self.device = device
        self.sizes = graph_batch_sizes(max_num_seqs)
        n = self.sizes[-1]
        as_long = dict(dtype=torch.long, device=device)
        self.input_ids = torch.zeros(n, **as_long)
        self.positions = torch.zeros(n, **as_long)
        self.slot_mapping = torch.full((n,), -1, **as_long)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32,
                                        device=device)
        self.hidden: dict[int, torch.Tensor] = {}  # graph outputs (or eager results)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.capture_seconds = 0.0
        self.steps = 0  # decode steps served through the static buffers
        if capture:
            self._capture_all()

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    def _meta(self, size: int) -> AttentionMetadata:
        return AttentionMetadata(
            query_start_loc=self.query_start_loc[:size + 1], seq_lens=self.seq_lens[:size],
            block_tables=self.block_tables[:size], slot_mapping=self.slot_mapping[:size],
            block_size=self.block_size, query_lens_host=[1] * size,
            # Only the kernels read the lengths (from the device); the host list must not
            # steer anything, so it holds a placeholder.
            seq_lens_host=[1] * size, decode_splits=self.decode_splits(size),
        )

    def _forward(self, size: int) -> torch.Tensor:
        return self.model(self.input_ids[:size], self.positions[:size], self._meta(size))

    @torch.inference_mode()
    def _capture_all(self) -> None:
        start = time.perf_counter()
        pool = None
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for size in reversed(self.sizes):
                self._forward(size)  # compile the kernels and warm the allocator first
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    self.hidden[size] = self._forward(size)
                pool = graph.pool()
                self.graphs[size] = graph
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        self.capture_seconds = time.perf_counter() - start

    def run(
        self, input_ids: list[int] | torch.Tensor, positions: list[int], slots: list[int],
        seq_lens: list[int], block_tables: list[list[int]],
    ) -> torch.Tensor:
        """Hidden states `[n, hidden]` of one all-decode step of n <= max_batch sequences.
        `input_ids` may already be on the device (the tokens the step before sampled)."""
        n = len(positions)
        size = next(s for s in self.sizes if s >= n)
        self.steps += 1
        pad = size - n
        on_device = isinstance(input_ids, torch.Tensor)
        host_ids = [0] * size if on_device else input_ids + [0] * pad
        rows = to_device(torch.tensor([host_ids, positions + [0] * pad, slots + [-1] * pad,
                                       seq_lens + [1] * pad], dtype=torch.long), self.device)
        tables = to_device(padded_block_tables(block_tables, size), self.device)
        if on_device:
            self.input_ids[:n].copy_(input_ids)
        else:
            self.input_ids[:size].copy_(rows[0])
        self.positions[:size].copy_(rows[1])
        self.slot_mapping[:size].copy_(rows[2])
        self.seq_lens[:size].copy_(rows[3])
        self.block_tables[:size, :tables.shape[1]].copy_(tables)
        if size in self.graphs:
            self.graphs[size].replay()
            return self.hidden[size][:n]
        with torch.inference_mode():
            return self._forward(size)[:n]
