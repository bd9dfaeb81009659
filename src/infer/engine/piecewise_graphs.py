"""Steps of any shape (prefill chunks beside decodes) replayed from CUDA graphs cut at attention.

Attention depends on every sequence's lengths (its launch shapes, the dense path for long
prompts), but everything between two attention calls (norms, projections, RoPE, the MLP,
the KV store) depends only on the number of tokens. So the model is captured per token
count as `layers + 1` graphs cut where each layer attends: graph 0 runs from the embedding
to layer 0's q/k/v and KV store, layer 0's attention runs eagerly with the step's
metadata, graph 1 runs from layer 0's output projection to layer 1's KV store, and so on;
the last graph ends with the final norm. The KV stores read their slots from a static
buffer (-1 on padding rows: nothing is written). A replay costs the host tens of
microseconds where the eager forward costs a launch per op (~13 ms per step of a 1B model
on the H100's host, whatever the step's size).

A step of n tokens runs the graphs of the smallest size `>= n`; rows n..size-1 are padding
(token 0 at position 0). Their attention is never computed: their rows of the attention
output keep what an earlier step left, and no op outside attention mixes rows. Attention
reads the graph's queries and writes one static output buffer that the next graph reads.

While capturing, the layers' backend is a `_Cut`: instead of attending it ends the graph
being captured, records the layer's attention and begins the next graph. The recorded
queries do not own their memory (see `_unowned`), so the next graph may reuse it: on
replay the eager attention reads them before that graph runs, on the same stream.

On a CPU the same static buffers and padding run eagerly (`capture=False`), so tests cover
everything but capture and replay.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import nn

from infer.attention import Attention, AttentionMetadata, set_attention_backend
from infer.attention.backend import AttentionBackend
from infer.attention.kv_dtype import UNSCALED, KVScales
from infer.attention.qk_prologue import QKPrologue
from infer.engine.cuda_graphs import token_buckets
from infer.models.layers import activation_dtype
from infer.transfer import to_device


def _unowned(t: torch.Tensor) -> torch.Tensor:
    """A tensor over `t`'s memory that does not keep that memory allocated."""
    storage = torch._C._construct_storage_from_data_pointer(
        t.untyped_storage().data_ptr(), t.device, t.untyped_storage().nbytes())
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(
        storage, t.storage_offset(), t.shape, t.stride())


@dataclass
class _LayerAttention:
    """One layer's attention as the model called it: its cache, its options and (once
    captured) the queries that the graph before it leaves."""

    backend: AttentionBackend
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    scale: float
    sliding_window: int | None
    logit_softcap: float | None
    q: torch.Tensor | None = None

    def __call__(self, q: torch.Tensor, meta: AttentionMetadata, out: torch.Tensor) -> None:
        """Attend with the first `meta.num_tokens` rows (their keys and values already
        stored), writing into `out`."""
        n = meta.num_tokens
        out[:n].copy_(self.backend.forward(q[:n], self.k_cache, self.v_cache, meta,
                                           self.scale, self.sliding_window,
                                           self.logit_softcap))


class _Cut:
    """The layers' backend while a bucket is warmed up, captured or (without capture) run.
    Keys and values go to the slots of the static `slots` buffer. Capturing (`begin`
    called): each layer's attention ends the graph being captured and begins the next.
    Otherwise it attends over the step's real rows (`step_meta`), or not at all (warm-up:
    `step_meta` None)."""

    def __init__(self, backend: AttentionBackend, out: torch.Tensor, slots: torch.Tensor,
                 step_meta: AttentionMetadata | None = None, pool: object = None) -> None:
        self.backend, self.out, self.slots = backend, out, slots
        self.step_meta, self.pool = step_meta, pool
        self.pieces: list[tuple[torch.cuda.CUDAGraph, _LayerAttention]] = []
        self.graph: torch.cuda.CUDAGraph | None = None

    def begin(self) -> None:
        self.graph = torch.cuda.CUDAGraph()
        self.graph.capture_begin(pool=self.pool)

    def end(self) -> torch.cuda.CUDAGraph:
        graph, self.graph = self.graph, None
        graph.capture_end()
        self.pool = graph.pool()
        return graph

    def write_kv(self, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor, slot_mapping: torch.Tensor, scales: KVScales = UNSCALED
                 ) -> None:
        self.backend.write_kv(k_cache, v_cache, k, v, self.slots[:k.shape[0]], scales)

    def write_kv_with_prologue(
        self, k_cache: torch.Tensor, v_cache: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
        v: torch.Tensor, slot_mapping: torch.Tensor, positions: torch.Tensor,
        prologue: QKPrologue, scales: KVScales = UNSCALED,
    ) -> torch.Tensor:
        return self.backend.write_kv_with_prologue(k_cache, v_cache, q, k, v,
                                                   self.slots[:k.shape[0]], positions,
                                                   prologue, scales)

    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, sliding_window: int | None = None,
                logit_softcap: float | None = None) -> torch.Tensor:
        attend = _LayerAttention(self.backend, k_cache, v_cache, scale, sliding_window,
                                 logit_softcap)
        out = self.out[:q.shape[0]]
        if self.graph is not None:
            graph = self.end()
            attend.q = _unowned(q)
            self.pieces.append((graph, attend))
            self.begin()
        elif self.step_meta is not None:
            attend(q, self.step_meta, out)
        return out


