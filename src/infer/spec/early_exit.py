"""The target's own first layers as a draft model (`speculative_method="self"`)."""

from __future__ import annotations

import torch
from torch import nn

from infer.attention import AttentionMetadata


class EarlyExit(nn.Module):
    """The target's embedding, first `num_layers` layers, final norm and LM head: no weights
    of its own. It writes those layers' KV cache where the target does (the target's
    verify forward rewrites the same slots with the same values for accepted tokens)."""

    def __init__(self, target: nn.Module, num_layers: int) -> None:
        super().__init__()
        total = target.config.num_layers
        if not 0 < num_layers < total:
            raise ValueError(f"self_draft_layers must be in 1..{total - 1} for a model of "
                             f"{total} layers, got {num_layers}")
        self.target = target
        self.num_layers = num_layers

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        return self.target(input_ids, positions, meta, self.num_layers)

    def compute_logits(self, hidden: torch.Tensor, as_float: bool = True) -> torch.Tensor:
        return self.target.compute_logits(hidden, as_float)
