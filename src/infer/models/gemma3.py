"""Gemma 3 (text only): Gemma3ForCausalLM checkpoints, and the text tower of Gemma3 VLMs.

Differences from Llama: every norm is `x * (1 + w)` in float32; each q/k head is
normalised before RoPE; attention and MLP outputs are normalised again before the residual
add; the embedding is scaled by sqrt(hidden); layers alternate between sliding-window
("sliding_attention", RoPE base `rope_local`) and global ("full_attention", base `rope`,
possibly scaled); attention is scaled by `query_pre_attn_scalar ** -0.5`; the logits may be
soft-capped. Module names follow the HF checkpoint, except the fused q/k/v and gate/up.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from infer.attention import Attention, AttentionMetadata
from infer.config import ModelConfig
from infer.models.layers import GatedMLP, RMSNorm, RotaryEmbedding
from infer.models.llama import STACKED, fused_shard_sizes
from infer.models.weights import load_weights


def _norm(cfg: ModelConfig, dim: int) -> RMSNorm:
    return RMSNorm(dim, cfg.norm_eps, offset=1.0)


class Gemma3Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.q_size, self.kv_size, self.head_dim = cfg.q_size, cfg.kv_size, cfg.head_dim
        self.qkv_proj = nn.Linear(
            cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, bias=cfg.attention_bias
        )
        self.o_proj = nn.Linear(cfg.q_size, cfg.hidden_size, bias=cfg.attention_bias)
        self.q_norm = _norm(cfg, cfg.head_dim)
        self.k_norm = _norm(cfg, cfg.head_dim)
        self.rotary = [rotary]  # a list, so the shared module is not registered per layer
        scalar = cfg.query_pre_attn_scalar or cfg.head_dim
        # `attn_logit_softcapping` is deliberately not applied: transformers' Gemma 3 keeps
        # it in the config but never uses it (Gemma 3 replaced Gemma 2's cap by q/k norms).
        self.attn = Attention(
            cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, scalar**-0.5,
            sliding_window=cfg.layer_window(layer),
        )

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.reshape(x.shape[0], -1, self.head_dim))
        k = self.k_norm(k.reshape(x.shape[0], -1, self.head_dim))
        q, k = self.rotary[0](positions, q, k)
        return self.o_proj(self.attn(q.flatten(1), k.flatten(1), v, meta))


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.input_layernorm = _norm(cfg, cfg.hidden_size)
        self.self_attn = Gemma3Attention(cfg, layer, rotary)
        self.post_attention_layernorm = _norm(cfg, cfg.hidden_size)
        self.pre_feedforward_layernorm = _norm(cfg, cfg.hidden_size)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, cfg.mlp_bias)
        self.post_feedforward_layernorm = _norm(cfg, cfg.hidden_size)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream is `x + residual` (see LlamaDecoderLayer.forward)."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.post_attention_layernorm(self.self_attn(positions, h, meta))
        h, residual = self.pre_feedforward_layernorm(h, residual)
        return self.post_feedforward_layernorm(self.mlp(h)), residual


class Gemma3Model(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        # Created in the default (= weight) dtype and cast along with the model, so in bf16
        # the scale is rounded exactly as transformers rounds it (sqrt(640) -> 25.25).
        self.register_buffer("embed_scale", torch.tensor(cfg.hidden_size**0.5), persistent=False)
        rope = {"full_attention": cfg.rope, "sliding_attention": cfg.rope_local or cfg.rope}
        # One table per layer kind in use, shared by all layers of that kind.
        self.rotary = nn.ModuleDict({
            kind: RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, rope[kind])
            for kind in sorted(set(cfg.layer_types))
        })
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(cfg, i, self.rotary[kind])
            for i, kind in enumerate(cfg.layer_types)
        )
        self.norm = _norm(cfg, cfg.hidden_size)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        x, residual = x * self.embed_scale.to(x.dtype), None
        for layer in self.layers:
            x, residual = layer(positions, x, residual, meta)
        return self.norm(x, residual)[0]


class Gemma3ForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = Gemma3Model(cfg)
        self.lm_head = (
            None if cfg.tie_word_embeddings
            else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        )

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Final hidden states `[num_tokens, hidden]`; `compute_logits` picks the rows needed."""
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = F.linear(hidden, weight).float()
        cap = self.config.final_logit_softcapping
        return torch.tanh(logits / cap) * cap if cap else logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], source: str) -> None:
        cfg = self.config

        def rename(name: str) -> str | None:
            # A Gemma3ForConditionalGeneration checkpoint stores the text tower under
            # `language_model.`; its vision tower and projector are not ours.
            if name.startswith(("vision_tower.", "multi_modal_projector.")):
                return None
            name = name.removeprefix("language_model.")
            if "rotary_emb." in name or (name == "lm_head.weight" and cfg.tie_word_embeddings):
                return None
            return name

        load_weights(self, weights, STACKED, fused_shard_sizes(cfg), rename, source=source)
