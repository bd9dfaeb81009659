"""Llama 2/3/3.1/3.2 (also SmolLM2, TinyLlama, Mistral), Qwen2/2.5 and Qwen3.

The three differ only in switches on `ModelConfig`, set by their entries' config hooks:
Qwen2 adds a bias to q/k/v but not to the output projection (`attention_bias`,
`attention_out_bias`), Qwen3 normalises each q/k head with RMSNorm before RoPE (`qk_norm`).
Module names follow the HF checkpoints, so weight loading is a rename-free copy, except for
the fused q/k/v and gate/up projections.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from infer.attention import AttentionMetadata
from infer.config import ModelConfig, hf_decoder_config
from infer.models.causal_lm import CausalLM, DecoderModel
from infer.models.layers import GatedMLP, RMSNorm, RotaryEmbedding, reduce_in_norm
from infer.models.registry import ArchitectureEntry, GGUFTensorMap
from infer.models.self_attention import SelfAttention

if TYPE_CHECKING:
    from infer.loader.gguf_metadata import GGUFMetadata


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.self_attn = SelfAttention(cfg, layer, rotary)
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


class LlamaForCausalLM(CausalLM):
    def __init__(self, cfg: ModelConfig) -> None:
        rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope)
        layers = [LlamaDecoderLayer(cfg, i, rotary) for i in range(cfg.num_layers)]
        norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        # Every norm called with a residual follows a row-parallel output; the final norm
        # also follows any layer when a self-draft runs only the first few.
        next_norms = [layer.input_layernorm for layer in layers[1:]] + [norm]
        reduce_in_norm(
            [(layer.self_attn.o_proj, layer.post_attention_layernorm) for layer in layers]
            + [(layer.mlp.down_proj, after) for layer, after in zip(layers, next_norms)])
        super().__init__(cfg, DecoderModel(cfg, layers, norm, rotary))


# ---------------------------------------------------------------- configs and GGUF


def _qwen_window(cfg: dict[str, Any]) -> dict[str, Any]:
    """Qwen2/3 use their window only with `use_sliding_window`, and only on the layers from
    `max_window_layers` up."""
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window", False) else None
    layers = cfg["num_hidden_layers"]
    layer_types: tuple[str, ...] = ()
    if window:
        first = cfg.get("max_window_layers", layers)
        layer_types = tuple(
            "sliding_attention" if i >= first else "full_attention" for i in range(layers)
        )
    return dict(sliding_window=window, layer_types=layer_types)


def _qwen2_from_hf(cfg: dict[str, Any]) -> ModelConfig:
    return hf_decoder_config(
        "qwen2", cfg, attention_bias=bool(cfg.get("attention_bias", True)),
        attention_out_bias=False, **_qwen_window(cfg),
    )


def _qwen3_from_hf(cfg: dict[str, Any]) -> ModelConfig:
    return hf_decoder_config("qwen3", cfg, qk_norm=True, **_qwen_window(cfg))


def _unpermute_qk(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation. HF rotates the two halves of each head
    (pairs (i, i + d/2)); GGML's RoPE rotates adjacent rows (2i, 2i + 1), so the converter
    stores each head's rows as (d/2, 2) -> interleaved. Reading them back as (2, d/2)
    restores HF's order. Works for weights `[heads*d, in]` and biases `[heads*d]`."""
    rows = weight.shape[0]
    per_head = rows // heads
    return (weight.reshape(heads, per_head // 2, 2, *weight.shape[1:])
            .transpose(1, 2).reshape(weight.shape))


def _llama_gguf_fixup(key: str, weight: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    # Only llama's converter permutes; Qwen GGUFs keep HF's order.
    if key in ("attn_q", "attn_k"):
        return _unpermute_qk(weight, cfg.num_heads if key == "attn_q" else cfg.num_kv_heads)
    return weight


# GGUF block tensor -> HF module, for the Llama-style decoders (`blk.N.<key>`).
GGUF_DECODER_LAYER = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
GGUF_DECODER_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                    "output": "lm_head"}
_GGUF_TENSORS = GGUFTensorMap(GGUF_DECODER_TOP, GGUF_DECODER_LAYER)


def _gguf_decoder(g: GGUFMetadata) -> ModelConfig:
    return g.decoder()


def _qwen3_from_gguf(g: GGUFMetadata) -> ModelConfig:
    return g.decoder(qk_norm=True)


ENTRIES = (
    # Mistral-style configs are Llama with GQA and, optionally, a sliding window on every
    # layer.
    ArchitectureEntry(
        name="llama", model_types=("llama", "mistral"), model=LlamaForCausalLM,
        from_hf=lambda cfg: hf_decoder_config("llama", cfg), from_gguf=_gguf_decoder,
        gguf_tensors=_GGUF_TENSORS, gguf_fixup=_llama_gguf_fixup,
    ),
    ArchitectureEntry(
        name="qwen2", model_types=("qwen2",), model=LlamaForCausalLM,
        from_hf=_qwen2_from_hf, from_gguf=_gguf_decoder, gguf_tensors=_GGUF_TENSORS,
    ),
    ArchitectureEntry(
        name="qwen3", model_types=("qwen3",), model=LlamaForCausalLM,
        from_hf=_qwen3_from_hf, from_gguf=_qwen3_from_gguf, gguf_tensors=_GGUF_TENSORS,
    ),
)
