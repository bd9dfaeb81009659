"""The self-attention block every architecture shares: fused q/k/v projection, optional
per-head q/k RMSNorm, optional RoPE, paged attention, output projection."""

from __future__ import annotations

import torch
from torch import nn

from infer.attention import Attention, AttentionMetadata
from infer.attention.qk_prologue import QKPrologue
from infer.config import ModelConfig
from infer.models.layers import RMSNorm, RotaryEmbedding
from infer.models.linear import QKVParallelLinear, RowParallelLinear


class SelfAttention(nn.Module):
    """Switches, all from `cfg` except two: `rotary` (None: no RoPE, as in GPT-2) and
    `norm_offset` of the q/k norms (1.0: Gemma's `x * (1 + w)`). Queries are scaled by
    `query_pre_attn_scalar ** -0.5` when the config sets it (Gemma), else `head_dim ** -0.5`."""

    def __init__(
        self, cfg: ModelConfig, layer: int, rotary: RotaryEmbedding | None,
        norm_offset: float = 0.0,
    ) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.attention_bias
        )
        self.o_proj = RowParallelLinear(cfg.q_size, cfg.hidden_size, cfg.attention_out_bias)
        if cfg.qk_norm:
            # Their rows are heads, going to RoPE, not into a projection.
            self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps, offset=norm_offset,
                                  feeds_projection=False)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps, offset=norm_offset,
                                  feeds_projection=False)
        self.qk_norm = cfg.qk_norm
        # The q/k norms and RoPE run where attention stores the keys (fused on Triton).
        prologue = None
        if rotary is not None:
            prologue = QKPrologue(rotary, *((self.q_norm, self.k_norm) if cfg.qk_norm else ()))
        elif cfg.qk_norm:
            raise ValueError("q/k norms without RoPE are not supported")
        scalar = cfg.query_pre_attn_scalar or cfg.head_dim
        self.attn = Attention(
            self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, cfg.head_dim, scalar**-0.5,
            sliding_window=cfg.layer_window(layer), prologue=prologue,
        )

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split(self.qkv_proj.output_sizes, dim=-1)
        return self.o_proj(self.attn(q, k, v, meta, positions))
