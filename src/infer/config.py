"""Model configuration: a frozen dataclass parsed from HF `config.json` or GGUF metadata.

Which architectures exist, and how each maps its config, is the models' registry
(`infer.models`); this module only holds the dataclasses and the config.json parsing that
several architectures share, and imports neither torch nor the models.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


class ConfigError(ValueError):
    """A model config that infer cannot serve (unknown architecture, inconsistent sizes)."""


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    kind: str = "default"  # default | linear | llama3
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    @staticmethod
    def from_hf(params: dict[str, Any] | None, default_theta: float) -> RopeConfig:
        if not params:
            return RopeConfig(theta=default_theta)
        kind = params.get("rope_type", params.get("type", "default"))
        if kind not in ("default", "linear", "llama3"):
            raise ConfigError(
                f"unsupported rope scaling type {kind!r} (supported: default, linear, llama3)"
            )
        return RopeConfig(
            theta=float(params.get("rope_theta", default_theta)),
            kind=kind,
            factor=float(params.get("factor", 1.0)),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(
                params.get("original_max_position_embeddings", 8192)
            ),
        )


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    norm_eps: float = 1e-6
    rope: RopeConfig = field(default_factory=RopeConfig)
    # Gemma 3's sliding-window layers use their own RoPE base.
    rope_local: RopeConfig | None = None
    tie_word_embeddings: bool = False
    # Bias on the q/k/v projections, and on the attention output projection (Qwen2 has the
    # first only).
    attention_bias: bool = False
    attention_out_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    hidden_act: str = "silu"
    sliding_window: int | None = None
    # One entry per layer: "full_attention" or "sliding_attention".
    layer_types: tuple[str, ...] = ()
    query_pre_attn_scalar: float | None = None
    final_logit_softcapping: float | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})"
            )
        if not self.layer_types:
            kind = "sliding_attention" if self.sliding_window else "full_attention"
            object.__setattr__(self, "layer_types", (kind,) * self.num_layers)
        if len(self.layer_types) != self.num_layers:
            raise ConfigError(
                f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers"
            )

    def layer_window(self, layer: int) -> int | None:
        """Sliding window (in tokens, the query included) of one layer, or None for full."""
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, (list, tuple)) else (int(value),)


def hf_decoder_config(architecture: str, cfg: dict[str, Any], **fields: Any) -> ModelConfig:
    """ModelConfig from the `config.json` keys that Llama-style decoders share, with
    transformers' defaults; `fields` overrides any of them (an architecture's own keys)."""
    heads = cfg["num_attention_heads"]
    hidden = cfg["hidden_size"]
    window = cfg.get("sliding_window")
    attention_bias = bool(cfg.get("attention_bias", False))
    standard: dict[str, Any] = dict(
        architecture=architecture,
        vocab_size=cfg["vocab_size"],
        hidden_size=hidden,
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or hidden // heads,
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=attention_bias,
        attention_out_bias=attention_bias,
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        hidden_act=cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu",
        # Without a window, per-layer kinds are meaningless (all layers attend fully).
        sliding_window=window,
        layer_types=tuple(cfg.get("layer_types") or ()) if window is not None else (),
        final_logit_softcapping=cfg.get("final_logit_softcapping"),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos_ids(cfg.get("eos_token_id")),
    )
    if "rope" not in fields:
        standard["rope"] = RopeConfig.from_hf(
            cfg.get("rope_parameters") or cfg.get("rope_scaling"),
            float(cfg.get("rope_theta", 10000.0)),
        )
    return ModelConfig(**{**standard, **fields})
