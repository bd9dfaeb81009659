"""A row of x as 16-bit fixed point split into two int8 halves, as the INT8 kernels take it
(`int8_x16.py`): `q = round(x / s)` with `s = max |x| / QMAX`, `q = 256 hi + lo`. The
launches that make such rows (`int8_x16.split_rows`, and the RMSNorm that hands out its
output so) share these helpers, so that their halves are the same bit for bit.
"""

from __future__ import annotations

import triton
import triton.language as tl

QMAX = tl.constexpr(32639)  # |q| <= QMAX keeps hi = floor((q + 128) / 256) in [-127, 127]


@triton.jit
def row_scale(amax):
    """(the scale of a row whose largest magnitude is `amax`, its inverse)."""
    scale = amax * (1.0 / QMAX)
    scale = tl.where(scale > 0, scale, 1.0)
    return scale, tl.math.div_rn(tl.zeros_like(scale) + 1.0, scale)


@triton.jit
def store_halves(hi_at, lo_offset, x, inv, mask):
    """`x` (float32) as 16-bit fixed point of step `1 / inv`: its high halves at `hi_at`,
    its low ones `lo_offset` after."""
    q = tl.floor(x * inv + 0.5)
    q = tl.minimum(tl.maximum(q, -QMAX), QMAX).to(tl.int32)
    hi = (q + 128) >> 8  # arithmetic shift: floor((q + 128) / 256)
    lo = q - hi * 256
    tl.store(hi_at, hi.to(tl.int8), mask=mask)
    tl.store(hi_at + lo_offset, lo.to(tl.int8), mask=mask)


@triton.jit
def store_halves_row(y, hi_at, lo_offset, s_at, mask):
    """A whole row `y` held by one program (masked columns 0) as its halves at `hi_at` (the
    low ones `lo_offset` after), its scale at `s_at`: `int8_x16.split_rows`' values."""
    scale, inv = row_scale(tl.max(tl.abs(y.to(tl.float32)), axis=0))
    store_halves(hi_at, lo_offset, y.to(tl.float32), inv, mask)
    tl.store(s_at, scale)
