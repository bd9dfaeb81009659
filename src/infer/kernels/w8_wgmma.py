"""8-bit weights times 8-bit rows of x on Hopper's async wgmma, written in Gluon (Triton's
dialect with explicit layouts and barriers): `y [M, N] = x [M, K] @ (w [N, K] *
scale[:, None])^T` for M up to 64, with x given quantized as the Triton kernels take it:

- FP8 by FP8: x in e4m3 with a scale a row (`fp8_quant.fp8_quantize_rows`), as `rows_mma`'s
  FP8 x FP8 mode; each K tile's sums added in float32 (Hopper's FP8 MMA keeps ~14 bits of
  its running sum, which over 4096 of K drifts by up to ~2 % where it is left to sum them
  all), the tiles a pair at a time;
- INT8 by x's two int8 halves (`int8_x16.split_rows`: `x ~ s (256 hi + lo)`), as
  `int8_x16_matmul`: two wgmmas a K tile, int32 sums, exact.

Why (docs/performance.md, sessions 24 and 64): the `tl.dot` kernels at 32 rows wait for every
wgmma group before the next (`WARPGROUP.DEPBAR` 0 twice a K step in `int8_x16_matmul`) with
one or two programs a multiprocessor, so nothing else runs while it waits: the 8B o
projection read at 44 % of DRAM bandwidth. Here TMA fills a ring of STAGES shared-memory
tiles, each signalling an mbarrier, and keeps STAGES - 1 tiles in flight whatever the
wgmmas do; a tile's wgmma is issued asynchronously and waited for only once the next one is
issued (INT8: the tile before's, each iteration; FP8: the pair's first, then its second),
and a slot takes the tile STAGES - 1 ahead as soon as its wgmma is done.

A program owns BLOCK_N channels (the wgmma's M: one warpgroup of 4 warps at 64, two
repetitions at 128) and one of `splits` K slices; the last program of a channel block to
finish adds the slices' float32 parts, scales and stores them (`store_sums`).

Gluon is experimental: importing this module fails on a Triton without Gluon's Hopper
calls (`kernels.gluon_hopper` asks).
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from infer.kernels import launch_counters, sm_count

# Triton 3.6 (the device's) names them so, later versions async_load and barrier
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
barrier = getattr(gl, "thread_barrier", None) or gl.barrier  # renamed the same way

MAX_ROWS = 64
MAX_BLOCKS = 1 << 16  # channel blocks a launch may have: a counter each


@gluon.jit
def _load_tile(w_desc, x_desc, w_slot, x_slot, lo_slot, bar, n0, k, M, pred,
               INT8: gl.constexpr):
    """Ask TMA for a K tile: the weight's `[BLOCK_N, BLOCK_K]` at (n0, k) and x's rows (with
    INT8, x's high half at row 0 and its low half at row M of the `[2 M, K]` halves)."""
    nbytes: gl.constexpr = w_desc.block_type.nbytes + x_desc.block_type.nbytes * (
        2 if INT8 else 1)
    mbarrier.expect(bar, nbytes, pred=pred)
    _tma_load(w_desc, [n0, k], bar, w_slot, pred=pred)
    _tma_load(x_desc, [0, k], bar, x_slot, pred=pred)
    if INT8:
        _tma_load(x_desc, [M, k], bar, lo_slot, pred=pred)


@gluon.jit
def _tile_sums(w_ring, x_ring, bars, i, valid, acc, STAGES: gl.constexpr):
    """Issue tile i's wgmma (async) into `acc`, its old sums not used, once the tile is in
    (not waited for where not `valid`)."""
    slot = i % STAGES
    mbarrier.wait(bars.index(slot), (i // STAGES) & 1, pred=valid)
    return warpgroup_mma(w_ring.index(slot), x_ring.index(slot).permute((1, 0)), acc,
                         use_acc=False, is_async=True)


@gluon.jit
def _refill(w_desc, x_desc, w_ring, x_ring, lo_ring, bars, n0, t0, i, count, M,
            STAGES: gl.constexpr, INT8: gl.constexpr):
    """Tile i - 1's wgmma done: ask for tile i + STAGES - 1 (if any) into the ring slot tile
    i - 1 read."""
    BLOCK_K: gl.constexpr = w_desc.block_type.shape[1]
    nxt = i + STAGES - 1
    refill = nxt % STAGES
    _load_tile(w_desc, x_desc, w_ring.index(refill), x_ring.index(refill),
               lo_ring.index(refill if INT8 else 0), bars.index(refill), n0,
               (t0 + nxt) * BLOCK_K, M, nxt < count, INT8)


@gluon.jit
def _w8_wgmma_kernel(w_desc, x_desc, ws_ptr, xs_ptr, y_ptr, part_ptr, counts, M, N,
                     stride_ym, tiles_per_split, tiles, splits, INT8: gl.constexpr,
                     STAGES: gl.constexpr, num_warps: gl.constexpr):
    """Program (n, s): channels `BLOCK_N n..`, K tiles `s * tiles_per_split..` (of `tiles`).
    Rows of x past M (TMA fills them: zeros, or with INT8 the low half's rows) and channels
    past N are not stored."""
    BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = w_desc.block_type.shape[1]
    BLOCK_M: gl.constexpr = x_desc.block_type.shape[0]
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_M, 32])
    acc_type: gl.constexpr = gl.int32 if INT8 else gl.float32

    pid_n = gl.program_id(0)
    pid_s = gl.program_id(1)
    n0 = pid_n * BLOCK_N
    t0 = pid_s * tiles_per_split
    count = gl.minimum(tiles_per_split, tiles - t0)

    w_ring = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BLOCK_N, BLOCK_K],
                                       w_desc.layout)
    x_ring = gl.allocate_shared_memory(x_desc.dtype, [STAGES, BLOCK_M, BLOCK_K],
                                       x_desc.layout)
    lo_ring = gl.allocate_shared_memory(x_desc.dtype, [STAGES if INT8 else 1, BLOCK_M,
                                                       BLOCK_K], x_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)
    for i in gl.static_range(STAGES - 1):
        _load_tile(w_desc, x_desc, w_ring.index(i), x_ring.index(i),
                   lo_ring.index(i if INT8 else 0), bars.index(i), n0,
                   (t0 + i) * BLOCK_K, M, i < count, INT8)

    zeros = gl.zeros((BLOCK_N, BLOCK_M), dtype=acc_type, layout=acc_layout)
    if INT8:  # int32 sums, exact: one chain of wgmmas a half
        acc = zeros
        acc_lo = zeros
        for i in range(count):
            slot = i % STAGES
            mbarrier.wait(bars.index(slot), (i // STAGES) & 1)
            w_tile = w_ring.index(slot)
            acc = warpgroup_mma(w_tile, x_ring.index(slot).permute((1, 0)), acc,
                                is_async=True)
            acc_lo = warpgroup_mma(w_tile, lo_ring.index(slot).permute((1, 0)), acc_lo,
                                   is_async=True)
            # the tile before's wgmmas are done: its ring slot is free
            acc, acc_lo = warpgroup_mma_wait(num_outstanding=2, deps=(acc, acc_lo))
            _refill(w_desc, x_desc, w_ring, x_ring, lo_ring, bars, n0, t0, i, count, M,
                    STAGES, INT8)
        acc, acc_lo = warpgroup_mma_wait(num_outstanding=0, deps=(acc, acc_lo))
        total = acc.to(gl.float32) * 256.0 + acc_lo.to(gl.float32)
    else:
        # Each tile's sums in a fresh accumulator, added in float32 once done: a pair of
        # tiles an iteration, the second's wgmma running while the first's sums are added;
        # none runs across iterations (ptxas serializes every wgmma where a register of one
        # in flight there is read or copied: advisory C7514). An odd count's last, missing
        # tile is multiplied from a stale slot and not added.
        total = zeros
        for i in range(0, count, 2):
            acc_a = _tile_sums(w_ring, x_ring, bars, i, True, zeros, STAGES)
            _refill(w_desc, x_desc, w_ring, x_ring, lo_ring, bars, n0, t0, i, count, M,
                    STAGES, INT8)
            acc_b = _tile_sums(w_ring, x_ring, bars, i + 1, i + 1 < count, zeros, STAGES)
            acc_a = warpgroup_mma_wait(num_outstanding=1, deps=(acc_a,))
            total += acc_a
            _refill(w_desc, x_desc, w_ring, x_ring, lo_ring, bars, n0, t0, i + 1, count, M,
                    STAGES, INT8)
            acc_b = warpgroup_mma_wait(num_outstanding=0, deps=(acc_b,))
            total += gl.where(i + 1 < count, acc_b, 0.0)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))

    rn = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, acc_layout))
    rm = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, acc_layout))
    xs = gl.load(xs_ptr + rm, mask=rm < M, other=0.0)
    store_sums(total, gl.expand_dims(xs, 0), rn, rm, ws_ptr, y_ptr, part_ptr, counts, pid_n,
               pid_s, splits, M, N, stride_ym)


