"""What an 8-bit method scaled per channel (INT8, FP8) does in the epilogue of infer's
one-row GEMV: the residual add and RMSNorm after a projection (`add_norm_epilogue`), where
its `apply` sends the row to the GEMV (`one_row_gemv`)."""

from __future__ import annotations

import torch
from torch import nn

from infer.models.linear import add_norm_rows


class GemvEpilogues:
    """A mix-in for a `LinearMethod` with a `weight` and a `weight_scale` per channel."""

    @staticmethod
    def one_row_gemv(layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> bool:
        """Whether `x` is one row that `apply` sends to infer's GEMV, with no bias after."""
        raise NotImplementedError

    def apply_add_norm(self, layer: nn.Module, x: torch.Tensor, residual: torch.Tensor,
                       norm: nn.Module, bias: torch.Tensor | None
                       ) -> tuple[torch.Tensor, torch.Tensor] | None:
        if not self.one_row_gemv(layer, x, bias):
            return None
        return add_norm_rows(x, layer.weight, layer.weight_scale, residual, norm)
