"""Our GGUF reader (`infer.loader.gguf_reader`) against the gguf package's `GGUFReader`, the
reference: the same metadata values and the same tensors (names, types, dimensions, sizes,
offsets, and the data views byte for byte, in the same dtype and shape) for a file the
gguf package writes with every value type, several tensor types and a custom alignment,
and for the real SmolLM2 file; and broken files refused by name."""

from __future__ import annotations

import struct
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.constants import GGML_QUANT_SIZES
from reference_tokenizers import gguf_path

from infer.loader.errors import ModelLoadError
from infer.loader.gguf_file import open_gguf
from infer.loader.gguf_reader import GGUFFile


def assert_same_as_gguf_package(path: Path) -> None:
    ours, ref = GGUFFile(path), gguf.GGUFReader(path)
    keys = [k for k in ref.fields if not k.startswith("GGUF.")]  # its header pseudo-fields
    assert list(ours.fields) == keys
    for key in keys:
        assert ours.fields[key] == ref.fields[key].contents(), key
    assert ours.data_offset == ref.data_offset
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for a, b in zip(ours.tensors, ref.tensors):
        assert (a.tensor_type, a.n_elements, a.n_bytes, a.data_offset) == \
            (b.tensor_type, b.n_elements, b.n_bytes, b.data_offset), a.name
        assert a.shape.tolist() == b.shape.tolist() and a.shape.dtype == b.shape.dtype, a.name
        assert (a.data.dtype, a.data.shape) == (b.data.dtype, b.data.shape), a.name
        assert np.array_equal(a.data, b.data), a.name


def write_file(path: Path, alignment: int | None = 64, pad: int = 0) -> None:
    """`pad` characters more of metadata move where the data section must start."""
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(path, "llama")
    if alignment is not None:
        w.add_custom_alignment(alignment)
    w.add_string("t.pad", "x" * pad)
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -5)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_float32("t.f32", 0.1)
    w.add_bool("t.bool", True)
    w.add_uint64("t.u64", 2**63 + 5)
    w.add_int64("t.i64", -(2**62))
    w.add_float64("t.f64", 1 / 3)
    w.add_string("t.str", "héllo ✓")
    w.add_array("t.strs", ["a", "", "ünï", "<|im_end|>"])
    w.add_array("t.ints", [1, -2, 3])
    w.add_array("t.floats", [0.5, -1.25])
    w.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((4, 7)).astype(np.float16))
    w.add_tensor("i32", np.arange(6, dtype=np.int32))
    w.add_tensor("three_d", rng.standard_normal((2, 3, 4)).astype(np.float32))
    for qtype, rows, cols in ((Q.Q8_0, 3, 64), (Q.Q4_K, 2, 512), (Q.Q6_K, 5, 256),
                              (Q.Q4_1, 4, 32), (Q.BF16, 3, 8)):
        block, size = GGML_QUANT_SIZES[qtype]
        raw = rng.integers(0, 256, (rows, cols // block * size), dtype=np.uint8)
        w.add_tensor(qtype.name.lower(), raw, raw_dtype=qtype)  # shape: bytes per row
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("alignment", [None, 64])
@pytest.mark.parametrize("pad", [0, 8, 16, 24])  # the header's end at every residue mod 32
def test_a_written_file_reads_as_the_gguf_package_reads_it(tmp_path, alignment, pad):
    path = tmp_path / "all.gguf"
    write_file(path, alignment, pad)
    assert_same_as_gguf_package(path)
    f = GGUFFile(path)
    assert f.data_offset % (alignment or 32) == 0
    assert f.fields["t.str"] == "héllo ✓" and f.fields["t.u64"] == 2**63 + 5
    assert f.fields["t.strs"][2] == "ünï" and f.fields["t.ints"] == [1, -2, 3]


def test_the_real_smollm2_file_reads_as_the_gguf_package_reads_it():
    assert_same_as_gguf_package(gguf_path("smollm2"))


def _broken(tmp_path: Path, data: bytes, match: str) -> None:
    path = tmp_path / "broken.gguf"
    path.write_bytes(data)
    with pytest.raises(ModelLoadError, match=r"broken\.gguf: not a valid GGUF file: .*" + match):
        open_gguf(path)


def test_broken_files_are_refused_by_name(tmp_path):
    path = tmp_path / "good.gguf"
    write_file(path)
    good = path.read_bytes()
    f = GGUFFile(path)
    _broken(tmp_path, b"", "")
    _broken(tmp_path, b"GGML" + good[4:], "bad magic")
    _broken(tmp_path, good[:4] + struct.pack("<I", 1) + good[8:], "version 1")
    _broken(tmp_path, good[:200], "truncated or corrupt")  # inside the metadata
    _broken(tmp_path, good[:f.data_offset + 10], "runs past the end")  # inside the data
    odd = tmp_path / "odd.gguf"
    w = gguf.GGUFWriter(odd, "llama")
    w.add_uint32("general.alignment", 48)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError, match="alignment 48 is not a power of two"):
        open_gguf(odd)
