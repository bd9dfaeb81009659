"""A GGUF file's header, metadata and tensor table, read straight from its memory map.

`gguf.GGUFReader` makes a numpy view for every metadata value, every string of a
tokenizer's vocabulary and merges included: ~4 s and ~150 MB for SmolLM2's 49k tokens,
paid at every start. Here the metadata become plain Python values (struct over the map)
and each tensor one numpy view of the map, as the package lays them out (a float type as
its dtype, in the file's reversed dimension order; a quantized type as bytes, one row of
blocks per row). The gguf package stays the reference (tests/test_gguf_reader.py) and
does the dequantizing.

Layout (GGUF v2/v3, little-endian): magic "GGUF", version u32, tensor count u64, metadata
count u64; the metadata (key string, value type u32, value); per tensor its name, number
of dimensions u32, dimensions u64 each (ne[0] first), type u32 and offset u64 into the data
section, which starts at the next multiple of `general.alignment` (default 32).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType
from gguf.constants import GGML_QUANT_SIZES

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
            12: "d"}
_STRING, _ARRAY = 8, 9
_FLOAT_DTYPES = {
    GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


class GGUFFormatError(ValueError):
    """The bytes are not a GGUF file we can read (the caller names the file)."""


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: np.ndarray  # uint64 dimensions as stored: ne[0] (the contiguous one) first
    n_elements: int
    n_bytes: int
    data_offset: int  # from the start of the file
    data: np.ndarray  # read-only view of the map


class GGUFFile:
    """An open GGUF file: `fields` (key -> value; arrays as lists) and `tensors`."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        with open(self.path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        buf = self._map
        tensor_count, kv_count = _header(buf)
        try:
            self.fields, pos = read_fields(buf, 24, kv_count)
            infos, pos = _read_tensor_infos(buf, pos, tensor_count)
        except (struct.error, UnicodeDecodeError, ValueError, OverflowError) as exc:
            raise GGUFFormatError(f"metadata unreadable (truncated or corrupt?): {exc}") from None
        alignment = self.fields.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise GGUFFormatError(f"general.alignment {alignment!r} is not a power of two")
        self.data_offset = -(-pos // alignment) * alignment
        whole = np.frombuffer(buf, dtype=np.uint8)
        self.tensors = [self._tensor(whole, *info) for info in infos]

    def _tensor(self, whole: np.ndarray, name: str, dims: tuple[int, ...], raw_type: int,
                offset: int) -> GGUFTensor:
        try:
            qtype = GGMLQuantizationType(raw_type)
        except ValueError:
            raise GGUFFormatError(f"tensor {name!r} has unknown type {raw_type}") from None
        n_elements = int(np.prod(dims, dtype=np.int64))
        block, type_size = GGML_QUANT_SIZES[qtype]
        n_bytes = n_elements * type_size // block
        start = self.data_offset + offset
        if start + n_bytes > whole.size:
            raise GGUFFormatError(f"tensor {name!r} runs past the end of the file "
                                  "(truncated?)")
        raw = whole[start:start + n_bytes]
        np_dims = tuple(reversed(dims))
        if qtype in _FLOAT_DTYPES:
            data = raw.view(_FLOAT_DTYPES[qtype]).reshape(np_dims)
        else:  # bytes, one row of blocks per row (bf16 too: numpy has no bfloat16)
            if np_dims[-1] % block:
                raise GGUFFormatError(f"tensor {name!r}: rows of {np_dims[-1]} values are not "
                                      f"whole {qtype.name} blocks of {block}")
            data = raw.reshape(*np_dims[:-1], np_dims[-1] // block * type_size)
        return GGUFTensor(name, qtype, np.array(dims, dtype=np.uint64), n_elements, n_bytes,
                          start, data)


def read_metadata(path: str | Path) -> dict[str, Any]:
    """Only the metadata (the tokenizer's side: no tensor table needed)."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        _, count = _header(buf)
        try:
            return read_fields(buf, 24, count)[0]
        except (struct.error, UnicodeDecodeError, ValueError, OverflowError) as exc:
            raise GGUFFormatError(f"metadata unreadable (truncated or corrupt?): {exc}") from None


def _header(buf: mmap.mmap) -> tuple[int, int]:
    """(tensor count, metadata count) after checking the magic and the version."""
    if len(buf) < 24 or buf[:4] != MAGIC:
        raise GGUFFormatError("not a GGUF file (bad magic bytes)")
    version, tensor_count, kv_count = struct.unpack_from("<IQQ", buf, 4)
    if version not in VERSIONS:
        raise GGUFFormatError(f"GGUF version {version} is not supported (2, 3)")
    return tensor_count, kv_count


def read_fields(buf: mmap.mmap, pos: int, count: int) -> tuple[dict[str, Any], int]:
    fields = {}
    for _ in range(count):
        key, pos = _read_string(buf, pos)
        (kind,) = struct.unpack_from("<I", buf, pos)
        fields[key], pos = _read_value(buf, pos + 4, kind)
    return fields, pos


def _read_tensor_infos(buf: mmap.mmap, pos: int, count: int
                       ) -> tuple[list[tuple[str, tuple[int, ...], int, int]], int]:
    infos, names = [], set()
    for _ in range(count):
        name, pos = _read_string(buf, pos)
        if name in names:
            raise ValueError(f"tensor {name!r} appears twice")
        names.add(name)
        (n_dims,) = struct.unpack_from("<I", buf, pos)
        if n_dims > 8:
            raise ValueError(f"tensor {name!r} has {n_dims} dimensions")
        dims = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
        raw_type, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * n_dims)
        pos += 4 + 8 * n_dims + 12
        infos.append((name, dims, raw_type, offset))
    return infos, pos


def _read_string(buf: mmap.mmap, pos: int) -> tuple[str, int]:
    (length,) = struct.unpack_from("<Q", buf, pos)
    end = pos + 8 + length
    if end > len(buf):
        raise ValueError("a string runs past the end of the file")
    return buf[pos + 8:end].decode("utf-8"), end


def _read_value(buf: mmap.mmap, pos: int, kind: int) -> tuple[Any, int]:
    if kind in _SCALARS:
        fmt = "<" + _SCALARS[kind]
        return struct.unpack_from(fmt, buf, pos)[0], pos + struct.calcsize(fmt)
    if kind == _STRING:
        return _read_string(buf, pos)
    if kind == _ARRAY:
        item_kind, count = struct.unpack_from("<IQ", buf, pos)
        pos += 12
        if item_kind in _SCALARS:
            fmt = f"<{count}{_SCALARS[item_kind]}"
            return list(struct.unpack_from(fmt, buf, pos)), pos + struct.calcsize(fmt)
        values = []
        for _ in range(count):
            value, pos = _read_value(buf, pos, item_kind)
            values.append(value)
        return values, pos
    raise ValueError(f"unknown metadata value type {kind}")