@gluon.jit
def sum_parts(total, rn, rm, part_ptr, counts, pid_n, pid_s, splits, M, N):
    """`(sums, last)` of a program's float32 sums `total [channels rn, rows rm]` of one K
    slice of `splits`: with one slice, `total` and true; with more, the slice stored as its
    part of `[splits, M, N]` at part_ptr (channels rn < N), and the program counting in
    last on its channel block's counter gets every part added and true (and sets the counter
    back to 0), the others false (`split_k.py`'s scheme, written out: Gluon kernels cannot
    call Triton ones)."""
    mask = gl.expand_dims(rm < M, 0) & gl.expand_dims(rn < N, 1)
    last = splits == 1
    if splits > 1:
        parts = part_ptr + gl.expand_dims(rm * N, 0) + gl.expand_dims(rn, 1)
        gl.store(parts + pid_s * M * N, total, mask=mask)
        barrier()  # every thread's part stored before the count releases them
        last = gl.atomic_add(counts + pid_n, 1, sem="acq_rel") == splits - 1
        if last:
            total = gl.load(parts, mask=mask, other=0.0, cache_modifier=".cg")
            for s in range(1, splits):
                total += gl.load(parts + s * M * N, mask=mask, other=0.0,
                                 cache_modifier=".cg")
            gl.atomic_xchg(counts + pid_n, 0, sem="relaxed")
    return total, last


