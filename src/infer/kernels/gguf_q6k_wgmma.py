"""GGUF Q6_K's part of `gguf_wgmma.py` (read that first): where a thread's values come from
in a 210-byte super-block and how they are made floats. A Q4_K_M file keeps its LM head and
half its layers' ffn_down and attn_v in Q6_K, which gguf_gemm.py read at ~730 GB/s at 32
rows (the 8B down: 66 µs against bfloat16's 44; this kernel 45 µs).
`EngineConfig.gguf_q6k_wgmma`, on by default (H100, 8B Q4_K_M step at batch 8 / 32: 4.88 /
6.14 ms against 5.21 / 6.64 without it).

A super-block is 210 bytes: `ql` (128 bytes of low nibbles), `qh` (64 bytes of 2-bit
highs), 16 int8 scales and an fp16 `d`; every other one starts 2 bytes past a 4-byte
boundary, so every field is read as 16-bit words. Weight `k = 128 (g // 4) + 16 (g % 4) +
4 t + e + 64 h` is nibble h of byte e of `ql` word 4g + t, and its high bits are bits
`2 (2h + (g // 2) % 2)` of byte e of `qh` word `4 (2 (g // 4) + g % 2) + t`; its scale is
byte `8 (g // 4) + g % 4 + 4 h`. So a thread holding `ql` words 4g + t
(`gguf_wgmma.words_layout`) holds each value's high bits in 4 `qh` words, and one word of
6-bit bytes `v = (nibbles & 0x0F0F0F0F) | (highs shifted & 0x30303030)` per nibble h gives
4 values (`1 + v 2^-8` or-ed into the bits of 1.0, then `256 d sc f - 288 d sc`).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

UNIT_WORDS = gl.constexpr(105)  # 16-bit words a super-block


@gluon.jit
def _word(ptr):
    """The 32-bit word of the two 16-bit words at `ptr` (2-byte aligned)."""
    lo = gl.load(ptr).to(gl.uint16, bitcast=True).to(gl.uint32)
    hi = gl.load(ptr + 1).to(gl.uint16, bitcast=True).to(gl.uint32)
    return lo | (hi << 16)


@gluon.jit
def load_unit(row_ptr, ql_off, qh_off, sc_off, u):
    """Super-block u of each row: `d` (`[64]` fp16 bits), the scales' 16-bit words for
    h = 0 and 1 (`[64, 8]`), the `ql` and `qh` words each value takes (`[64, 8, 4]`)."""
    unit = row_ptr + u * UNIT_WORDS
    d = gl.load(unit + 104)
    sc_unit = gl.expand_dims(unit, 1) + sc_off
    units = gl.expand_dims(gl.expand_dims(unit, 1), 2)
    return (d, gl.load(sc_unit), gl.load(sc_unit + 2), _word(units + ql_off),
            _word(units + qh_off))


@gluon.jit
def _scales(d256, sc, odd):
    """`a`, `b` with `a f + b = d sc (q - 32)` for `f = 1 + q 2^-8`: `[64, 8, 1]`, from
    `256 d` (`[64]`) and the scales' 16-bit words `sc [64, 8]`, byte `odd`."""
    word = sc.to(gl.uint16, bitcast=True).to(gl.int32)
    s = ((word << (24 - 8 * odd)) >> 24).to(gl.float32)  # the byte, sign-extended
    a = gl.expand_dims(d256, 1) * s
    return gl.expand_dims(a, 2), gl.expand_dims(-1.125 * a, 2)


@gluon.jit
def _six(vs, a, b, one):
    """`a f + b` for `f = 1 + v 2^-8`, v the 6 bits at bit 15 of `vs`."""
    return ((vs & (0x3F << 15)) | one).to(gl.float32, bitcast=True) * a + b


@gluon.jit
def _values(v, a, b, one):
    """The 4 values of a word of 6-bit bytes `v`, `[.., e % 2, e // 2]`."""
    return gl.join(gl.join(_six(v << 15, a, b, one), _six(v << 7, a, b, one)),
                   gl.join(_six(v >> 1, a, b, one), _six(v >> 9, a, b, one)))


@gluon.jit
def offsets(g, t):
    """For g `[1, 8]` and t `[1, 1, 4]`: the offsets (16-bit words) of the `ql` and `qh`
    words each value takes (`[1, 8, 4]`) and of the scales' words (`[1, 8]`, h = 0)."""
    ql_off = 2 * (4 * gl.expand_dims(g, 2) + t)
    qh_off = 64 + 2 * (4 * gl.expand_dims(2 * (g // 4) + g % 2, 2) + t)
    return ql_off, qh_off, 96 + 4 * (g // 4) + g % 4 // 2


@gluon.jit
def x_order(kp):
    """x's column (in its super-block) of the weight at register position k'."""
    return 128 * (kp // 64 % 2) + 16 * (kp // 16 % 4) + 4 * (kp // 2 % 4) \
        + 2 * (kp // 8 % 2) + kp % 2 + 64 * (kp // 128)


@gluon.jit
def decode(d, sc0, sc1, ql, qh, g, one):
    """A super-block's values, `[row, g, t, e % 2, e // 2, h]` float32 (g `[1, 8]`)."""
    odd = g % 2
    shift = gl.expand_dims(2 * (g // 2 % 2), 2)  # the highs' bit in byte e, h = 0
    d256 = 256.0 * d.to(gl.float16, bitcast=True).to(gl.float32)
    a0, b0 = _scales(d256, sc0, odd)
    a1, b1 = _scales(d256, sc1, odd)
    v0 = (ql & 0x0F0F0F0F) | ((qh << (4 - shift)) & 0x30303030)
    v1 = ((ql >> 4) & 0x0F0F0F0F) | ((qh >> shift) & 0x30303030)
    return gl.join(_values(v0, a0, b0, one), _values(v1, a1, b1, one))