class PiecewiseGraphs:
    """Graphs per token-count bucket, cut at every layer's attention."""

    def __init__(self, model: nn.Module, backend: AttentionBackend, max_tokens: int,
                 device: torch.device, capture: bool = True, pool: object = None) -> None:
        self.model, self.backend, self.device = model, backend, device
        self.sizes = token_buckets(max_tokens)
        n = self.sizes[-1]
        # Row 0: token ids, row 1: positions (one host-to-device copy per step).
        self.tokens = torch.zeros(2, n, dtype=torch.long, device=device)
        self.slots = torch.full((n,), -1, dtype=torch.long, device=device)
        layer = next(m for m in model.modules() if isinstance(m, Attention))
        dtype = activation_dtype(model)
        # The attention output that every graph after the first reads; zeros, so padding
        # rows are finite before any step wrote them.
        self.attn_out = torch.zeros(n, layer.num_heads, layer.head_dim, dtype=dtype,
                                    device=device)
        # What the model passes to attention while warming up and capturing (never read).
        self._placeholder = AttentionMetadata.build([1], [1], [[0]], 1, device)
        self.pieces: dict[int, list[tuple[torch.cuda.CUDAGraph, _LayerAttention]]] = {}
        self.last: dict[int, torch.cuda.CUDAGraph] = {}  # from the last attention on
        self.hidden: dict[int, torch.Tensor] = {}  # the last graphs' outputs
        self.pool = pool
        self.capture_seconds = 0.0
        self.steps = 0  # steps served through the static buffers
        if capture:
            self._capture_all()

    @property
    def max_tokens(self) -> int:
        return self.sizes[-1]

    def fits(self, num_tokens: int) -> bool:
        return 0 < num_tokens <= self.max_tokens

    def _forward(self, size: int, cut: _Cut) -> torch.Tensor:
        set_attention_backend(self.model, cut)
        try:
            return self.model(self.tokens[0, :size], self.tokens[1, :size],
                              cut.step_meta or self._placeholder)
        finally:
            set_attention_backend(self.model, self.backend)

    @torch.inference_mode()
    def _capture_all(self) -> None:
        start = time.perf_counter()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for size in reversed(self.sizes):
                # Compile the kernels and warm the allocator first.
                self._forward(size, _Cut(self.backend, self.attn_out, self.slots))
                torch.cuda.synchronize(self.device)
                cut = _Cut(self.backend, self.attn_out, self.slots, pool=self.pool)
                cut.begin()
                self.hidden[size] = self._forward(size, cut)
                self.last[size] = cut.end()
                self.pieces[size] = cut.pieces
                self.pool = cut.pool
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        self.capture_seconds = time.perf_counter() - start

    def run(self, input_ids: list[int] | torch.Tensor, positions: list[int],
            meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states `[n, hidden]` of a step of `n = meta.num_tokens <= max_tokens`
        tokens. `input_ids` may already be on the device."""
        n = meta.num_tokens
        size = next(s for s in self.sizes if s >= n)
        self.steps += 1
        on_device = isinstance(input_ids, torch.Tensor)
        rows = [[0] * n if on_device else input_ids, positions]
        self.tokens[:, :n].copy_(to_device(torch.tensor(rows, dtype=torch.long), self.device))
        if on_device:
            self.tokens[0, :n].copy_(input_ids)
        self.tokens[:, n:size].zero_()
        self.slots[:n].copy_(meta.slot_mapping)
        self.slots[n:size].fill_(-1)
        if size not in self.last:
            with torch.inference_mode():
                cut = _Cut(self.backend, self.attn_out, self.slots, meta)
                return self._forward(size, cut)[:n]
        for graph, attend in self.pieces[size]:
            graph.replay()
            attend(attend.q, meta, self.attn_out)
        self.last[size].replay()
        return self.hidden[size][:n]
