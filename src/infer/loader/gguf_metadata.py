"""GGUF metadata -> ModelConfig, with the derivations transformers' GGUF loader makes.

The file's `general.architecture` picks the registry entry, whose `from_gguf` hook builds
the config from a `GGUFMetadata`: llama.cpp's keys are the same across architectures
(`<arch>.embedding_length`, ...), so the reading that they share is here.
"""

from __future__ import annotations

from typing import Any

import torch

from infer.config import ConfigError, ModelConfig, RopeConfig
from infer.loader.errors import ModelLoadError
from infer.loader.gguf_file import MISSING, dequantize_tensor, read_field, source_of
from infer.loader.gguf_reader import GGUFFile, GGUFTensor
from infer.models import REGISTRY
from infer.models.layers import rope_inv_freq


def gguf_config(reader: GGUFFile) -> ModelConfig:
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


def _gguf_config(reader: GGUFFile) -> ModelConfig:
    g = GGUFMetadata(reader)
    entry = REGISTRY.get(g.arch)
    if entry is None:
        raise ModelLoadError(
            f"{g.src}: unsupported architecture {g.arch!r} (supported: {', '.join(REGISTRY)})"
        )
    if "token_embd.weight" not in g.tensors:
        raise ModelLoadError(f"{g.src}: no token_embd.weight tensor")
    return entry.from_gguf(g)


class GGUFMetadata:
    """One GGUF file's metadata and tensors, as the architectures' `from_gguf` hooks read
    them."""

    def __init__(self, reader: GGUFFile) -> None:
        self.reader = reader
        self.src = source_of(reader)
        self.arch: str = read_field(reader, "general.architecture")
        self.tensors: dict[str, GGUFTensor] = {t.name: t for t in reader.tensors}

    def meta(self, key: str, default: Any = MISSING) -> Any:
        """The architecture's field `<arch>.<key>`."""
        return read_field(self.reader, f"{self.arch}.{key}", default)

    def common(self) -> dict[str, Any]:
        """The ModelConfig fields every architecture reads alike."""
        hidden = int(self.meta("embedding_length"))
        heads = int(self.meta("attention.head_count"))
        kv_heads = self.meta("attention.head_count_kv", heads)
        if isinstance(kv_heads, list):  # per-layer counts; only uniform ones are supported
            if len(set(kv_heads)) != 1:
                raise ModelLoadError(
                    f"{self.src}: per-layer KV head counts {kv_heads} are not supported"
                )
            kv_heads = kv_heads[0]
        return dict(
            architecture=self.arch,
            vocab_size=int(self.tensors["token_embd.weight"].shape[1]),  # ne = [hidden, vocab]
            hidden_size=hidden,
            num_layers=int(self.meta("block_count")),
            num_heads=heads,
            num_kv_heads=int(kv_heads),
            max_position_embeddings=int(self.meta("context_length", 2048)),
            tie_word_embeddings="output.weight" not in self.tensors,
            bos_token_id=read_field(self.reader, "tokenizer.ggml.bos_token_id", None),
            eos_token_ids=tuple(dict.fromkeys(
                int(v) for key in ("eos_token_id", "eot_token_id", "eom_token_id")
                if (v := read_field(self.reader, f"tokenizer.ggml.{key}", None)) is not None
            )),
        )

    def head_dim(self) -> int:
        hidden = int(self.meta("embedding_length"))
        heads = int(self.meta("attention.head_count"))
        return int(self.meta("attention.key_length", 0) or self.meta("rope.dimension_count", 0)
                   or hidden // heads)

    def decoder(
        self, default_theta: float = 10000.0, default_window: int | None = None, **fields: Any
    ) -> ModelConfig:
        """ModelConfig of a Llama-style decoder (RMSNorm, RoPE, gated MLP) from llama.cpp's
        keys; biases are read off the tensors present; `fields` overrides any field."""
        common = self.common()
        head_dim = self.head_dim()
        rotary = self.meta("rope.dimension_count", head_dim)
        if rotary != head_dim:
            raise ModelLoadError(
                f"{self.src}: rope.dimension_count {rotary} differs from head_dim {head_dim} "
                "(partial rotary embeddings are not supported)"
            )
        theta = float(self.meta("rope.freq_base", default_theta))
        window = self.meta("attention.sliding_window", None)
        window = default_window if window is None else window
        standard = dict(
            **common,
            intermediate_size=int(self.meta("feed_forward_length")),
            head_dim=head_dim,
            norm_eps=float(self.meta("attention.layer_norm_rms_epsilon", 1e-6)),
            rope=_rope(self.reader, self.arch, theta, head_dim, self.tensors),
            attention_bias="blk.0.attn_q.bias" in self.tensors,
            attention_out_bias="blk.0.attn_output.bias" in self.tensors,
            mlp_bias="blk.0.ffn_up.bias" in self.tensors,
            sliding_window=None if window is None else int(window),
        )
        return ModelConfig(**{**standard, **fields})


def _rope(
    reader: GGUFFile, arch: str, theta: float, head_dim: int, tensors: dict[str, GGUFTensor]
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
    reader: GGUFFile, theta: float, head_dim: int, tensor: GGUFTensor
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
