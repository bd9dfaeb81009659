"""The inline PTX that makes FP8 (e4m3) weights floats by their bits (`weight_cast.py`:
float32 times 2^-120 for the GEMV, bfloat16 times 2^-120 for the tensor cores, float16
times 2^-8 for the GEMV's form "halves"), read from the source and run by a small emulator
of the instructions it uses, on every pair of e4m3 bytes in every position of a register,
against torch's own FP8 conversion. A kernel with inline assembly cannot run in Triton's
interpreter; this is the check that can on a CPU (`INFER_TEST_DEVICE=cuda` runs the real
instructions inside the kernels: `tests/test_gemv_kernel.py`, `tests/test_rows_mma.py`)."""

from __future__ import annotations

import inspect
import re

import pytest
import torch

pytest.importorskip("triton")

from infer.kernels import weight_cast

MASK32 = 0xFFFFFFFF


def _prmt(a, b, selector: int):
    """PTX `prmt.b32` (default mode): result byte i is byte `s & 7` of b:a (a's bytes
    0-3, b's 4-7), or with `s & 8` that byte's sign bit copied into all eight bits. Each
    operand a register (an int64 tensor of 32-bit values, or an int)."""
    source = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF
                                                          for i in range(4)]
    out = 0
    for i in range(4):
        s = (selector >> (4 * i)) & 0xF
        byte = source[s & 7]
        if s & 8:
            byte = (byte >> 7) * 0xFF
        out = out | (byte << (8 * i))
    return out


def _lop3(a, b, c, lut: int):
    """PTX `lop3.b32`: bit i is bit `4 a_i + 2 b_i + c_i` of the table (the bits where
    (a_i, b_i, c_i) is each row of the table whose bit is set)."""
    out = 0
    for row in range(8):
        if lut >> row & 1:
            out = out | ((a if row & 4 else ~a) & (b if row & 2 else ~b)
                         & (c if row & 1 else ~c))
    return out & MASK32


OPS = {"prmt": _prmt, "lop3": _lop3, "shl": lambda a, n: (a << n) & MASK32,
       "and": lambda a, b: a & b, "mov": lambda a: a}


def _program(function: str) -> list[tuple[str, str, list[str]]]:
    """`weight_cast.<function>`'s asm as (op, destination, sources), a line each."""
    source = inspect.getsource(weight_cast)  # (a jitted function's own has no source)
    asm = re.search(rf'def {function}\(.*?asm="""(.*?)"""', source, re.DOTALL).group(1)
    lines = []
    for op, text in re.findall(r"(\w+)\.b32 ([^;]+);", asm):
        dest, *sources = [a.strip() for a in text.split(",")]
        lines.append((op, dest, sources))
    assert {op for op, _, _ in lines} <= set(OPS), lines
    return lines


def _run(program: list, inputs: dict):
    """The program on its input registers (int64 tensors: many registers at once): every
    register after it."""
    regs = dict(inputs)

    def value(operand: str):
        return int(operand, 0) if operand[0].isdigit() else regs[operand]

    for op, dest, sources in program:
        regs[dest] = OPS[op](*[value(s) for s in sources])
    return regs


def _values_times(power: int, dtype: torch.dtype) -> torch.Tensor:
    """Each byte's e4m3 value times 2^power in `dtype` as its bits (int64), checked exact."""
    values = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
    values = values.to(torch.float32)
    want = (values * 2.0 ** power).to(dtype)
    finite = ~values.isnan()
    assert torch.equal(want.to(torch.float32)[finite] * 2.0 ** -power, values[finite])
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    mask = MASK32 if dtype == torch.float32 else 0xFFFF
    return want.view(bits).to(torch.int64) & mask


@pytest.mark.parametrize(("function", "dtype", "power", "outputs"), [
    ("_fp8_bits_ptx", torch.float32, -120, 4),  # FP8_TIMES_UNDO
    ("_fp8_to_bf16_ptx", torch.bfloat16, -120, 2),  # BF16_FP8_UNDO
    ("to_f16_times", torch.float16, -8, 2),  # F16_FP8_UNDO
])
def test_fp8_bytes_made_floats_by_their_bits_are_their_values_times_a_power_of_two(
        function, dtype, power, outputs):
    """Every pair of bytes (lo, hi) in a register (lo, hi, hi, lo): the outputs in order
    (four float32 registers, or two of two 16-bit halves) are the bytes' values times the
    function's power of two, exactly (subnormal bytes too)."""
    undo = {-120: (weight_cast.FP8_TIMES_UNDO, weight_cast.BF16_FP8_UNDO),
            -8: (weight_cast.F16_FP8_UNDO,)}[power]
    assert all(u.value == 2.0 ** -power for u in undo)
    program = _program(function)
    want = _values_times(power, dtype)
    lo, hi = (t.flatten() for t in torch.meshgrid(torch.arange(256), torch.arange(256),
                                                   indexing="ij"))
    register = f"${outputs}"  # the input follows the outputs
    regs = _run(program, {register: lo | hi << 8 | hi << 16 | lo << 24})
    out = [regs[f"${i}"] for i in range(outputs)]
    got = out if outputs == 4 else [out[0] & 0xFFFF, out[0] >> 16, out[1] & 0xFFFF,
                                    out[1] >> 16]
    for byte, bits in zip((lo, hi, hi, lo), got):
        real = (byte != 0x7F) & (byte != 0xFF)  # e4m3fn's NaN bytes: never a weight
        assert torch.equal(bits[real], want[byte[real]]), function
