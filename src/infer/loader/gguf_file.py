"""GGUF files (llama.cpp): open, read metadata fields, yield dequantised HF-named tensors.

The file is memory-mapped by our reader (`gguf_reader.py`); each tensor is dequantised with
the `gguf` package only when the iterator reaches it, so peak memory is the model plus one
tensor.
`gguf_metadata.gguf_config` turns the metadata into a ModelConfig.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize

from infer.config import ModelConfig
from infer.loader.errors import ModelLoadError
from infer.loader.gguf_reader import GGUFFile, GGUFFormatError, GGUFTensor
from infer.models import REGISTRY
from infer.quantization.gguf_blocks import GGUFBlocks

MISSING = object()


def open_gguf(path: str | Path) -> GGUFFile:
    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"{path}: file not found")
    try:
        return GGUFFile(path)
    except (GGUFFormatError, OSError, ValueError) as exc:  # ValueError: an empty file
        raise ModelLoadError(f"{path}: not a valid GGUF file: {exc}") from None


def source_of(reader: GGUFFile) -> str:
    return str(reader.path)


def read_field(reader: GGUFFile, key: str, default: Any = MISSING) -> Any:
    if key not in reader.fields:
        if default is MISSING:
            raise ModelLoadError(f"{source_of(reader)}: GGUF metadata lacks {key!r}")
        return default
    return reader.fields[key]


ROPE_FREQS = "rope_freqs.weight"  # already folded into the ModelConfig's rope


def num_weights(reader: GGUFFile) -> int:
    """How many tensors `iter_gguf_weights` yields."""
    return sum(t.name != ROPE_FREQS for t in reader.tensors)


def iter_gguf_weights(reader: GGUFFile, cfg: ModelConfig, device: torch.device | str = "cpu"
                      ) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(hf_name, float32 tensor)` in HF's layout, one tensor at a time: the names
    and the layout fix-ups are the architecture's registry entry's. On CUDA the types our
    Triton kernels decode are dequantized there (the gguf package's numpy code takes about
    a minute for an 8B model's weights)."""
    src, arch = source_of(reader), cfg.architecture
    entry = REGISTRY[arch]
    for tensor in reader.tensors:
        if tensor.name == ROPE_FREQS:
            continue
        mapped = entry.gguf_tensors.hf_name(tensor.name)
        if mapped is None:
            raise ModelLoadError(f"{src}: unexpected tensor {tensor.name!r} for {arch}")
        name, key = mapped
        weight = dequantize_tensor(tensor, src, device)
        if entry.gguf_fixup is not None:
            weight = entry.gguf_fixup(key, weight, cfg)
        yield name, weight


FLOAT_TYPES = (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16)


def quantized_blocks(reader: GGUFFile, cfg: ModelConfig) -> dict[str, GGUFBlocks]:
    """The quantized 2-D weights of the file as stored (views of the memory map, nothing
    dequantized), by HF name, rows in HF order. A weight whose layout fix-up is not a
    permutation of its rows (GPT-2's transposes) is left out: it can only be used
    dequantized."""
    entry = REGISTRY[cfg.architecture]
    out = {}
    for tensor in reader.tensors:
        qtype = GGMLQuantizationType(tensor.tensor_type)
        mapped = entry.gguf_tensors.hf_name(tensor.name)
        if qtype in FLOAT_TYPES or mapped is None or len(tensor.shape) != 2:
            continue
        name, key = mapped
        rows, cols = (int(n) for n in reversed(tensor.shape.tolist()))
        blocks = GGUFBlocks.of(name, qtype, (rows, cols), tensor.data)
        if entry.gguf_fixup is not None:
            index = torch.arange(rows, dtype=torch.float64)[:, None]
            moved = entry.gguf_fixup(key, index, cfg)
            if tuple(moved.shape) != (rows, 1):
                continue
            order = moved[:, 0].long()
            if not torch.equal(order, index[:, 0].long()):
                blocks.row_order = order
        out[name] = blocks
    return out


def dequantize_tensor(tensor: GGUFTensor, src: str, device: torch.device | str = "cpu"
                      ) -> torch.Tensor:
    qtype = GGMLQuantizationType(tensor.tensor_type)
    shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))  # GGUF lists ne[0] first
    if torch.device(device).type == "cuda" and len(shape) == 2:
        from infer.kernels.gguf_matmul import SUPPORTED, gguf_dequantize

        if qtype in SUPPORTED:
            try:
                raw = torch.from_numpy(np.array(tensor.data)).reshape(shape[0], -1)
                return gguf_dequantize(raw.to(device), qtype, shape[1])
            except (RuntimeError, AssertionError) as exc:
                raise ModelLoadError(f"{src}: tensor {tensor.name!r} ({qtype.name}, shape "
                                     f"{shape}) is corrupt: {exc}") from None
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


def check_tensor_types(reader: GGUFFile) -> None:
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
