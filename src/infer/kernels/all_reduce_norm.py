"""All-reduce, residual add and RMSNorm in one kernel, over peer memory (tensor
parallelism on one host's GPUs, `EngineConfig.fuse_all_reduce_norm`).

A row-parallel projection leaves each rank a partial sum; in a Llama-family layer the sum
is then added to the residual stream and normalised (in Gemma 3's, normalised alone).
Unfused that is an all-reduce kernel and an (add +) RMSNorm kernel, each a launch and a
wait in a batch-1 decode step. Here one program per row writes this rank's partial into
every rank's staging buffer (torch symmetric memory: peers' memory is addressable over
NVLink), raises its flag on every peer, waits for theirs, sums the partials now in its own
buffer in rank order and goes on as `rmsnorm.fused_add_rmsnorm` does. (Pushing the
partials, where each rank first read its peers' buffers, took 6.4 against 7.9 µs a call at
one row on two H200s, 7.6 against 10.3 at 16: `benchmarks/all_reduce_norm.py`.)

Invariants:
- program p uses row p of the staging buffers (a place per source rank) and flag slot p
  only. Its call count on this rank (`epochs[p]`, plus one) is the flag value it raises
  and waits for, and the count's parity picks the half of the buffers it writes into.
  Every rank makes the same calls with the same row counts, so the counts agree.
- a half is overwritten two calls of program p after it was written; in between, the
  writer waited for every peer's flag of the call in between, which a peer raises only
  after its kernel that read the half has ended (kernels of a stream end in order).
- flags only grow (int64), so a peer already one call ahead satisfies `>=`.
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


@triton.jit
def _all_reduce_add_rmsnorm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr,
    buffers_ptr, flags_ptr, epochs_ptr,
    rank, half_elems, stride_x, stride_res, stride_out, n_cols, eps,
    WORLD: tl.constexpr, HAS_RESIDUAL: tl.constexpr, OFFSET: tl.constexpr,
    BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    dtype = x_ptr.dtype.element_ty
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    dependent_launch.wait(PDL)
    dependent_launch.release(PDL)
    epoch = tl.load(epochs_ptr + row) + 1
    x = tl.load(x_ptr + row.to(tl.int64) * stride_x + cols, mask=mask, other=0.0)
    mine = tl.load(buffers_ptr + rank).to(tl.pointer_type(dtype))
    # Into every rank's buffer at this rank's place, so that every read below is local.
    slot = (epoch % 2) * half_elems + (row.to(tl.int64) * WORLD) * n_cols
    for r in tl.static_range(WORLD):
        dst = tl.load(buffers_ptr + r).to(tl.pointer_type(dtype))
        tl.store(dst + slot + rank * n_cols + cols, x, mask=mask)
    tl.debug_barrier()  # every thread's part written before the flags say so
    for r in tl.static_range(WORLD):
        if r != rank:
            peer_flags = tl.load(flags_ptr + r).to(tl.pointer_type(tl.int64))
            tl.atomic_xchg(peer_flags + row * WORLD + rank, epoch, sem="release", scope="sys")
    my_flags = tl.load(flags_ptr + rank).to(tl.pointer_type(tl.int64))
    for r in tl.static_range(WORLD):
        if r != rank:
            while tl.atomic_add(my_flags + row * WORLD + r, 0, sem="acquire",
                                scope="sys") < epoch:
                pass
    tl.debug_barrier()
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for r in tl.static_range(WORLD):
        total += tl.load(mine + slot + r * n_cols + cols, mask=mask, other=0.0,
                         volatile=True).to(tl.float32)
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
    offset: float, buffers: torch.Tensor, flags: torch.Tensor, epochs: torch.Tensor,
    rank: int, half_elems: int,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`residual += sum over ranks of x` (in place); returns `(rmsnorm(residual),
    residual)`, or with no residual `rmsnorm(sum over ranks of x)`. `buffers` and `flags`
    hold every rank's staging buffer and flag array addresses (int64, on x's device, in
    rank order); `epochs` this rank's call count per row (int64, zeros at first). The
    caller checks sizes (every rank's rows of `x` fit a half of `half_elems` elements,
    rows <= len(epochs)); every rank must call with the same shapes in the same order."""
    assert offset in (0.0, 1.0), "offset is 0 (x * w) or 1 (Gemma's x * (1 + w))"
    assert x.is_contiguous()
    assert residual is None or (residual.is_contiguous() and residual.shape == x.shape)
    n = x.shape[-1]
    rows = x.numel() // n
    world = buffers.numel()
    assert rows <= epochs.numel() and rows * n * world <= half_elems, (rows, n, half_elems)
    out = torch.empty_like(x)
    if rows:
        block = triton.next_power_of_2(n)
        _all_reduce_add_rmsnorm_kernel[(rows,)](
            x, x if residual is None else residual, weight, out, buffers, flags, epochs,
            rank, half_elems, n, n, n, n, eps,
            WORLD=world, HAS_RESIDUAL=residual is not None, OFFSET=offset, BLOCK=block,
            num_warps=min(max(block // 256, 1), 16), **dependent_launch.launch_options(),
        )
    return out if residual is None else (out, residual)
