"""GPT-2: learned absolute positions, pre-LayerNorm blocks, GELU MLP, biases everywhere.

Built from the shared pieces: the shared self-attention without RoPE or q/k norm (HF's
already fused `c_attn` is split into the q/k/v shards as it loads), learned positions in
`DecoderModel`. The layers keep HF's module names (`ln_1`, `attn`, `ln_2`, `mlp.c_fc`,
`mlp.c_proj`); `checkpoint_name` renames the rest. HF stores its `Conv1D` weights as
`[in, out]`: they are transposed once at load time and the runtime uses ordinary linear
layers (`[out, in]`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from infer.attention import AttentionMetadata
from infer.config import ConfigError, ModelConfig, eos_ids
from infer.models.causal_lm import CausalLM, DecoderModel
from infer.models.layers import activation
from infer.models.linear import ColumnParallelLinear, RowParallelLinear
from infer.models.registry import ArchitectureEntry, GGUFTensorMap
from infer.models.self_attention import SelfAttention

if TYPE_CHECKING:
    from infer.loader.gguf_metadata import GGUFMetadata

# HF Conv1D weights, stored `[in, out]` (the transpose of a linear layer's layout).
CONV1D_WEIGHTS = (".c_attn.weight", ".c_proj.weight", ".c_fc.weight")
# Causal-mask buffers that old checkpoints saved next to the parameters.
MASK_BUFFERS = (".attn.bias", ".attn.masked_bias")
# HF name part -> ours, applied in order.
_RENAMES = (
    ("transformer.wte.", "model.embed_tokens."),
    ("transformer.wpe.", "model.embed_positions."),
    ("transformer.h.", "model.layers."),
    ("transformer.ln_f.", "model.norm."),
    (".attn.c_attn.", ".attn.qkv_proj."),
    (".attn.c_proj.", ".attn.o_proj."),
)


class GPT2MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.c_fc = ColumnParallelLinear(cfg.hidden_size, cfg.intermediate_size, bias=True)
        self.c_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, bias=True)
        self.act = activation(cfg.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


class GPT2Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.attn = SelfAttention(cfg, layer, rotary=None)
        self.ln_2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.mlp = GPT2MLP(cfg)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, residual: None, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, None]:
        """LayerNorm has no fused residual add, so the stream stays whole in `x`."""
        x = x + self.attn(positions, self.ln_1(x), meta)
        return x + self.mlp(self.ln_2(x)), None


class GPT2LMHeadModel(CausalLM):
    def __init__(self, cfg: ModelConfig) -> None:
        _check_config(cfg)
        layers = [GPT2Block(cfg, i) for i in range(cfg.num_layers)]
        norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
        super().__init__(cfg, DecoderModel(cfg, layers, norm, learned_positions=True))

    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], source: str = "checkpoint"
    ) -> None:
        """HF-named tensors in HF's layout (Conv1D weights `[in, out]`)."""
        super().load_weights(_linear_layout(weights), source)

    def checkpoint_name(self, name: str) -> str | None:
        """With or without the `transformer.` prefix (the original OpenAI checkpoints lack
        it)."""
        if name.endswith(MASK_BUFFERS):
            return None
        if name.startswith("lm_head."):
            return None if self.config.tie_word_embeddings else name
        name = name if name.startswith("transformer.") else "transformer." + name
        for hf, ours in _RENAMES:
            name = name.replace(hf, ours)
        return name


def _linear_layout(
    weights: Iterable[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """Transpose Conv1D weights `[in, out]` to the linear layers' `[out, in]` (a view; the
    copy into the parameter makes it contiguous)."""
    for name, tensor in weights:
        yield name, (tensor.t() if name.endswith(CONV1D_WEIGHTS) else tensor)


def _check_config(cfg: ModelConfig) -> None:
    if cfg.num_kv_heads != cfg.num_heads or cfg.q_size != cfg.hidden_size:
        raise ConfigError(
            "GPT-2 needs num_kv_heads == num_heads and num_heads * head_dim == hidden_size, got "
            f"{cfg.num_kv_heads}, {cfg.num_heads}, {cfg.head_dim}, {cfg.hidden_size}"
        )


# ---------------------------------------------------------------- configs and GGUF


def _from_hf(cfg: dict[str, Any]) -> ModelConfig:
    hidden = cfg["n_embd"]
    heads = cfg["n_head"]
    if heads <= 0 or hidden % heads:
        raise ConfigError(f"n_embd ({hidden}) must be a multiple of n_head ({heads})")
    # reorder_and_upcast_attn needs nothing: attention scores are always computed in float32.
    unsupported = [
        flag for flag, bad in (
            ("scale_attn_weights=false", not cfg.get("scale_attn_weights", True)),
            ("scale_attn_by_inverse_layer_idx=true", cfg.get("scale_attn_by_inverse_layer_idx")),
            ("add_cross_attention=true", cfg.get("add_cross_attention")),
        ) if bad
    ]
    if unsupported:
        raise ConfigError(f"unsupported GPT-2 options: {', '.join(unsupported)}")
    return ModelConfig(
        architecture="gpt2",
        vocab_size=cfg["vocab_size"],
        hidden_size=hidden,
        intermediate_size=cfg.get("n_inner") or 4 * hidden,
        num_layers=cfg["n_layer"],
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=hidden // heads,
        max_position_embeddings=cfg.get("n_positions", 1024),
        norm_eps=float(cfg.get("layer_norm_epsilon", 1e-5)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        attention_bias=True,
        attention_out_bias=True,
        mlp_bias=True,
        hidden_act=cfg.get("activation_function", "gelu_new"),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos_ids(cfg.get("eos_token_id")),
    )


def _from_gguf(g: GGUFMetadata) -> ModelConfig:
    common = g.common()
    hidden, heads = common["hidden_size"], common["num_heads"]
    return ModelConfig(**{
        **common,
        "num_kv_heads": heads,
        "intermediate_size": int(g.meta("feed_forward_length", 4 * hidden)),
        "head_dim": hidden // heads,
        "norm_eps": float(g.meta("attention.layer_norm_epsilon", 1e-5)),
        "attention_bias": True,
        "attention_out_bias": True,
        "mlp_bias": True,
        "hidden_act": "gelu_new",
    })


# llama.cpp's GPT-2 stores these as [out, in]; HF's Conv1D (which the loader expects) is
# [in, out].
_GGUF_CONV1D = ("attn_qkv", "attn_output", "ffn_up", "ffn_down")


def _gguf_fixup(key: str, weight: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    return weight.t() if key in _GGUF_CONV1D and weight.dim() == 2 else weight


_GGUF_TENSORS = GGUFTensorMap(
    top={"token_embd": "transformer.wte", "position_embd": "transformer.wpe",
         "output_norm": "transformer.ln_f", "output": "lm_head"},
    layer={"attn_norm": "ln_1", "attn_qkv": "attn.c_attn", "attn_output": "attn.c_proj",
           "ffn_norm": "ln_2", "ffn_up": "mlp.c_fc", "ffn_down": "mlp.c_proj"},
    layer_prefix="transformer.h",
)

ENTRY = ArchitectureEntry(
    name="gpt2", model_types=("gpt2",), model=GPT2LMHeadModel, from_hf=_from_hf,
    from_gguf=_from_gguf, gguf_tensors=_GGUF_TENSORS, gguf_fixup=_gguf_fixup,
)
