"""8-bit weights (int8, or FP8 e4m3 on a GPU) made float32 inside a kernel, for the
CUDA-core matmuls that multiply them in float32 (`gemv.py`, `w8a16_matmul.py`,
`rows_mma.py`'s overflow path): exactly (`to_float`), FP8 ones times a power of two for a
sum scaled once at the end (`to_float_times`, the GEMV's), or int8 ones as units offset
from 1 (`to_unit`, for the GEMV's "units" form, which takes the offset away once); FP8
ones as float16 times 2^-8 (`to_f16_times`, the GEMV's form "halves"); and bfloat16 for a
tensor-core product with bfloat16 x (`to_bf16_times`, `rows_mma.py`'s)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def to_float(w, PTX: tl.constexpr):
    """8-bit weights as float32. int8 without the quarter-rate integer convert: `w + 128`
    in the low byte of the float 2^23 (bit pattern 0x4B000000) is 2^23 + 128 + w exactly
    (faster for one row on the H100; slower feeding `tl.dot`, which converts to 16 bits).
    With PTX (a GPU; the interpreter has no inline assembly) four weights a register."""
    if w.dtype == tl.int8:
        if PTX:
            return _int8_to_float_ptx(w)
        bits = (w.to(tl.uint8, bitcast=True).to(tl.int32) ^ 0x80) | 0x4B000000
        return bits.to(tl.float32, bitcast=True) - 8388736.0
    return w.to(tl.float32)


# `to_float_times` makes FP8 weights their values times 1 / FP8_TIMES_UNDO.
FP8_TIMES_UNDO = tl.constexpr(2.0 ** 120)


@triton.jit
def to_float_times(w, PTX: tl.constexpr, FP8_BITS: tl.constexpr):
    """`to_float`, but with FP8_BITS (a GPU's kernel: inline PTX) FP8 weights as their
    values times 2^-120 (1 / FP8_TIMES_UNDO), without a convert instruction: each e4m3
    byte's sign goes to bit 31 of a float32 and its exponent and mantissa to bits 26..20,
    its exponent 120 below float32's bias (subnormal bytes become float32 denormals,
    exactly). A product with one is exact inside the multiply-add; the caller scales the
    sum once. (On an H100 the 8B FP8 step took 3.19 ms with it against 3.23, twice each,
    session 64: its three integer instructions a weight cost less than the convert's
    `F2FP` and `HADD2.F32`.)"""
    if FP8_BITS and w.dtype == tl.float8e4nv:
        return _fp8_bits_ptx(w.to(tl.int8, bitcast=True))
    return to_float(w, PTX)


@triton.jit
def _fp8_bits_ptx(w):
    """Four e4m3 bytes of a register (as int8) -> float32 bits `sign << 31 | (b & 0x7F) << 20`:
    a prmt sign-extends each byte to 32 bits, a shift puts its low 7 bits at 20.., an and
    keeps the sign and those bits."""
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 t0, t1, t2, t3;
        prmt.b32 t0, $4, 0, 0x8880;
        prmt.b32 t1, $4, 0, 0x9991;
        prmt.b32 t2, $4, 0, 0xAAA2;
        prmt.b32 t3, $4, 0, 0xBBB3;
        shl.b32 t0, t0, 20;
        shl.b32 t1, t1, 20;
        shl.b32 t2, t2, 20;
        shl.b32 t3, t3, 20;
        and.b32 $0, t0, 0x87F00000;
        and.b32 $1, t1, 0x87F00000;
        and.b32 $2, t2, 0x87F00000;
        and.b32 $3, t3, 0x87F00000;
        }""",
        constraints="=r,=r,=r,=r,r", args=[w], dtype=tl.float32, is_pure=True, pack=4)


@triton.jit
def _int8_to_float_ptx(w):
    """`to_float`'s int8 path on the four int8 weights of each 32-bit register: one xor
    adds 128 to all four (as bytes), one prmt per weight puts its byte under the exponent
    of 2^23 (0x4B0000nn), one subtraction takes 2^23 + 128 away."""
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 t, m;
        xor.b32 t, $4, 0x80808080;
        mov.b32 m, 0x4B000000;
        prmt.b32 $0, t, m, 0x7540;
        prmt.b32 $1, t, m, 0x7541;
        prmt.b32 $2, t, m, 0x7542;
        prmt.b32 $3, t, m, 0x7543;
        sub.f32 $0, $0, 0f4B000080;
        sub.f32 $1, $1, 0f4B000080;
        sub.f32 $2, $2, 0f4B000080;
        sub.f32 $3, $3, 0f4B000080;
        }""",
        constraints="=r,=r,=r,=r,r", args=[w], dtype=tl.float32, is_pure=True, pack=4)


@triton.jit
def to_unit(w, PTX: tl.constexpr):
    """int8 weights q as the floats `1 + (q + 128) / 2^15` (exact): `q + 128` as the
    second byte of 1.0's bit pattern (0x3F80nn00). With PTX one xor adds 128 to a
    register's four weights (as bytes) and one prmt a weight builds its float."""
    if PTX:
        return tl.inline_asm_elementwise(
            asm="""{
            .reg .b32 t, m;
            xor.b32 t, $4, 0x80808080;
            mov.b32 m, 0x3F800000;
            prmt.b32 $0, t, m, 0x7604;
            prmt.b32 $1, t, m, 0x7614;
            prmt.b32 $2, t, m, 0x7624;
            prmt.b32 $3, t, m, 0x7634;
            }""",
            constraints="=r,=r,=r,=r,r", args=[w], dtype=tl.float32, is_pure=True, pack=4)
    bits = ((w.to(tl.uint8, bitcast=True).to(tl.int32) ^ 0x80) << 8) | 0x3F800000
    return bits.to(tl.float32, bitcast=True)


