"""GGUF files (llama.cpp): open, read metadata fields, yield dequantised HF-named tensors.

The file is memory-mapped by `gguf.GGUFReader`; each tensor is dequantised with the `gguf`
package only when the iterator reaches it, so peak memory is the model plus one tensor.
`gguf_metadata.gguf_config` turns the metadata into a ModelConfig.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.constants import GGML_QUANT_SIZES
from gguf.gguf_reader import ReaderTensor
from gguf.quants import dequantize

from infer.config import ModelConfig
from infer.loader.errors import ModelLoadError

MISSING = object()


def open_gguf(path: str | Path) -> GGUFReader:
    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"{path}: file not found")
    try:
        return GGUFReader(path)
    except Exception as exc:  # the reader fails in numpy/struct code on damaged input
        raise ModelLoadError(
            f"{path}: not a valid GGUF file (truncated or corrupt?): {type(exc).__name__}: {exc}"
        ) from None


def source_of(reader: GGUFReader) -> str:
    return str(getattr(reader.data, "filename", None) or "GGUF file")


def read_field(reader: GGUFReader, key: str, default: Any = MISSING) -> Any:
    field = reader.fields.get(key)
    if field is None:
        if default is MISSING:
            raise ModelLoadError(f"{source_of(reader)}: GGUF metadata lacks {key!r}")
        return default
    return field.contents()


# GGUF block tensor -> HF module, for the Llama-style decoders (`blk.N.<key>`).
_DECODER_LAYER = {
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
# Gemma 3 has four norms per layer; llama.cpp's `ffn_norm` is its pre-feed-forward one.
_GEMMA3_LAYER = {
    **_DECODER_LAYER,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_GPT2_LAYER = {
    "attn_norm": "ln_1",
    "attn_qkv": "attn.c_attn",
    "attn_output": "attn.c_proj",
    "ffn_norm": "ln_2",
    "ffn_up": "mlp.c_fc",
    "ffn_down": "mlp.c_proj",
}
_DECODER_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                "output": "lm_head"}
_GPT2_TOP = {"token_embd": "transformer.wte", "position_embd": "transformer.wpe",
             "output_norm": "transformer.ln_f", "output": "lm_head"}
# llama.cpp's GPT-2 stores these as [out, in]; HF's Conv1D (which our GPT-2 loads) is [in, out].
_GPT2_CONV1D = ("attn_qkv", "attn_output", "ffn_up", "ffn_down")


def hf_name(gguf_name: str, arch: str) -> tuple[str, str] | None:
    """(HF tensor name, GGUF module key) for a GGUF tensor name, or None if unknown."""
    module, _, suffix = gguf_name.rpartition(".")
    if suffix not in ("weight", "bias"):
        return None
    top, layer = (_GPT2_TOP, _GPT2_LAYER) if arch == "gpt2" else (_DECODER_TOP, _DECODER_LAYER)
    if arch == "gemma3":
        layer = _GEMMA3_LAYER
    if module in top:
        return f"{top[module]}.{suffix}", module
    parts = module.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in layer:
        prefix = "transformer.h" if arch == "gpt2" else "model.layers"
        return f"{prefix}.{parts[1]}.{layer[parts[2]]}.{suffix}", parts[2]
    return None


def iter_gguf_weights(reader: GGUFReader, cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(hf_name, float32 tensor)` in HF's layout, one tensor at a time."""
    src, arch = source_of(reader), cfg.architecture
    for tensor in reader.tensors:
        if tensor.name == "rope_freqs.weight":  # already folded into cfg.rope
            continue
        mapped = hf_name(tensor.name, arch)
        if mapped is None:
            raise ModelLoadError(f"{src}: unexpected tensor {tensor.name!r} for {arch}")
        name, key = mapped
        weight = dequantize_tensor(tensor, src)
        if arch == "llama" and key in ("attn_q", "attn_k"):
            weight = _unpermute_qk(weight, cfg.num_heads if key == "attn_q" else cfg.num_kv_heads)
        elif arch == "gemma3" and key.endswith("norm"):
            weight = weight - 1.0  # llama.cpp stores Gemma's `x * (1 + w)` weight as 1 + w
        elif arch == "gpt2" and key in _GPT2_CONV1D and weight.dim() == 2:
            weight = weight.t()
        yield name, weight


def _unpermute_qk(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation. HF rotates the two halves of each head
    (pairs (i, i + d/2)); GGML's RoPE rotates adjacent rows (2i, 2i + 1), so the converter
    stores each head's rows as (d/2, 2) -> interleaved. Reading them back as (2, d/2)
    restores HF's order. Works for weights `[heads*d, in]` and biases `[heads*d]`."""
    rows = weight.shape[0]
    per_head = rows // heads
    return (weight.reshape(heads, per_head // 2, 2, *weight.shape[1:])
            .transpose(1, 2).reshape(weight.shape))


def dequantize_tensor(tensor: ReaderTensor, src: str) -> torch.Tensor:
    qtype = GGMLQuantizationType(tensor.tensor_type)
    shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))  # GGUF lists ne[0] first
    try:
        values = dequantize(tensor.data, qtype)
        values = np.asarray(values, dtype=np.float32).reshape(shape)
    except NotImplementedError:
        raise ModelLoadError(
            f"{src}: tensor {tensor.name!r} uses quantization type {qtype.name}, which the gguf "
            "package cannot dequantize"
        ) from None
    except (ValueError, TypeError, IndexError) as exc:
        raise ModelLoadError(
            f"{src}: tensor {tensor.name!r} ({qtype.name}, shape {shape}) is corrupt: {exc}"
        ) from None
    if not values.flags.writeable:  # a read-only view of the memory map (F32 tensors)
        values = values.copy()
    return torch.from_numpy(values)


def check_tensor_types(reader: GGUFReader) -> None:
    """Fail before building the model if a tensor's type cannot be dequantised (probed on
    one zero block, so the answer is the gguf package's own)."""
    src = source_of(reader)
    for qtype in {GGMLQuantizationType(t.tensor_type) for t in reader.tensors}:
        try:
            dequantize(np.zeros((1, GGML_QUANT_SIZES[qtype][1]), dtype=np.uint8), qtype)
        except NotImplementedError:
            names = [t.name for t in reader.tensors if t.tensor_type == qtype]
            raise ModelLoadError(
                f"{src}: unsupported quantization type {qtype.name} (tensors "
                f"{', '.join(names[:3])}{' ...' if len(names) > 3 else ''})"
            ) from None
