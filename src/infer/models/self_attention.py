"""The self-attention block every architecture shares: fused q/k/v projection, optional
per-head q/k RMSNorm, optional RoPE, paged attention, output projection."""

from __future__ import annotations

import torch
from torch import nn

from infer.attention import Attention, AttentionMetadata
from infer.attention.qk_prologue import QKPrologue
from infer.config import ModelConfig
from infer.models.layers import RMSNorm, RotaryEmbedding
from infer.models.linear import DeferredMatmul, QKVParallelLinear, RopeStore, RowParallelLinear


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
        self.defer_output = False  # layers.set_add_norm_epilogue
        self.rope_in_qkv = False  # set_qkv_rope_epilogue
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps, offset=norm_offset)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps, offset=norm_offset)
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
    ) -> torch.Tensor | DeferredMatmul:
        """The output projection's result; with `defer_output` (set where only an RMSNorm
        with a residual takes it: `layers.set_add_norm_epilogue`) that projection left to
        the norm."""
        q = self._rotated_and_stored(x, meta, positions) if self.rope_in_qkv else None
        if q is not None:
            out = self.attn.attend(q, meta)
        else:
            q, k, v = self.qkv_proj(x).split(self.qkv_proj.output_sizes, dim=-1)
            out = self.attn(q, k, v, meta, positions)
        return DeferredMatmul(self.o_proj, out) if self.defer_output else self.o_proj(out)

    def _rotated_and_stored(self, x: torch.Tensor, meta: AttentionMetadata,
                            positions: torch.Tensor | None) -> torch.Tensor | None:
        """q of one token rotated, its k and v stored, by the q/k/v projection's own launch
        (`qkv_rope_epilogue`), where the layer has RoPE and no q/k norm, its attention is
        Triton's and the weight's kernel takes the row; else None."""
        prologue = self.attn.prologue
        if (positions is None or prologue is None or prologue.q_norm is not None
                or not prologue.fusable or self.attn.k_cache is None
                # Triton's backend itself (not a piecewise graph's, which stores k and v
                # at slots of its own)
                or getattr(self.attn.backend, "name", None) != "triton"):
            return None
        rotary = prologue.rotary
        return self.qkv_proj.forward_qkv_rope(x, RopeStore(
            self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, self.attn.k_cache,
            self.attn.v_cache, meta.slot_mapping, positions, rotary.cos, rotary.sin))


def set_qkv_rope_epilogue(model: nn.Module, on: bool) -> None:
    """Whether `model`'s self-attention layers have their q/k/v projection rotate q and k
    and store k and v in its own launch where it can (`SelfAttention._rotated_and_stored`,
    `kernels/qkv_rope.py`)."""
    for m in model.modules():
        if isinstance(m, SelfAttention):
            m.rope_in_qkv = on
