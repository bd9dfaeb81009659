"""All-reduce, residual add and RMSNorm in one kernel, over peer memory (tensor
parallelism on one host's GPUs, `EngineConfig.fuse_all_reduce_norm`).

A row-parallel projection leaves each rank a partial sum; in a Llama-family layer the sum
is then added to the residual stream and normalised (in Gemma 3's, normalised alone).
Unfused that is an all-reduce kernel and an (add +) RMSNorm kernel, each a launch and a
wait in a batch-1 decode step. Here one program per row writes this rank's partial into
every peer's staging buffer (torch symmetric memory: peers' memory is addressable over
NVLink), waits until the peers' partials have arrived in its own, sums them in rank order
and goes on as `rmsnorm.fused_add_rmsnorm` does.

Each 8-byte word written to a peer carries 4 bytes of the partial (two 16-bit values, or
one 32-bit) and, in its high half, the call's tag, so that the reader knows a word has
arrived by the word itself: a GPU writes an aligned 8-byte word whole, and no flag, and no
fence ordering a flag after the data, is needed (NCCL's "LL" protocol).

Invariants:
- program p uses row p of the staging buffers (a place per source rank) only. Its call
  count on this rank (`epochs[p]`, plus one) is the tag it writes and waits for (its low
  32 bits), and the count's parity picks the half of the buffers it writes into. Every
  rank makes the same calls with the same row counts, so the counts agree.
- a half is overwritten two calls of program p after it was written; in between, the
  writer waited for every peer's words of the call in between, which a peer writes only
  after its kernel that read the half has ended (kernels of a stream end in order). So a
  half holds its call's words or the call two before's, whose tag differs.
- partials are summed in rank order in float32 and rounded once, so every rank gets the
  same bits (for two ranks, the bits of NCCL's sum), then rounded and normalised exactly as
  `rmsnorm.fused_add_rmsnorm`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from infer.kernels import dependent_launch
from infer.kernels.rmsnorm import normalised

_LOW = tl.constexpr(0xFFFFFFFF)


@triton.jit
def _packed(x, tag, PACK: tl.constexpr, BLOCK: tl.constexpr):
    """`x [BLOCK]` as `[BLOCK // PACK]` words: 4 bytes of x each (PACK of its values, the
    first in the low bits), `tag` above them."""
    if PACK == 2:
        lo, hi = tl.split(tl.reshape(x, [BLOCK // 2, 2]))
        data = ((lo.to(tl.int16, bitcast=True).to(tl.int64) & 0xFFFF)
                | ((hi.to(tl.int16, bitcast=True).to(tl.int64) & 0xFFFF) << 16))
    else:
        data = x.to(tl.int32, bitcast=True).to(tl.int64) & _LOW
    return data | (tag << 32)


@triton.jit
def _unpacked(words, dtype: tl.constexpr, PACK: tl.constexpr, BLOCK: tl.constexpr):
    """The `[BLOCK]` values of `dtype` that `_packed` wrote into `words`."""
    if PACK == 2:
        lo = (words & 0xFFFF).to(tl.int16).to(dtype, bitcast=True)
        hi = ((words >> 16) & 0xFFFF).to(tl.int16).to(dtype, bitcast=True)
        values = tl.reshape(tl.join(lo, hi), [BLOCK])
    else:
        values = (words & _LOW).to(tl.int32).to(dtype, bitcast=True)
    return values


@triton.jit
def _all_reduce_add_rmsnorm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, buffers_ptr, epochs_ptr,
    rank, half_words, stride_x, stride_res, stride_out, n_cols, eps,
    WORLD: tl.constexpr, HAS_RESIDUAL: tl.constexpr, OFFSET: tl.constexpr,
    PACK: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    n_words = n_cols // PACK
    words = tl.arange(0, BLOCK // PACK)
    word_mask = words < n_words
    dtype = x_ptr.dtype.element_ty
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    dependent_launch.wait(PDL)
    dependent_launch.release(PDL)
    epoch = tl.load(epochs_ptr + row) + 1
    tag = epoch & _LOW
    x = tl.load(x_ptr + row.to(tl.int64) * stride_x + cols, mask=mask, other=0.0)
    sent = _packed(x, tag, PACK, BLOCK)
    # Into every peer's buffer at this rank's place, so that every read below is local.
    slot = (epoch % 2) * half_words + (row.to(tl.int64) * WORLD) * n_words
    for r in tl.static_range(WORLD):
        if r != rank:
            dst = tl.load(buffers_ptr + r).to(tl.pointer_type(tl.int64))
            tl.store(dst + slot + rank * n_words + words, sent, mask=word_mask)
    mine = tl.load(buffers_ptr + rank).to(tl.pointer_type(tl.int64))
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for r in tl.static_range(WORLD):
        if r == rank:
            total += x.to(tl.float32)
        else:
            src = mine + slot + r * n_words + words
            got = tl.load(src, mask=word_mask, other=tag << 32, volatile=True)
            while tl.sum((((got >> 32) & _LOW) != tag).to(tl.int32)) > 0:
                got = tl.load(src, mask=word_mask, other=tag << 32, volatile=True)
            total += _unpacked(got, dtype, PACK, BLOCK).to(tl.float32)
    s = total.to(dtype)
    if HAS_RESIDUAL:
        res = tl.load(res_ptr + row.to(tl.int64) * stride_res + cols, mask=mask, other=0.0)
        s = (s.to(tl.float32) + res.to(tl.float32)).to(res.dtype)
        tl.store(res_ptr + row.to(tl.int64) * stride_res + cols, s, mask=mask)
    y = normalised(s.to(tl.float32), w, n_cols, eps, OFFSET, out_ptr.dtype.element_ty)
    tl.store(out_ptr + row.to(tl.int64) * stride_out + cols, y, mask=mask)
    tl.store(epochs_ptr + row, epoch)


def all_reduce_add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
    offset: float, buffers: torch.Tensor, epochs: torch.Tensor, rank: int, half_words: int,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`residual += sum over ranks of x` (in place); returns `(rmsnorm(residual),
    residual)`, or with no residual `rmsnorm(sum over ranks of x)`. `buffers` holds every
    rank's staging buffer address (int64, on x's device, in rank order; each buffer two
    halves of `half_words` 8-byte words); `epochs` this rank's call count per row (int64,
    zeros at first). The caller checks sizes (every rank's rows of `x` fit a half, rows
    <= len(epochs)); every rank must call with the same shapes in the same order."""
    assert offset in (0.0, 1.0), "offset is 0 (x * w) or 1 (Gemma's x * (1 + w))"
    assert x.is_contiguous() and x.dtype.itemsize in (2, 4), (x.dtype, x.stride())
    assert residual is None or (residual.is_contiguous() and residual.shape == x.shape)
    n = x.shape[-1]
    rows = x.numel() // n
    world = buffers.numel()
    pack = 4 // x.dtype.itemsize
    assert n % pack == 0, "a row fills whole words"
    assert rows <= epochs.numel() and rows * world * (n // pack) <= half_words
    out = torch.empty_like(x)
    if rows:
        block = max(triton.next_power_of_2(n), 2 * pack)
        _all_reduce_add_rmsnorm_kernel[(rows,)](
            x, x if residual is None else residual, weight, out, buffers, epochs,
            rank, half_words, n, n, n, n, eps,
            WORLD=world, HAS_RESIDUAL=residual is not None, OFFSET=offset, PACK=pack,
            BLOCK=block, num_warps=min(max(block // 256, 1), 16),
            **dependent_launch.launch_options(),
        )
    return out if residual is None else (out, residual)
