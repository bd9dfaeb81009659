"""GGUF metadata -> ModelConfig, with the derivations transformers' GGUF loader makes."""

from __future__ import annotations

from typing import Any

import torch
from gguf import GGUFReader
from gguf.gguf_reader import ReaderTensor

from infer.config import SUPPORTED_ARCHITECTURES, ConfigError, ModelConfig, RopeConfig
from infer.loader.errors import ModelLoadError
from infer.loader.gguf_file import MISSING, dequantize_tensor, read_field, source_of
from infer.models.layers import rope_inv_freq


def gguf_config(reader: GGUFReader) -> ModelConfig:
    """ModelConfig from GGUF metadata, with the same derivations as transformers' GGUF
    loader (Gemma 3 layer pattern, tied embeddings = no `output.weight`)."""
    try:
        return _gguf_config(reader)
    except ModelLoadError:
        raise
    except ConfigError as exc:
        raise ModelLoadError(f"{source_of(reader)}: {exc}") from None
    except (TypeError, ValueError, ZeroDivisionError) as exc:  # a field of the wrong kind
        raise ModelLoadError(f"{source_of(reader)}: invalid GGUF metadata ({exc})") from None


def _gguf_config(reader: GGUFReader) -> ModelConfig:
    src = source_of(reader)
    arch = read_field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"{src}: unsupported architecture {arch!r} (supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise ModelLoadError(f"{src}: no token_embd.weight tensor")

    def meta(key: str, default: Any = MISSING) -> Any:
        return read_field(reader, f"{arch}.{key}", default)

    hidden = int(meta("embedding_length"))
    heads = int(meta("attention.head_count"))
    kv_heads = meta("attention.head_count_kv", heads)
    if isinstance(kv_heads, list):  # per-layer counts; only uniform ones are supported
        if len(set(kv_heads)) != 1:
            raise ModelLoadError(f"{src}: per-layer KV head counts {kv_heads} are not supported")
        kv_heads = kv_heads[0]
    common = dict(
        architecture=arch,
        vocab_size=int(tensors["token_embd.weight"].shape[1]),  # ne = [hidden, vocab]
        hidden_size=hidden,
        num_layers=int(meta("block_count")),
        num_heads=heads,
        max_position_embeddings=int(meta("context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensors,
        bos_token_id=read_field(reader, "tokenizer.ggml.bos_token_id", None),
        eos_token_ids=tuple(dict.fromkeys(
            int(v) for key in ("eos_token_id", "eot_token_id", "eom_token_id")
            if (v := read_field(reader, f"tokenizer.ggml.{key}", None)) is not None
        )),
    )
    if arch == "gpt2":
        return ModelConfig(
            **common,
            intermediate_size=int(meta("feed_forward_length", 4 * hidden)),
            num_kv_heads=heads,
            head_dim=hidden // heads,
            norm_eps=float(meta("attention.layer_norm_epsilon", 1e-5)),
            attention_bias=True,
            mlp_bias=True,
            hidden_act="gelu_new",
        )
    head_dim = int(meta("attention.key_length", 0) or meta("rope.dimension_count", 0)
                   or hidden // heads)
    rotary = meta("rope.dimension_count", head_dim)
    if rotary != head_dim:
        raise ModelLoadError(
            f"{src}: rope.dimension_count {rotary} differs from head_dim {head_dim} (partial "
            "rotary embeddings are not supported)"
        )
    gemma = arch == "gemma3"
    theta = float(meta("rope.freq_base", 1_000_000.0 if gemma else 10000.0))
    rope = _rope(reader, arch, theta, head_dim, tensors)
    extra: dict[str, Any] = {}
    window = meta("attention.sliding_window", None)
    if gemma:
        layers = common["num_layers"]
        extra = dict(
            # llama.cpp never scales RoPE in the sliding layers; their base is 1e4 by default.
            rope_local=RopeConfig(theta=float(meta("rope.freq_base_swa", 10000.0))),
            layer_types=_gemma3_layer_types(meta("attention.sliding_window_pattern", 6),
                                            layers),
            # llama.cpp (and HF's configs): 27B (62 layers) scales queries by
            # hidden/heads, every other size by head_dim.
            query_pre_attn_scalar=float(hidden // heads if layers == 62 else head_dim),
            hidden_act="gelu_pytorch_tanh",
        )
        window = 4096 if window is None else window
    return ModelConfig(
        **common,
        intermediate_size=int(meta("feed_forward_length")),
        num_kv_heads=int(kv_heads),
        head_dim=head_dim,
        norm_eps=float(meta("attention.layer_norm_rms_epsilon", 1e-6)),
        rope=rope,
        attention_bias="blk.0.attn_q.bias" in tensors,
        mlp_bias="blk.0.ffn_up.bias" in tensors,
        qk_norm=arch in ("qwen3", "gemma3"),
        sliding_window=None if window is None else int(window),
        **extra,
    )


def _gemma3_layer_types(pattern: int | list[bool], num_layers: int) -> tuple[str, ...]:
    if isinstance(pattern, list):  # one flag per layer, true = sliding window
        if len(pattern) != num_layers:
            raise ConfigError(f"sliding_window_pattern has {len(pattern)} entries")
        return tuple("sliding_attention" if s else "full_attention" for s in pattern)
    # Every `pattern`-th layer is global (transformers' and llama.cpp's rule for Gemma 3).
    return tuple(
        "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
        for i in range(num_layers)
    )


def _rope(
    reader: GGUFReader, arch: str, theta: float, head_dim: int, tensors: dict[str, ReaderTensor]
) -> RopeConfig:
    kind = read_field(reader, f"{arch}.rope.scaling.type", "none")
    factor = float(read_field(reader, f"{arch}.rope.scaling.factor", 0.0)
                   or read_field(reader, f"{arch}.rope.scale_linear", 1.0))
    if "rope_freqs.weight" in tensors:
        return _llama3_rope(reader, theta, head_dim, tensors["rope_freqs.weight"])
    if kind == "linear" or (kind == "none" and factor != 1.0):
        return RopeConfig(theta=theta, kind="linear", factor=factor)
    if kind == "none":
        return RopeConfig(theta=theta)
    raise ConfigError(f"unsupported rope scaling type {kind!r} (supported: none, linear, llama3)")


def _llama3_rope(
    reader: GGUFReader, theta: float, head_dim: int, tensor: ReaderTensor
) -> RopeConfig:
    """llama.cpp stores Llama 3.1+ RoPE scaling as per-frequency divisors (`rope_freqs`),
    not as parameters; recover the parameters and check they reproduce every divisor."""
    divisors = dequantize_tensor(tensor, source_of(reader)).double()
    factor = float(divisors.max())
    plain = rope_inv_freq(RopeConfig(theta=theta), head_dim)
    for low, high, original in ((1.0, 4.0, 8192),):  # every Llama 3.1/3.2/3.3 release
        rope = RopeConfig(theta=theta, kind="llama3", factor=factor, low_freq_factor=low,
                          high_freq_factor=high, original_max_position_embeddings=original)
        implied = plain / rope_inv_freq(rope, head_dim)
        if implied.shape == divisors.shape and torch.allclose(implied, divisors, rtol=1e-4):
            return rope
    raise ConfigError("rope_freqs.weight does not match Llama 3 RoPE scaling")