@gluon.jit
def store_sums(total, row_scale, rn, rm, ws_ptr, y_ptr, part_ptr, counts, pid_n, pid_s,
               splits, M, N, stride_ym):
    """Store a program's float32 sums `total [channels rn, rows rm]` of one K slice of
    `splits` (`sum_parts`), once every slice's are in: scaled (channel scales at ws_ptr,
    times `row_scale`) and stored at `y [M, N]`."""
    total, last = sum_parts(total, rn, rm, part_ptr, counts, pid_n, pid_s, splits, M, N)
    if last:
        mask = gl.expand_dims(rm < M, 0) & gl.expand_dims(rn < N, 1)
        ws = gl.load(ws_ptr + rn, mask=rn < N, other=0.0).to(gl.float32)
        total = total * gl.expand_dims(ws, 1) * row_scale
        y = y_ptr + gl.expand_dims(rm.to(gl.int64) * stride_ym, 0) + gl.expand_dims(rn, 1)
        gl.store(y, total.to(y_ptr.dtype.element_ty), mask=mask)


def default_launch(n: int, k: int, device: torch.device) -> dict[str, int]:
    """64 channels by 128 of K, 4 stages; K split so that the launch has about two programs
    per multiprocessor (not yet swept: `benchmarks/w8_wgmma_sweep.py`)."""
    blocks = triton.cdiv(n, 64)
    tiles = triton.cdiv(k, 128)
    splits = max(1, min(8, tiles // 8, (2 * sm_count(device)) // blocks))
    return dict(block_n=64, block_k=128, stages=4, splits=splits)


def w8_wgmma(xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor,
             scale: torch.Tensor, out_dtype: torch.dtype, **launch: int) -> torch.Tensor:
    """`[M, N]` in `out_dtype`: x given quantized, `xq` FP8 `[M, K]` (with FP8 weights) or
    int8 `[2, M, K]` (x's halves, with INT8 weights), times the transpose of `weight [N, K]`
    (contiguous) scaled per channel by `scale [N]`, x's rows by `x_scale [M]`. `launch`
    (all of `default_launch`'s keys; none: its) is for tuning."""
    int8 = weight.dtype == torch.int8
    m = xq.shape[-2]
    n, k = weight.shape
    assert 1 <= m <= MAX_ROWS and xq.shape[-1] == k and xq.stride(-1) == 1, xq.shape
    assert xq.dtype == weight.dtype and (xq.dim() == 3) == int8, (xq.dtype, weight.dtype)
    assert weight.is_contiguous() and scale.shape == (n,) and x_scale.shape == (m,)
    assert k % 16 == 0, "TMA needs 16-byte rows"
    launch = launch or default_launch(n, k, xq.device)
    block_n, block_k, stages = launch["block_n"], launch["block_k"], launch["stages"]
    assert stages >= 3, "an odd count's stale slot must not be one a load is filling"
    block_m = min(64, max(8, triton.next_power_of_2(m)))
    y = torch.empty((m, n), dtype=out_dtype, device=xq.device)
    tiles = triton.cdiv(k, block_k)
    per_split = triton.cdiv(tiles, min(launch["splits"], tiles))
    splits = triton.cdiv(tiles, per_split)
    blocks = triton.cdiv(n, block_n)
    parts = torch.empty((splits, m, n), dtype=torch.float32, device=xq.device) \
        if splits > 1 else y
    gl_dtype = gl.int8 if int8 else gl.float8e4nv
    w_desc = TensorDescriptor.from_tensor(weight, [block_n, block_k],
                                          gl.NVMMASharedLayout.get_default_for(
                                              [block_n, block_k], gl_dtype))
    x_rows = xq.reshape(-1, k)
    x_desc = TensorDescriptor.from_tensor(x_rows, [block_m, block_k],
                                          gl.NVMMASharedLayout.get_default_for(
                                              [block_m, block_k], gl_dtype))
    _w8_wgmma_kernel[(blocks, splits)](
        w_desc, x_desc, scale, x_scale, y, parts,
        launch_counters("w8_wgmma", xq.device, MAX_BLOCKS, blocks), m, n, y.stride(0),
        per_split, tiles, splits, INT8=int8, STAGES=stages, num_warps=4)
    return y
