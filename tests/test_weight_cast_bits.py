"""The PTX of `weight_cast.to_f16_times` (FP8 e4m3 weights as float16 times 2^-8 by their
bits) read from its source and run by a small emulator of the three instructions it uses,
on every pair of e4m3 bytes, against torch's own FP8 -> float16 conversion: a kernel with
inline assembly cannot run in Triton's interpreter, and this is the check that can on a
CPU (`INFER_TEST_DEVICE=cuda pytest tests/test_gemv_kernel.py -k halves` runs the real one
inside the GEMV)."""

from __future__ import annotations

import inspect
import re

import pytest
import torch

pytest.importorskip("triton")

from infer.kernels import weight_cast

MASK32 = 0xFFFFFFFF


def _prmt(a: int, b: int, selector: int) -> int:
    """PTX `prmt.b32` (default mode): result byte i is byte `s & 7` of b:a (a's bytes
    0-3, b's 4-7), or with `s & 8` that byte's sign bit copied into all eight bits."""
    source = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF
                                                          for i in range(4)]
    out = 0
    for i in range(4):
        s = (selector >> (4 * i)) & 0xF
        byte = source[s & 7]
        if s & 8:
            byte = 0xFF if byte & 0x80 else 0x00
        out |= byte << (8 * i)
    return out


def _program(asm: str) -> list[tuple[str, str, list[str]]]:
    """The asm's lines as (op, destination, sources): prmt, shl and and only."""
    lines = re.findall(r"(\w+)\.b32 ([^;]+);", asm)
    assert {op for op, _ in lines} == {"prmt", "shl", "and"}, lines
    return [(op, *_operands(text)) for op, text in lines]


def _operands(text: str) -> tuple[str, list[str]]:
    dest, *sources = [a.strip() for a in text.split(",")]
    return dest, sources


def _run(program: list, register: int) -> tuple[int, int]:
    """The program on `$2 = register`: its outputs $0, $1."""
    regs = {"$2": register}

    def value(operand: str) -> int:
        return int(operand, 0) if operand[0].isdigit() else regs[operand]

    for op, dest, (a, b, *rest) in program:
        if op == "prmt":
            regs[dest] = _prmt(value(a), value(b), value(rest[0]))
        elif op == "shl":
            regs[dest] = (value(a) << value(b)) & MASK32
        else:
            regs[dest] = value(a) & value(b)
    return regs["$0"], regs["$1"]


def test_to_f16_times_makes_every_e4m3_byte_its_float16_value_times_2_to_the_minus_8():
    """Every pair of bytes (lo, hi) in each position of a register (lo, hi, hi, lo): the
    four float16 outputs, in order, are the bytes' values times 2^-8, exactly."""
    source = inspect.getsource(weight_cast)  # (a jitted function's own has no source)
    asm = re.search(r'def to_f16_times\(.*?asm="""(.*?)"""', source, re.DOTALL).group(1)
    program = _program(asm)
    values = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
    values = values.to(torch.float32)
    want = (values * 2.0 ** -8).to(torch.float16)
    finite = ~values.isnan()
    assert torch.equal(want.to(torch.float32)[finite] * 2.0 ** 8, values[finite])  # exact
    want = want.view(torch.int16).to(torch.int32) & 0xFFFF
    assert weight_cast.F16_FP8_UNDO.value == 2.0 ** 8
    nan = {0x7F, 0xFF}  # e4m3fn's two NaN bytes: never a quantized weight
    for lo in range(256):
        for hi in range(256):
            first, second = _run(program, lo | hi << 8 | hi << 16 | lo << 24)
            got = (first & 0xFFFF, first >> 16, second & 0xFFFF, second >> 16)
            for byte, bits in zip((lo, hi, hi, lo), got):
                assert byte in nan or bits == want[byte], (hex(lo), hex(hi))
