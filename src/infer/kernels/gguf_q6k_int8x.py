"""Q6_K at one row of `x` with x rounded to int8 (decode at batch 1): gguf_q4k_int8x.py's
way for the 6-bit blocks of a Q4_K_M file (its LM head, and attn_v / ffn_down in some
layers), x rounded per 32 values by `int8_rows.quantize_x`.

A Q6_K super-block is 210 bytes for 256 weights: `ql` (128 bytes, low 4 bits), `qh` (64,
high 2 bits), 16 int8 scales (one per 16 weights) and `d` (float16). Its 32-bit word f
(bytes 4f..) of `ql`, f = 16n + 8b + t (half n, t < 8), holds in its low nibbles weights
128n + 32b + 4t.. and in its high ones those 64 further; their two high bits are bits
2b.. and 2b + 4.. of qh word 32 + 8n + t, and their scales bytes 2b + t // 4 of words
48 + 2n and 49 + 2n. A 6-bit value q becomes the signed byte q - 32 as `(q + 0x60) ^ 0x80`
(no carry leaves a byte), so one `dp4a` multiplies four weights by their four int8 x.

Every other super-block starts two bytes into a word: its words are funnel-shifted from
two loads (`shf.r.clamp`, the second load an L1 hit). Rows must be whole words: K a
multiple of 512. A thread holds one scale group's four words of `ql` (loaded one by one:
the blocks are 4-byte aligned only) and applies its two scales once. The tile is
`[group, rows, units]` in that order because no load of it is contiguous, and Triton 3.6
(the device's) then gives a warp's lanes to a tile's dimensions first to last (3.9 last
to first): 8 lanes on a super-block's groups, 4 on rows. The error is x's rounding only,
as for Q4_K.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from infer.kernels import dependent_launch
from infer.kernels.gguf_gemv import _f16_hi, _f16_lo, _store_rows
from infer.kernels.gguf_q4k_int8x import _dp4a, _four, _step_units, run_int8x, split_launch

SUPER_K, SUPER_BYTES = 256, 210
_SIGN_BITS = tl.constexpr(-0x7F7F7F80)  # 0x80808080 as an int32


@triton.jit
def _from_halfword(lo, hi, shift, PTX: tl.constexpr):
    """The 32 bits at bit `shift` (0 or 16) of the 64-bit `hi:lo`."""
    if PTX:
        return tl.inline_asm_elementwise(
            asm="shf.r.clamp.b32 $0, $1, $2, $3;", constraints="=r,r,r,r",
            args=[lo, hi, shift], dtype=tl.int32, is_pure=True, pack=1)
    else:
        low = lo.to(tl.uint32, bitcast=True)
        high = hi.to(tl.uint32, bitcast=True)
        return tl.where(shift != 0, (low >> 16) | (high << 16), low).to(tl.int32,
                                                                         bitcast=True)


@triton.jit
def _field(start, f, shift, PTX: tl.constexpr):
    """Word f of super-blocks starting at words `start`, `shift` bits in (16: odd ones)."""
    return _from_halfword(tl.load(start + f), tl.load(start + f + 1, mask=shift != 0, other=0),
                          shift, PTX)


@triton.jit
def _signed_six(ql, qh, b, HIGH: tl.constexpr):
    """The four 6-bit values of a `ql` word's low (or HIGH) nibbles and their two bits of
    `qh`, each as the signed byte q - 32."""
    if HIGH:
        six = ((ql >> 4) & 0x0F0F0F0F) | ((qh >> (2 * b)) & 0x30303030)
    else:
        six = (ql & 0x0F0F0F0F) | ((qh << (4 - 2 * b)) & 0x30303030)
    return (six + 0x60606060) ^ _SIGN_BITS


@triton.jit
def _q6k_int8x_kernel(words, xq, side, y_ptr, part_ptr, counts, N, units, stride_w, splits,
                      per_split, BLOCK_N: tl.constexpr, UNITS: tl.constexpr,
                      EVEN: tl.constexpr, PTX: tl.constexpr, PDL: tl.constexpr):
    """Program (n, s) owns rows `n * BLOCK_N..` and super-blocks `s * per_split..` of K
    (`per_split` and UNITS even: a step starts on an even super-block), UNITS a step:
    `[8, BLOCK_N, UNITS]` quarters of `ql` (h: words 4h..4h + 3, one scale group, 32
    weights with the high nibbles'). K split over `splits` programs:
    gguf_gemv._store_rows."""
    dependent_launch.wait(PDL)  # x's rounding, and the split counters, of the kernels before
    dependent_launch.release(PDL)
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    h = tl.arange(0, 8)[:, None, None]
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)[None, :, None]
    ui = tl.arange(0, UNITS)[None, None, :]
    n = h // 4
    b = h // 2 % 2
    byte = 2 * b + h % 2  # of the scale words: t // 4 = h % 2
    row = words + tl.minimum(rn, N - 1).to(tl.int64) * stride_w  # rows past N: the last
    acc = tl.zeros((8, BLOCK_N, UNITS), dtype=tl.float32)
    u_end = tl.minimum(pid_s * per_split + per_split, units)
    for u0 in range(pid_s * per_split, u_end, UNITS):
        u, ok = _step_units(u0, ui, u_end, EVEN)  # d 0 where not ok
        odd = u % 2
        shift = odd * 16
        start = row + u // 2 * 105 + odd * 52  # 420 bytes a pair
        # x words of the low nibbles' weights: 32n + 8b + t = 4h + 16n + j; 16 further
        x = xq + u * 64 + 4 * h + 16 * n
        x_lo = _four(x, PTX)
        x_hi = _four(x + 16, PTX)
        at = start + 4 * h
        at_qh = start + 32 + 8 * n + 4 * (h % 2)
        ql_next = tl.load(at)
        qh_next = tl.load(at_qh)
        lo = tl.zeros((8, BLOCK_N, UNITS), dtype=tl.int32)
        hi = tl.zeros((8, BLOCK_N, UNITS), dtype=tl.int32)
        for j in tl.static_range(4):
            ql_word, qh_word = ql_next, qh_next
            if j < 3:
                ql_next = tl.load(at + j + 1)
                qh_next = tl.load(at_qh + j + 1)
            else:  # the word after the group: only odd super-blocks read it
                ql_next = tl.load(at + 4, mask=shift != 0, other=0)
                qh_next = tl.load(at_qh + 4, mask=shift != 0, other=0)
            ql = _from_halfword(ql_word, ql_next, shift, PTX)
            qh = _from_halfword(qh_word, qh_next, shift, PTX)
            lo = _dp4a(_signed_six(ql, qh, b, False), x_lo[j], lo, PTX, SIGNED=True)
            hi = _dp4a(_signed_six(ql, qh, b, True), x_hi[j], hi, PTX, SIGNED=True)
        sc_lo = (_field(start, 48 + 2 * n, shift, PTX) << (24 - 8 * byte)) >> 24
        sc_hi = (_field(start, 49 + 2 * n, shift, PTX) << (24 - 8 * byte)) >> 24
        block = u * 8 + 4 * n + b  # x's block of 32 of the low nibbles' weights; 2 further
        dx = side + block // 2 * 4 + block % 2  # quantize_x's steps: that block's, then +4
        d_word = tl.load(start + 52)  # d: bytes 208, 209 (the high half of odd ones' word)
        d = tl.where(odd != 0, _f16_hi(d_word), _f16_lo(d_word))
        if not EVEN:
            d = tl.where(ok, d, 0.0)
        acc += d * ((sc_lo.to(tl.float32) * tl.load(dx)) * lo.to(tl.float32)
                    + (sc_hi.to(tl.float32) * tl.load(dx + 4)) * hi.to(tl.float32))
    y = tl.sum(tl.sum(acc, axis=2), axis=0)
    _store_rows(y, pid_n * BLOCK_N + tl.arange(0, BLOCK_N), y_ptr, part_ptr, counts, pid_n,
                pid_s, N, splits)


def launch(rows: int, cols: int, device: torch.device) -> dict:
    """The launch for `rows x cols` weights, not measured yet (docs/performance.md): 32
    rows a program, two super-blocks a step, K split as Q4_K's."""
    return split_launch(rows, cols, device, block_n=32, units=2)


def q6k_gemv_int8x(x: torch.Tensor, words: torch.Tensor, cols: int, *, block_n: int = 32,
                   units: int = 2, split: int = 1, num_warps: int = 4,
                   quantized: tuple[torch.Tensor, torch.Tensor] | None = None
                   ) -> torch.Tensor:
    """`x [1, cols]` (cols a multiple of 512) times the transpose of the Q6_K weight `words
    [N, cols / 256 * 52.5]` (gguf_gemv.gemv_words), x rounded to int8 per 32 values
    (`quantized`: int8_rows.quantize_x(x), made here if not given), `units` (even)
    super-blocks a step, K split over `split` programs a row block: `[1, N]` in x's
    dtype."""
    assert cols % (2 * SUPER_K) == 0 and units % 2 == 0, (cols, units)
    assert words.shape[1] * 4 == cols // SUPER_K * SUPER_BYTES, (cols, words.shape)
    return run_int8x(_q6k_int8x_kernel, x, words, cols, block_n=block_n, units=units,
                     split=split, num_warps=num_warps, quantized=quantized)
