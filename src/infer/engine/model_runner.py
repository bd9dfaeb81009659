"""Runs one scheduled step on the device: inputs -> model -> logits of the rows to sample."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from infer.attention import (
    Attention,
    allocate_kv_cache,
    make_attention_backend,
    set_attention_backend,
)
from infer.config import ModelConfig
from infer.engine.cuda_graphs import DecodeGraphs, MixedGraphs
from infer.engine.piecewise_graphs import PiecewiseGraphs
from infer.engine.scheduler import ScheduledRequest, SchedulerOutput
from infer.models.layers import set_kernel_backend
from infer.transfer import to_device


@dataclass
class StepInputs:
    input_ids: list[int]
    positions: list[int]
    query_lens: list[int]
    seq_lens: list[int]
    block_tables: list[list[int]]
    # Rows of `hidden` whose logits are sampled, in scheduled order: each sampling
    # request's last token, preceded by the tokens before each of its drafts (their
    # logits judge the drafts); `sample_counts[i]` rows for sample_request_ids[i].
    sample_rows: list[int]
    sample_request_ids: list[str]
    sample_counts: list[int]


def _decode_inputs(items: tuple[ScheduledRequest, ...], tables: dict[str, list[int]]
                   ) -> StepInputs:
    """`ModelRunner.prepare` for a step of one-token decodes (every row samples, no
    drafts): the usual step, built column by column."""
    positions = [item.start for item in items]
    n = len(items)
    return StepInputs(
        [item.token_ids[0] for item in items if item.token_ids is not None], positions,
        [1] * n, [p + 1 for p in positions], [tables[item.request_id] for item in items],
        list(range(n)), [item.request_id for item in items], [1] * n)


class ModelRunner:
    def __init__(
        self,
        model: nn.Module,
        model_config: ModelConfig,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        kv_dtype: torch.dtype,
        attention_backend: str = "torch",
        kernel_backend: str = "torch",
        shares_cache_of: ModelRunner | None = None,
    ) -> None:
        """`shares_cache_of`: a runner over the same layers (a self-draft's early exit) whose
        cache and attention backend this one uses; only the graphs are its own."""
        self.model = model
        self.model_config = model_config
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.device = device
        self.attention_backend = attention_backend
        self.kernel_backend = kernel_backend
        if shares_cache_of is not None:
            self.backend = shares_cache_of.backend
            self.kv_pool = shares_cache_of.kv_pool
            self._layers, self._views = shares_cache_of._layers, shares_cache_of._views
        else:
            self.backend = make_attention_backend(attention_backend)
            self.kv_pool = allocate_kv_cache(model, num_blocks, block_size, kv_dtype, device)
            # Engines may share one model's weights (tests): each keeps its own cache views
            # and backends, and re-binds the layers when another engine ran.
            self._layers = [m for m in model.modules() if isinstance(m, Attention)]
            self._views = [(m.k_cache, m.v_cache) for m in self._layers]
        self._bind()
        self.graphs: DecodeGraphs | None = None
        self.verify_graphs: DecodeGraphs | None = None
        self.mixed: MixedGraphs | None = None
        self.piecewise: PiecewiseGraphs | None = None
        # The last forward's hidden states, the rows of them its graph computed the logits
        # of, and those logits.
        self._graph_logits: tuple[torch.Tensor, list[int], torch.Tensor] | None = None
        # Off: logits in the LM head's dtype (a draft's, of which only the argmax is taken).
        self.float_logits = True

    def enable_decode_graphs(self, max_num_seqs: int, max_model_len: int,
                             capture: bool = True, tokens_per_seq: int = 1,
                             logits: bool = False, split_keys: bool = False,
                             catch_up: bool = False, last_token_logits: bool = False
                             ) -> DecodeGraphs:
        """Capture graphs for steps whose sequences each bring `tokens_per_seq` tokens (if
        the backend allows: Triton attention only): decode steps (1), or steps that verify
        k drafts of every sequence (k + 1; `verify_graphs`; `split_keys`: their attention
        through the split-K decode kernel). `logits`: the graphs end with the LM head
        (`sample_logits` then reads their output; `last_token_logits`: only each
        sequence's last token's). `capture=False` runs the same static-buffer path eagerly
        (CPU tests). `catch_up`: a draft's two-token steps (`GraphMetadata`)."""
        attn = self.backend.init_graph_metadata(
            max_num_seqs, tokens_per_seq, max_model_len, self.block_size,
            self._layers[0].num_kv_heads, self.device, split_keys, catch_up)
        self._bind()
        graphs = DecodeGraphs(self.model, attn, self.device, capture=capture,
                              pool=self._graph_pool(), logits=logits,
                              float_logits=self.float_logits,
                              last_token_logits=last_token_logits)
        if tokens_per_seq == 1:
            self.graphs = graphs
        else:
            self.verify_graphs = graphs
        return graphs

    def enable_mixed_graphs(self, max_tokens: int, max_num_seqs: int, max_model_len: int,
                            capture: bool = True) -> MixedGraphs:
        """Capture graphs for steps of any shape up to `max_tokens` tokens (the token
        budget), sharing the decode graphs' memory pool; `capture=False`: see above."""
        layer = self._layers[0]
        attn = self.backend.init_varlen_graph_metadata(
            max_tokens, max_num_seqs, max_model_len, self.block_size, layer.num_heads,
            layer.num_kv_heads, layer.head_dim, self.device)
        self._bind()
        self.mixed = MixedGraphs(self.model, attn, self.device, capture=capture,
                                 pool=self._graph_pool())
        return self.mixed

    def enable_piecewise_graphs(self, max_tokens: int, capture: bool = True
                                ) -> PiecewiseGraphs:
        """Capture graphs cut at attention for steps of up to `max_tokens` tokens that the
        other graphs do not take (sharing their memory pool); `capture=False`: see above."""
        self._bind()
        self.piecewise = PiecewiseGraphs(self.model, self.backend, max_tokens, self.device,
                                         capture=capture, pool=self._graph_pool())
        return self.piecewise

    def release_graphs(self) -> None:
        """Drop every captured graph, once the device has finished with them. Before a
        tensor-parallel world is left: NCCL's teardown waits until each graph that
        captured one of its collectives is destroyed."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.graphs = self.verify_graphs = self.mixed = self.piecewise = None
        gc.collect()

    def _graph_pool(self) -> object:
        """The memory pool graphs captured so far share (None: none captured yet). Steps
        never overlap, so all graphs of the runner can share one."""
        for graphs in (self.mixed, self.graphs, self.verify_graphs):
            if graphs is not None and graphs.pool is not None:
                return graphs.pool
        return None

    def _bind(self) -> None:
        set_attention_backend(self.model, self.backend)
        set_kernel_backend(self.model, self.kernel_backend)
        for layer, (k, v) in zip(self._layers, self._views):
            layer.k_cache, layer.v_cache = k, v

    def prepare(self, out: SchedulerOutput, tables: dict[str, list[int]]) -> StepInputs:
        """Host-side inputs of a step. Items without token ids (launched ahead) leave
        `input_ids` short: the caller passes those ids on the device."""
        if all(i.num_new_tokens == 1 and i.samples and not i.spec_token_ids
               for i in out.scheduled):
            return _decode_inputs(out.scheduled, tables)
        inputs = StepInputs([], [], [], [], [], [], [], [])
        num_tokens = 0
        for item in out.scheduled:
            start, n = item.start, item.num_new_tokens
            if item.token_ids is not None:
                inputs.input_ids.extend(item.token_ids)
            inputs.positions.extend(range(start, start + n))
            inputs.query_lens.append(n)
            inputs.seq_lens.append(start + n)
            inputs.block_tables.append(tables[item.request_id])
            num_tokens += n
            if item.samples:
                rows = 1 + len(item.spec_token_ids)
                inputs.sample_rows.extend(range(num_tokens - rows, num_tokens))
                inputs.sample_request_ids.append(item.request_id)
                inputs.sample_counts.append(rows)
        return inputs

    def execute(self, inputs: StepInputs, device_input_ids: torch.Tensor | None = None,
                offsets: torch.Tensor | None = None, done_below: int = 0,
                follows: bool = False) -> torch.Tensor:
        """Logits `[len(sample_rows), vocab]` (float32, unless `float_logits` is off).
        `device_input_ids` replaces `inputs.input_ids` with ids already on the device
        (async scheduling: the tokens the step still in flight will have sampled).
        `offsets`, `done_below`, `follows`: see `forward`."""
        return self.sample_logits(
            self.forward(inputs, device_input_ids, offsets, done_below, follows), inputs)

    def takes_offsets(self, query_lens: list[int]) -> bool:
        """Whether `forward` can move a step of these query lengths by offsets on the
        device: only the static buffers of uniform steps can."""
        return any(g is not None and g.fits(query_lens)
                   for g in (self.graphs, self.verify_graphs))

    @torch.inference_mode()
    def forward(self, inputs: StepInputs, device_input_ids: torch.Tensor | None = None,
                offsets: torch.Tensor | None = None, done_below: int = 0,
                follows: bool = False) -> torch.Tensor:
        """The step's hidden states `[tokens, hidden]`, in its token order (a graph's
        output buffer: read it before the next step runs). `offsets` (on the device, one
        per sequence; with `takes_offsets`): each sequence is that many tokens further on
        than `inputs` says (its positions, length and slots; its table covers them).
        `done_below` (graphs with `catch_up`): each sequence moved on fewer tokens has its
        first token done (`GraphMetadata.advance`). `follows`: the last forward, every
        sequence one token on, through the same static buffers (`DecodeGraphs.run`)."""
        if self._layers[0].k_cache is not self._views[0][0]:
            self._bind()
        ids = inputs.input_ids if device_input_ids is None else device_input_ids
        decode = next((g for g in (self.graphs, self.verify_graphs)
                       if g is not None and g.fits(inputs.query_lens)), None)
        self._graph_logits = None
        if (offsets is not None or follows) and decode is None:
            raise ValueError("offsets and follows need the static buffers of a uniform step")
        if decode is not None:
            hidden = decode.run(ids, inputs.positions, inputs.seq_lens, inputs.block_tables,
                                offsets, done_below, follows)
            if decode.last_logits is not None:
                self._graph_logits = (hidden, decode.logit_rows(len(inputs.seq_lens)),
                                      decode.last_logits)
        elif self.mixed is not None and self.mixed.fits(inputs.query_lens):
            hidden = self.mixed.run(ids, inputs.positions, inputs.query_lens,
                                    inputs.seq_lens, inputs.block_tables)
        else:
            meta = self.backend.build_metadata(inputs.query_lens, inputs.seq_lens,
                                               inputs.block_tables, self.block_size,
                                               self.device)
            if self.piecewise is not None and self.piecewise.fits(meta.num_tokens):
                hidden = self.piecewise.run(ids, inputs.positions, meta)
            else:
                if device_input_ids is None:
                    ids = to_device(torch.tensor(inputs.input_ids, dtype=torch.long),
                                    self.device)
                positions = to_device(torch.tensor(inputs.positions, dtype=torch.long),
                                      self.device)
                hidden = self.model(ids, positions, meta)
        return hidden

    @torch.inference_mode()
    def sample_logits(self, hidden: torch.Tensor, inputs: StepInputs) -> torch.Tensor:
        """Logits of the rows that sample, `[len(sample_rows), vocab]` (float32, unless
        `float_logits` is off)."""
        if not inputs.sample_rows:
            return hidden[:0]
        graph = self._graph_logits
        if graph is not None and graph[0] is hidden and inputs.sample_rows == graph[1]:
            return graph[2]
        if not (len(inputs.sample_rows) == hidden.shape[0]
                and inputs.sample_rows == list(range(len(inputs.sample_rows)))):
            rows = to_device(torch.tensor(inputs.sample_rows), self.device)
            hidden = hidden[rows]
        return self.model.compute_logits(hidden, self.float_logits)

    def logits_of_rows(self, hidden: torch.Tensor, rows: list[int], chunk: int
                       ) -> Iterator[torch.Tensor]:
        """Float32 logits of `hidden`'s `rows`, `chunk` rows at a time, each computed when
        it is asked for."""
        index = to_device(torch.tensor(rows), self.device)
        for start in range(0, len(rows), chunk):
            with torch.inference_mode():
                yield self.model.compute_logits(hidden[index[start:start + chunk]]).float()