# `to_f16_times` makes FP8 weights their values times 1 / F16_FP8_UNDO.
F16_FP8_UNDO = tl.constexpr(2.0 ** 8)


@triton.jit
def to_f16_times(w):
    """FP8 (e4m3) weights as float16 times 2^-8 (1 / F16_FP8_UNDO), exactly, without a
    convert instruction (inline PTX, a GPU's kernel only): a prmt sign-extends each of a
    register's byte pairs into two 16-bit halves, a shift by 7 puts each byte's exponent
    and mantissa at bits 13..7 (exponent 8 below float16's bias; subnormal bytes become
    float16 subnormals) and a sign copy at bit 15, and an and clears the rest: 1.5
    instructions a weight, none on the convert pipe."""
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 t0, t1;
        prmt.b32 t0, $2, 0, 0x9180;
        prmt.b32 t1, $2, 0, 0xB3A2;
        shl.b32 t0, t0, 7;
        shl.b32 t1, t1, 7;
        and.b32 $0, t0, 0xBF80BF80;
        and.b32 $1, t1, 0xBF80BF80;
        }""",
        constraints="=r,=r,r", args=[w.to(tl.int8, bitcast=True)], dtype=tl.float16,
        is_pure=True, pack=4)


# `to_bf16_times` makes FP8 weights their values times 1 / BF16_FP8_UNDO.
BF16_FP8_UNDO = tl.constexpr(2.0 ** 120)


@triton.jit
def to_bf16_times(w, PTX: tl.constexpr):
    """8-bit weights as bfloat16 without a convert instruction (the H100 converts 16 values
    a cycle per SM; inline PTX, a GPU's kernel only): int8 exactly; FP8 as their values
    times 2^-120 (1 / BF16_FP8_UNDO), exactly, each byte's sign to bit 15 and its exponent
    and mantissa to bits 10..4 (exponent 120 below bfloat16's bias; subnormal bytes become
    bfloat16 subnormals)."""
    tl.static_assert(PTX, "8-bit weights as bfloat16 by their bits: a GPU's kernel")
    if w.dtype == tl.int8:
        return _int8_to_bf16_ptx(w)
    return _fp8_to_bf16_ptx(w.to(tl.int8, bitcast=True))


@triton.jit
def _fp8_to_bf16_ptx(w):
    """Four e4m3 bytes of a register (as int8) -> two bfloat16 pairs, in order: a prmt per
    pair sign-extends its two bytes into the register's two 16-bit halves, a shift by 4
    puts each byte's low 7 bits at bits 10..4 of its half and a sign copy at bit 15 (the
    low half's spill into bits 16..19 is cleared), and an and keeps those bits: 1.5
    instructions a weight (`to_f16_times`' recipe with bfloat16's shift)."""
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 t0, t1;
        prmt.b32 t0, $2, 0, 0x9180;
        prmt.b32 t1, $2, 0, 0xB3A2;
        shl.b32 t0, t0, 4;
        shl.b32 t1, t1, 4;
        and.b32 $0, t0, 0x87F087F0;
        and.b32 $1, t1, 0x87F087F0;
        }""",
        constraints="=r,=r,r", args=[w], dtype=tl.bfloat16, is_pure=True, pack=4)


@triton.jit
def _int8_to_bf16_ptx(w):
    """Four int8 weights q of a register as two bfloat16 pairs, in order: a prmt per pair
    puts `q & 127` under the bits of 128.0 (0x43nn: 128 + (q & 127)), another 128.0 or,
    for a negative q (its sign bit as the low byte's top bit), 256.0; one paired
    multiply-add (minus that, plus the first), exact, leaves q."""
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 m, s, v0, v1, t0, t1, minus;
        and.b32 m, $2, 0x7F7F7F7F;
        and.b32 s, $2, 0x80808080;
        mov.b32 minus, 0xBF80BF80;
        prmt.b32 v0, m, 0x43434343, 0x5140;
        prmt.b32 v1, m, 0x43434343, 0x7342;
        prmt.b32 t0, s, 0x43434343, 0x5140;
        prmt.b32 t1, s, 0x43434343, 0x7342;
        fma.rn.bf16x2 $0, t0, minus, v0;
        fma.rn.bf16x2 $1, t1, minus, v1;
        }""",
        constraints="=r,=r,r", args=[w], dtype=tl.bfloat16, is_pure=True, pack=4)
