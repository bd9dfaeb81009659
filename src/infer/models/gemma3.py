"""Gemma 3 (text only): Gemma3ForCausalLM checkpoints, and the text tower of Gemma3 VLMs.

Differences from Llama: every norm is `x * (1 + w)` in float32; each q/k head is
normalised before RoPE; attention and MLP outputs are normalised again before the residual
add; the embedding is scaled by sqrt(hidden); layers alternate between sliding-window
("sliding_attention", RoPE base `rope_local`) and global ("full_attention", base `rope`,
possibly scaled); attention is scaled by `query_pre_attn_scalar ** -0.5`; the logits may be
soft-capped. Module names follow the HF checkpoint, except the fused q/k/v and gate/up.

`attn_logit_softcapping` is deliberately not read: transformers' Gemma 3 keeps it in the
config but never uses it (Gemma 3 replaced Gemma 2's cap by q/k norms).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from infer.attention import AttentionMetadata
from infer.config import ConfigError, ModelConfig, RopeConfig, hf_decoder_config
from infer.models.causal_lm import CausalLM, DecoderModel
from infer.models.layers import GatedMLP, RMSNorm, RotaryEmbedding, reduce_in_norm
from infer.models.llama import GGUF_DECODER_LAYER, GGUF_DECODER_TOP
from infer.models.registry import ArchitectureEntry, GGUFTensorMap
from infer.models.self_attention import SelfAttention

if TYPE_CHECKING:
    from infer.loader.gguf_metadata import GGUFMetadata


def _norm(cfg: ModelConfig, dim: int, feeds_projection: bool = True) -> RMSNorm:
    return RMSNorm(dim, cfg.norm_eps, offset=1.0, feeds_projection=feeds_projection)


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.input_layernorm = _norm(cfg, cfg.hidden_size)
        self.self_attn = SelfAttention(cfg, layer, rotary, norm_offset=1.0)
        # The sandwich norms' outputs go into the residual adds, not into a projection.
        self.post_attention_layernorm = _norm(cfg, cfg.hidden_size, feeds_projection=False)
        self.pre_feedforward_layernorm = _norm(cfg, cfg.hidden_size)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, cfg.mlp_bias)
        self.post_feedforward_layernorm = _norm(cfg, cfg.hidden_size, feeds_projection=False)

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


class Gemma3ForCausalLM(CausalLM):
    def __init__(self, cfg: ModelConfig) -> None:
        rope = {"full_attention": cfg.rope, "sliding_attention": cfg.rope_local or cfg.rope}
        # One table per layer kind in use, shared by all layers of that kind.
        rotary = nn.ModuleDict({
            kind: RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, rope[kind])
            for kind in sorted(set(cfg.layer_types))
        })
        layers = [Gemma3DecoderLayer(cfg, i, rotary[kind])
                  for i, kind in enumerate(cfg.layer_types)]
        # The sandwich norms take the row-parallel outputs, with no residual.
        reduce_in_norm(
            [(layer.self_attn.o_proj, layer.post_attention_layernorm) for layer in layers]
            + [(layer.mlp.down_proj, layer.post_feedforward_layernorm) for layer in layers])
        model = DecoderModel(cfg, layers, _norm(cfg, cfg.hidden_size), rotary,
                             scale_embeddings=True)
        super().__init__(cfg, model)

    def checkpoint_name(self, name: str) -> str | None:
        # A Gemma3ForConditionalGeneration checkpoint stores the text tower under
        # `language_model.`; its vision tower and projector are not ours.
        if name.startswith(("vision_tower.", "multi_modal_projector.")):
            return None
        return super().checkpoint_name(name.removeprefix("language_model."))


# ---------------------------------------------------------------- configs and GGUF


def _layer_types(pattern: int | list[bool], num_layers: int) -> tuple[str, ...]:
    if isinstance(pattern, list):  # one flag per layer (GGUF), true = sliding window
        if len(pattern) != num_layers:
            raise ConfigError(f"sliding_window_pattern has {len(pattern)} entries")
        return tuple("sliding_attention" if s else "full_attention" for s in pattern)
    # Every `pattern`-th layer is global (transformers' and llama.cpp's rule for Gemma 3).
    return tuple(
        "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
        for i in range(num_layers)
    )


def _from_hf(cfg: dict[str, Any]) -> ModelConfig:
    if cfg.get("model_type") == "gemma3" and "text_config" in cfg:  # a VLM: its text tower
        cfg = {**cfg["text_config"], "model_type": "gemma3_text"}
    if cfg.get("use_bidirectional_attention"):
        raise ConfigError("bidirectional Gemma 3 (e.g. EmbeddingGemma) is not supported")
    # transformers' Gemma3TextConfig defaults for keys that a config.json leaves out.
    theta = float(cfg.get("rope_theta", 1_000_000.0))
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if "full_attention" in params:  # transformers >= 5 nests one dict per layer type
        rope = RopeConfig.from_hf(params["full_attention"], theta)
        rope_local = RopeConfig.from_hf(params.get("sliding_attention"), 10000.0)
    else:
        rope = RopeConfig.from_hf(params, theta)
        rope_local = RopeConfig(theta=float(cfg.get("rope_local_base_freq", 10000.0)))
    layer_types = tuple(cfg.get("layer_types") or ()) or _layer_types(
        cfg.get("sliding_window_pattern", 6), cfg["num_hidden_layers"]
    )
    return hf_decoder_config(
        "gemma3", cfg, rope=rope, rope_local=rope_local, layer_types=layer_types,
        sliding_window=cfg.get("sliding_window", 4096),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)), qk_norm=True,
        query_pre_attn_scalar=cfg.get("query_pre_attn_scalar", 256),
    )


def _from_gguf(g: GGUFMetadata) -> ModelConfig:
    layers = int(g.meta("block_count"))
    hidden, heads = int(g.meta("embedding_length")), int(g.meta("attention.head_count"))
    return g.decoder(
        default_theta=1_000_000.0, default_window=4096, qk_norm=True,
        hidden_act="gelu_pytorch_tanh",
        # llama.cpp never scales RoPE in the sliding layers; their base is 1e4 by default.
        rope_local=RopeConfig(theta=float(g.meta("rope.freq_base_swa", 10000.0))),
        layer_types=_layer_types(g.meta("attention.sliding_window_pattern", 6), layers),
        # llama.cpp (and HF's configs): 27B (62 layers) scales queries by hidden/heads,
        # every other size by head_dim.
        query_pre_attn_scalar=float(hidden // heads if layers == 62 else g.head_dim()),
    )


def _gguf_fixup(key: str, weight: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    # llama.cpp stores Gemma's `x * (1 + w)` norm weight as 1 + w.
    return weight - 1.0 if key.endswith("norm") else weight


# Gemma 3 has four norms per layer; llama.cpp's `ffn_norm` is its pre-feed-forward one.
_GGUF_LAYER = {
    **GGUF_DECODER_LAYER,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}

ENTRY = ArchitectureEntry(
    name="gemma3", model_types=("gemma3_text", "gemma3"), model=Gemma3ForCausalLM,
    from_hf=_from_hf, from_gguf=_from_gguf,
    gguf_tensors=GGUFTensorMap(GGUF_DECODER_TOP, _GGUF_LAYER), gguf_fixup=_gguf_fixup,
)
