"""Seeded random draws for many sampled rows in one launch (Philox4x32-10, counter-based).

A seeded request must draw the same noise wherever it sits in whatever batch, so each row
has its own stream: key = the request's 64-bit seed, counter = (column, output position,
stream, 0). Stream 0 is the sampler's Exp(1) race noise, stream 1 the uniforms that
judge drafts. The first 32-bit word x of each Philox block becomes
u = ((x >> 9) + 0.5) / 2^23 in (0, 1), exact in float32; the exponential draw is -log(u).
One program fills one block of columns of one row: out[rows[i], :] for the i-th (seed,
position).

`reference.seeded_noise_ref` is the same arithmetic in torch (int64 holding uint32).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def philox_uniform(seed, position, cols, stream):
    """u in (0, 1) of the first word of Philox4x32-10 keyed by the 64-bit `seed` at counter
    (cols, position, stream, 0), for a block of columns `cols` (int32)."""
    zero = tl.zeros(cols.shape, dtype=tl.uint32)
    k0 = zero + (seed & 0xFFFFFFFF).to(tl.uint32)
    k1 = zero + ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    c0 = cols.to(tl.uint32)
    c1 = zero + (position & 0xFFFFFFFF).to(tl.uint32)
    c2 = zero + stream
    c3 = zero
    m0 = zero + 0xD2511F53  # Random123's constants (reference.PHILOX_*)
    m1 = zero + 0xCD9E8D57
    for _ in tl.static_range(10):
        hi0 = tl.umulhi(m0, c0)
        lo0 = m0 * c0
        hi1 = tl.umulhi(m1, c2)
        lo1 = m1 * c2
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0 = k0 + 0x9E3779B9
        k1 = k1 + 0xBB67AE85
    return ((c0 >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)


@triton.jit
def _seeded_noise_kernel(out_ptr, rows_ptr, seeds_ptr, positions_ptr, stride_out, n_cols,
                         STREAM: tl.constexpr, EXPONENTIAL: tl.constexpr,
                         BLOCK: tl.constexpr):
    i = tl.program_id(0)
    row = tl.load(rows_ptr + i).to(tl.int64)
    seed = tl.load(seeds_ptr + i)
    position = tl.load(positions_ptr + i)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    u = philox_uniform(seed, position, cols, STREAM)
    if EXPONENTIAL:
        u = -tl.log(u)
    tl.store(out_ptr + row * stride_out + cols, u, mask=cols < n_cols)


def seeded_noise(out: torch.Tensor, rows: torch.Tensor, seeds: torch.Tensor,
                 positions: torch.Tensor, exponential: bool = True, stream: int = 0) -> None:
    """`out[rows[i], :]` := draws of the stream (seeds[i], positions[i], `stream`):
    Exp(1) if `exponential`, else uniform in (0, 1). `out` [B, V] float32 with unit column
    stride; `rows`, `seeds` (any int64: two's complement of the 64-bit seed) and
    `positions` [n] int64 on its device."""
    assert out.dim() == 2 and out.stride(1) == 1 and out.dtype == torch.float32
    for t in (rows, seeds, positions):
        assert t.dtype == torch.int64 and t.device == out.device and t.is_contiguous()
    n, n_cols = len(rows), out.shape[1]
    if n == 0 or n_cols == 0:
        return
    _seeded_noise_kernel[(n, triton.cdiv(n_cols, BLOCK))](
        out, rows, seeds, positions, out.stride(0), n_cols, STREAM=stream,
        EXPONENTIAL=exponential, BLOCK=BLOCK, num_warps=4)
