"""The work between a layer's q/k/v projection and its KV store, which a backend may fuse
into the store: an optional RMSNorm of every q and k head, then RoPE at the tokens'
positions."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class QKPrologue:
    """The model's own modules (it owns their weights): `rotary` is a `RotaryEmbedding`
    (`cos`/`sin` tables `[max_pos, head_dim / 2]`, called as `(positions, q, k)`), the norms
    `RMSNorm`s over head_dim sharing one eps and offset."""

    rotary: nn.Module
    q_norm: nn.Module | None = None
    k_norm: nn.Module | None = None

    def apply(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """The unfused path on `[tokens, heads, head_dim]`, each module on its own kernels."""
        return self.rotary(positions, *self.normed(q, k))

    def normed(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q and k through the head norms, if the model has them."""
        if self.q_norm is not None and self.k_norm is not None:
            return self.q_norm(q), self.k_norm(k)
        return q, k

    @property
    def fusable(self) -> bool:
        """The model's kernels run on Triton (`kernel_backend`), so one kernel may do it all."""
        return bool(self.rotary.use_triton)
