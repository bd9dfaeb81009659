"""Q8_0 at one row of `x` with x rounded to int8 (decode at batch 1): gguf_q4k_int8x.py's way
for the 8-bit blocks (a Q8_0 file, the Q8_0 tensors of other files), x rounded per 32
values by `int8_rows.quantize_x`, which are a Q8_0 block's 32 weights: one `dp4a`
multiplies four int8 weights by their four int8 x, a block's eight of them sum its dot, and
the block's scale times x's step scales it.

A Q8_0 block is 34 bytes: `d` (float16), then 32 int8 weights. Two blocks (a unit, 64
weights) are 17 words: word 0 holds `d` of the first in its low half and its first two
weights in its high one, words 1-7 its next 28, word 8 its last two (low half) and `d` of
the second (high half), words 9-16 the second's 32 weights, word-aligned. The first
block's four weights 4j.. (bytes 2 + 4j..) are the middle of words j and j + 1 (`prmt`,
the second load an L1 hit). Rows must be whole words: K a multiple of 64.
The tile is `[units, rows, 8]`, flat along the eight words of a block, which a warp's
loads then cover contiguously. The error is x's rounding only, as for Q4_K.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from infer.kernels import dependent_launch
from infer.kernels.gguf_gemv import _f16_hi, _f16_lo, _store_rows
from infer.kernels.gguf_q4k_int8x import _dp4a, _step_units, run_int8x, split_launch

UNIT_K, UNIT_WORDS = 64, 17
_UNIT_WORDS = tl.constexpr(UNIT_WORDS)


@triton.jit
def _middle(lo, hi, PTX: tl.constexpr):
    """Bytes 2-5 of the 64-bit `hi:lo` (on a GPU one `prmt`)."""
    if PTX:
        return tl.inline_asm_elementwise(
            asm="prmt.b32 $0, $1, $2, 0x5432;", constraints="=r,r,r", args=[lo, hi],
            dtype=tl.int32, is_pure=True, pack=1)
    else:
        low = lo.to(tl.uint32, bitcast=True)
        high = hi.to(tl.uint32, bitcast=True)
        return ((low >> 16) | (high << 16)).to(tl.int32, bitcast=True)


@triton.jit
def _q8_0_int8x_kernel(words, xq, side, y_ptr, part_ptr, counts, N, units, stride_w, splits,
                       per_split, BLOCK_N: tl.constexpr, UNITS: tl.constexpr,
                       EVEN: tl.constexpr, PTX: tl.constexpr, PDL: tl.constexpr):
    """Program (n, s) owns rows `n * BLOCK_N..` and units (two blocks) `s * per_split..` of
    K, UNITS a step: `[UNITS, BLOCK_N, 8]` words of each block, a thread word j of both.
    `d` and x's steps are loaded by every thread of a unit (one address for the eight: a
    size-1 dimension would take a layout of its own). K split over `splits` programs:
    gguf_gemv._store_rows."""
    dependent_launch.wait(PDL)  # x's rounding, and the split counters, of the kernels before
    dependent_launch.release(PDL)
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    ui = tl.arange(0, UNITS)[:, None, None]
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)[None, :, None]
    j = tl.arange(0, 8)[None, None, :]
    row = words + tl.minimum(rn, N - 1).to(tl.int64) * stride_w  # rows past N: the last
    acc = tl.zeros((UNITS, BLOCK_N, 8), dtype=tl.float32)
    u_end = tl.minimum(pid_s * per_split + per_split, units)
    for u0 in range(pid_s * per_split, u_end, UNITS):
        u, ok = _step_units(u0, ui, u_end, EVEN)  # d 0 where not ok
        p = row + u * _UNIT_WORDS
        first = _middle(tl.load(p + j), tl.load(p + j + 1), PTX)
        x = xq + u * 16 + j  # x's int8 words of the unit: the first block's, then 8 further
        dot0 = _dp4a(first, tl.load(x), 0, PTX, SIGNED=True)
        dot1 = _dp4a(tl.load(p + 9 + j), tl.load(x + 8), 0, PTX, SIGNED=True)
        d0 = _f16_lo(tl.load(p + 0 * j))
        d1 = _f16_hi(tl.load(p + 8 + 0 * j))
        if not EVEN:
            d0 = tl.where(ok, d0, 0.0)
            d1 = tl.where(ok, d1, 0.0)
        steps = side + u * 4 + 0 * j  # quantize_x's: the unit's two blocks' steps
        acc += (d0 * tl.load(steps)) * dot0.to(tl.float32)
        acc += (d1 * tl.load(steps + 1)) * dot1.to(tl.float32)
    y = tl.sum(tl.sum(acc, axis=2), axis=0)
    _store_rows(y, pid_n * BLOCK_N + tl.arange(0, BLOCK_N), y_ptr, part_ptr, counts, pid_n,
                pid_s, N, splits)


def launch(rows: int, cols: int, device: torch.device) -> dict:
    """The launch for `rows x cols` weights, not measured yet (docs/performance.md): 32
    rows a program, four units (256 weights) a step, K split as Q4_K's."""
    return split_launch(rows, cols, device, block_n=32, units=4, unit_k=UNIT_K)


def q8_0_gemv_int8x(x: torch.Tensor, words: torch.Tensor, cols: int, *, block_n: int = 32,
                    units: int = 4, split: int = 1, num_warps: int = 4,
                    quantized: tuple[torch.Tensor, torch.Tensor] | None = None
                    ) -> torch.Tensor:
    """`x [1, cols]` (cols a multiple of 64) times the transpose of the Q8_0 weight `words
    [N, cols / 64 * 17]` (gguf_gemv.row_words), x rounded to int8 per 32 values
    (`quantized`: int8_rows.quantize_x(x), made here if not given), `units` units of
    two blocks a step, K split over `split` programs a row block: `[1, N]` in x's dtype."""
    assert cols % UNIT_K == 0 and words.shape[1] == cols // UNIT_K * UNIT_WORDS, (
        cols, words.shape)
    return run_int8x(_q8_0_int8x_kernel, x, words, cols, block_n=block_n, units=units,
                     split=split, num_warps=num_warps, quantized=quantized, unit_k=UNIT_K)
