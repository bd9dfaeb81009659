"""Llama 2/3/3.1/3.2 (also SmolLM2, TinyLlama, Mistral), Qwen2/2.5 and Qwen3.

The three differ only in switches on `ModelConfig`: Qwen2 adds a bias to q/k/v
(`attention_bias`), Qwen3 normalises each q/k head with RMSNorm before RoPE (`qk_norm`).
Module names follow the HF checkpoints, so weight loading is a rename-free copy, except for
the fused q/k/v and gate/up projections.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from infer.attention import Attention, AttentionMetadata
from infer.config import ModelConfig
from infer.models.layers import GatedMLP, RMSNorm, RotaryEmbedding
from infer.models.weights import load_weights

STACKED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def fused_shard_sizes(cfg: ModelConfig):
    """Row counts of the shards of `qkv_proj` (q, k, v) and `gate_up_proj` (gate, up)."""

    def sizes(name: str) -> list[int]:
        if "qkv_proj" in name:
            return [cfg.q_size, cfg.kv_size, cfg.kv_size]
        return [cfg.intermediate_size] * 2

    return sizes


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.q_size, self.kv_size, self.head_dim = cfg.q_size, cfg.kv_size, cfg.head_dim
        self.qkv_proj = nn.Linear(
            cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, bias=cfg.attention_bias
        )
        # Qwen2 biases q/k/v only; Llama's `attention_bias` covers the output projection too.
        o_bias = cfg.attention_bias and cfg.architecture != "qwen2"
        self.o_proj = nn.Linear(cfg.q_size, cfg.hidden_size, bias=o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)
        self.qk_norm = cfg.qk_norm
        self.rotary = [rotary]  # a list, so the shared module is not registered per layer
        self.attn = Attention(
            cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.head_dim**-0.5,
            sliding_window=cfg.layer_window(layer),
        )

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(x.shape[0], -1, self.head_dim)
        k = k.reshape(x.shape[0], -1, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary[0](positions, q, k)
        return self.o_proj(self.attn(q.flatten(1), k.flatten(1), v, meta))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.self_attn = LlamaAttention(cfg, layer, rotary)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, cfg.mlp_bias)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream is `x + residual` (`residual` None: just `x`, the embedding);
        returns the layer's output in the same split form, for the fused add + norm."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(positions, h, meta)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, i, self.rotary) for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            x, residual = layer(positions, x, residual, meta)
        return self.norm(x, residual)[0]


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg)
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
        return F.linear(hidden, weight).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], source: str) -> None:
        cfg = self.config

        def rename(name: str) -> str | None:
            if "rotary_emb.inv_freq" in name:
                return None
            if name == "lm_head.weight" and cfg.tie_word_embeddings:
                return None
            return name

        load_weights(self, weights, STACKED, fused_shard_sizes(cfg), rename, source=source)
