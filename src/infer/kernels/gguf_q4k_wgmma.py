"""GGUF Q4_K's part of `gguf_wgmma.py` (read that first): where a thread's values come from
in a 144-byte super-block and how they are made floats.

The words of a super-block's nibbles, `[64 rows, 8 g, 4 t]` (word 4g + t), sit in
`gguf_wgmma.words_layout`. A word's byte e holds weight `k = 64 (g // 2) + 32 h + 16 (g % 2)
+ 4 t + e` in its nibble h. Each word shifted once per byte puts byte e's low nibble at bit
15 and its high one at bit 19; or-ed into the bits of 1.0 and one multiply-add later it is
`q sc - low` (`_nibble`, as in gguf_gemm.py's Q4_K). `EngineConfig.gguf_q4k_wgmma`, on by
default (H100, 8B Q4_K_M step at batch 8 / 32: 5.21 / 6.65 ms against gguf_gemm's 6.65 /
7.67).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl


@gluon.jit
def _nibble(ws, a, b, one, H: gl.constexpr):
    """`a f + b` for `f = 1 + q 2^(4H - 8)`, q the nibble at bit 15 + 4H of `ws`."""
    return ((ws & (0xF << (15 + 4 * H))) | one).to(gl.float32, bitcast=True) * a + b


@gluon.jit
def _scales(head, s0, s1, s2, c, H: gl.constexpr):
    """The multiply-add's `a`, `b` of sub-block 2c + H for `[64]` header words and `c`
    `[1, 8]`, as `[64, 8, 1]`: `q sc - low` = `a f + b` for _nibble's f."""
    head = gl.expand_dims(head, 1)
    s0 = gl.expand_dims(s0, 1)
    s1 = gl.expand_dims(s1, 1)
    s2 = gl.expand_dims(s2, 1)
    sh = c % 2 * 16
    sc = gl.where(c < 2, s0 >> sh, ((s2 >> sh) & 0x0F0F) | ((s0 >> (sh + 2)) & 0x3030))
    mn = gl.where(c < 2, s1 >> sh, ((s2 >> (sh + 4)) & 0x0F0F) | ((s1 >> (sh + 2)) & 0x3030))
    d = (head & 0xFFFF).to(gl.uint16).to(gl.float16, bitcast=True).to(gl.float32)
    dmin = (head >> 16).to(gl.uint16).to(gl.float16, bitcast=True).to(gl.float32)
    a = d * _six_bits(sc >> (H * 8)) * (256.0 if H == 0 else 16.0)
    b = -(a + dmin * _six_bits(mn >> (H * 8)))
    return gl.expand_dims(a, 2), gl.expand_dims(b, 2)


@gluon.jit
def _six_bits(v):
    """The low 6 bits of `v` (uint32) as a float32, exactly, without a convert instruction
    (an H100 converts 16 values a cycle per SM): or-ed under the bits of 2^23 by one
    `lop3`, 2^23 taken off."""
    bits = gl.inline_asm_elementwise(
        asm="""{
        .reg .b32 m, big;
        mov.b32 m, 0x3F;
        mov.b32 big, 0x4B000000;
        lop3.b32 $0, $1, m, big, 0xEA;
        }""",
        constraints="=r,r", args=[v], dtype=gl.uint32, is_pure=True, pack=1)
    return bits.to(gl.float32, bitcast=True) - 8388608.0


@gluon.jit
def load_unit(row_ptr, word_off, u):
    """Super-block u of each row: its header words (`[64]`) and nibble words (`[64, 8, 4]`)."""
    unit = row_ptr + u * 36
    head = gl.load(unit).to(gl.uint32, bitcast=True)
    s0 = gl.load(unit + 1).to(gl.uint32, bitcast=True)
    s1 = gl.load(unit + 2).to(gl.uint32, bitcast=True)
    s2 = gl.load(unit + 3).to(gl.uint32, bitcast=True)
    words = gl.expand_dims(gl.expand_dims(unit + 4, 1), 2) + word_off
    return head, s0, s1, s2, gl.load(words).to(gl.uint32, bitcast=True)


@gluon.jit
def offsets(g, t):
    """For g `[1, 8]` and t `[1, 1, 4]`: the nibble words' offsets in a super-block
    (`[1, 8, 4]`) and the sub-block pair c each g's values are in (`[1, 8]`)."""
    return 4 * gl.expand_dims(g, 2) + t, g // 2


@gluon.jit
def x_order(kp):
    """x's column (in its super-block) of the weight at register position k'."""
    return 64 * (kp // 32 % 4) + 32 * (kp // 128) + 16 * (kp // 16 % 2) + 4 * (kp // 2 % 4) \
        + 2 * (kp // 8 % 2) + kp % 2


@gluon.jit
def decode(head, s0, s1, s2, w, c, one):
    """A super-block's values, `[row, g, t, e % 2, e // 2, h]` float32."""
    a0, b0 = _scales(head, s0, s1, s2, c, 0)
    a1, b1 = _scales(head, s0, s1, s2, c, 1)
    w0 = w << 15
    w1 = w << 7
    w2 = w >> 1
    w3 = w >> 9
    low = gl.join(gl.join(_nibble(w0, a0, b0, one, 0), _nibble(w1, a0, b0, one, 0)),
                  gl.join(_nibble(w2, a0, b0, one, 0), _nibble(w3, a0, b0, one, 0)))
    high = gl.join(gl.join(_nibble(w0, a1, b1, one, 1), _nibble(w1, a1, b1, one, 1)),
                   gl.join(_nibble(w2, a1, b1, one, 1), _nibble(w3, a1, b1, one, 1)))
    return gl.join(low, high)
