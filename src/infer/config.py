"""Model configuration: a frozen dataclass parsed from HF `config.json` or GGUF metadata."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3", "gpt2")

# HF `model_type` -> our architecture name. Mistral-style configs are Llama with GQA and,
# optionally, a sliding window on every layer.
_MODEL_TYPES = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma3_text": "gemma3",
    "gemma3": "gemma3",
    "gpt2": "gpt2",
}


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
    attention_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    hidden_act: str = "silu"
    sliding_window: int | None = None
    # One entry per layer: "full_attention" or "sliding_attention".
    layer_types: tuple[str, ...] = ()
    query_pre_attn_scalar: float | None = None
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(
                f"unknown architecture {self.architecture!r}; supported: "
                + ", ".join(SUPPORTED_ARCHITECTURES)
            )
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

    @staticmethod
    def from_hf(cfg: dict[str, Any]) -> ModelConfig:
        model_type = cfg.get("model_type")
        if model_type == "gemma3" and "text_config" in cfg:
            cfg = {**cfg["text_config"], "model_type": "gemma3_text"}
            model_type = "gemma3_text"
        arch = _MODEL_TYPES.get(model_type or "")
        if arch is None:
            raise ConfigError(
                f"unsupported model_type {model_type!r}; supported: {', '.join(_MODEL_TYPES)}"
            )
        try:
            if arch == "gpt2":
                return _gpt2_from_hf(cfg)
            return _decoder_from_hf(arch, cfg)
        except KeyError as exc:
            raise ConfigError(f"config.json lacks the field {exc.args[0]!r}") from None


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, (list, tuple)) else (int(value),)


def _decoder_from_hf(arch: str, cfg: dict[str, Any]) -> ModelConfig:
    heads = cfg["num_attention_heads"]
    hidden = cfg["hidden_size"]
    rope_params = cfg.get("rope_parameters") or cfg.get("rope_scaling")
    theta = float(cfg.get("rope_theta", 10000.0))
    rope_local = None
    layer_types = tuple(cfg.get("layer_types") or ())
    sliding_window = cfg.get("sliding_window")
    if arch == "gemma3":
        if cfg.get("use_bidirectional_attention"):
            raise ConfigError("bidirectional Gemma 3 (e.g. EmbeddingGemma) is not supported")
        # transformers' Gemma3TextConfig defaults for keys that a config.json leaves out.
        theta = float(cfg.get("rope_theta", 1_000_000.0))
        sliding_window = cfg.get("sliding_window", 4096)
        params = rope_params or {}
        if "full_attention" in params:  # transformers >= 5 nests one dict per layer type
            rope = RopeConfig.from_hf(params["full_attention"], theta)
            rope_local = RopeConfig.from_hf(params.get("sliding_attention"), 10000.0)
        else:
            rope = RopeConfig.from_hf(params, theta)
            rope_local = RopeConfig(theta=float(cfg.get("rope_local_base_freq", 10000.0)))
        if not layer_types:
            pattern = cfg.get("sliding_window_pattern", 6)
            layer_types = tuple(
                "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                for i in range(cfg["num_hidden_layers"])
            )
    else:
        rope = RopeConfig.from_hf(rope_params, theta)
        if arch in ("qwen2", "qwen3"):
            if not cfg.get("use_sliding_window", False):
                sliding_window = None
            layer_types = ()
            if sliding_window:
                first = cfg.get("max_window_layers", cfg["num_hidden_layers"])
                layer_types = tuple(
                    "sliding_attention" if i >= first else "full_attention"
                    for i in range(cfg["num_hidden_layers"])
                )
        elif sliding_window is None:
            layer_types = ()
    return ModelConfig(
        architecture=arch,
        vocab_size=cfg["vocab_size"],
        hidden_size=hidden,
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or hidden // heads,
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope=rope,
        rope_local=rope_local,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", arch == "gemma3")),
        attention_bias=bool(cfg.get("attention_bias", arch == "qwen2")),
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        qk_norm=arch in ("qwen3", "gemma3"),
        hidden_act=cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu",
        sliding_window=sliding_window,
        layer_types=layer_types,
        query_pre_attn_scalar=cfg.get(
            "query_pre_attn_scalar", 256 if arch == "gemma3" else None
        ),
        final_logit_softcapping=cfg.get("final_logit_softcapping"),
        attn_logit_softcapping=cfg.get("attn_logit_softcapping"),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=_eos_ids(cfg.get("eos_token_id")),
    )


def _gpt2_from_hf(cfg: dict[str, Any]) -> ModelConfig:
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
        mlp_bias=True,
        hidden_act=cfg.get("activation_function", "gelu_new"),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=_eos_ids(cfg.get("eos_token_id")),
    )
