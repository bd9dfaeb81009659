"""Runs one scheduled step on the device: inputs -> model -> logits of the rows to sample."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from infer.attention import Attention, AttentionMetadata, allocate_kv_cache
from infer.config import ModelConfig
from infer.engine.scheduler import SchedulerOutput


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    # Row of `hidden` holding each sampling request's last token, in scheduled order.
    sample_rows: torch.Tensor
    sample_request_ids: list[str]


class ModelRunner:
    def __init__(
        self,
        model: nn.Module,
        model_config: ModelConfig,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        kv_dtype: torch.dtype,
    ) -> None:
        self.model = model
        self.model_config = model_config
        self.block_size = block_size
        self.device = device
        self.kv_pool = allocate_kv_cache(model, num_blocks, block_size, kv_dtype, device)
        # Engines may share one model's weights (tests, draft models): each keeps its own
        # cache views and re-points the layers at them when another engine ran in between.
        self._layers = [m for m in model.modules() if isinstance(m, Attention)]
        self._views = [(m.k_cache, m.v_cache) for m in self._layers]

    def prepare(self, out: SchedulerOutput, tables: dict[str, list[int]]) -> StepInputs:
        tokens: list[int] = []
        positions: list[int] = []
        q_lens, seq_lens, block_tables = [], [], []
        rows, ids = [], []
        for item in out.scheduled:
            request, start, n = item.request, item.start, item.num_new_tokens
            tokens.extend(request.token_slice(start, start + n))
            positions.extend(range(start, start + n))
            q_lens.append(n)
            seq_lens.append(start + n)
            block_tables.append(tables[request.request_id])
            if item.samples:
                rows.append(len(tokens) - 1)
                ids.append(request.request_id)
        meta = AttentionMetadata.build(q_lens, seq_lens, block_tables, self.block_size,
                                       self.device)
        return StepInputs(
            input_ids=torch.tensor(tokens, dtype=torch.long, device=self.device),
            positions=torch.tensor(positions, dtype=torch.long, device=self.device),
            meta=meta,
            sample_rows=torch.tensor(rows, dtype=torch.long, device=self.device),
            sample_request_ids=ids,
        )

    @torch.inference_mode()
    def execute(self, inputs: StepInputs) -> torch.Tensor:
        """Float32 logits `[num_sampling_requests, vocab]`."""
        if self._layers[0].k_cache is not self._views[0][0]:
            for layer, (k, v) in zip(self._layers, self._views):
                layer.k_cache, layer.v_cache = k, v
        hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta)
        return self.model.compute_logits(hidden[inputs.sample_rows])
