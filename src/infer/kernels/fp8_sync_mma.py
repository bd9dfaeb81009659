"""FP8 (e4m3) weights scaled per channel times 1..32 rows of FP8 x (a scale a row) on the
tensor cores' synchronous MMA (Gluon's `mma_v2`, float16 `m16n8k16`), the weights loaded
from global memory straight into the MMA's register operand: `y [M, N] = (xq [M, K] *
x_scale[:, None]) @ (w [N, K] * scale[:, None])^T`, float32 sums.

Why (docs/performance.md, session 72): at one row the FP8 GEMV (`gemv.py`) makes every
weight a float32 on the CUDA cores, 5.6 instructions a weight byte compiled for sm_90, and
in the 8B step its q/k/v and gate_up take ~6 µs a layer more than INT8's `dp4a` GEMV (0.9);
the wgmma kernels need the weights in shared memory (`w8_wgmma`) or made bfloat16 first
(`fp8_wgmma`). Here a thread loads 8 contiguous bytes of a row of W by one 64-bit load
into the registers the MMA reads, and the hardware's pairwise convert
(`F2FP.F16.E4M3.UNPACK_B`) makes them float16 (exactly; half an instruction a weight,
within what the convert pipe issues at the copy rate); x's FP8 values likewise. The
operands' `k_width` of 8 gives each thread 8 contiguous K elements of its rows of W and of
its column of x alike; the MMA's K order inside each 32 is permuted the same way for both,
so their products pair up. (An FP8 `mma_v2`, `m16n8k32`, is no faster: on Hopper ptxas
makes it two float16 ones and permutes the bytes first, 5.7 instructions a weight at one
row compiled for sm_90 against 1.25 here.)

A program owns 64 channels (4 warps of 16, the MMA's M) and BLOCK_M rows of x (its N: 8,
16 or 32, rows past M loaded as 0) and one of `splits` K slices, BLOCK_K of K a step. Both
operands of a step are loaded at its top (no loop-carried prefetch: Triton carries FP8
values between iterations byte by byte, and the permutes that packs them cost 3 more
instructions a weight; the loads in flight come from the programs a multiprocessor holds
at 56 registers a thread). Each step's sums start from zero and are added in float32. The
last program of a channel block adds the slices' parts, scales and stores them
(`w8_wgmma.store_sums`).
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from infer.kernels import launch_counters, sm_count
from infer.kernels.w8_wgmma import MAX_BLOCKS, store_sums

MAX_ROWS = 32
BLOCK_N = gl.constexpr(64)


@gluon.jit
def _fp8_sync_mma_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, y_ptr, part_ptr, counts, M, N, K,
                         stride_xm, stride_wn, stride_ym, steps_per_split, steps, splits,
                         BLOCK_M: gl.constexpr, BLOCK_K: gl.constexpr, EVEN_K: gl.constexpr,
                         num_warps: gl.constexpr):
    """Program (n, s): channels `64 n..`, K steps `s * steps_per_split..` (of `steps`).
    Channels past N read the last one (not stored); rows of x past M load as 0."""
    sums: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[4, 1],
                                                   instr_shape=[16, 8])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=sums, k_width=8)
    b_layout: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=sums, k_width=8)

    pid_n = gl.program_id(0)
    pid_s = gl.program_id(1)
    rn_w = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, a_layout))
    k_w = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, a_layout))
    w_rows = w_ptr + gl.expand_dims(gl.minimum(pid_n * BLOCK_N + rn_w, N - 1).to(gl.int64)
                                    * stride_wn, 1)
    k_x = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(1, b_layout))
    rm_x = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, b_layout))
    x_cols = x_ptr + gl.expand_dims(rm_x.to(gl.int64) * stride_xm, 0)
    x_ok = gl.expand_dims(rm_x < M, 0)

    c0 = pid_s * steps_per_split
    c1 = gl.minimum(c0 + steps_per_split, steps)
    zeros = gl.zeros((BLOCK_N, BLOCK_M), dtype=gl.float32, layout=sums)
    total = zeros
    for c in range(c0, c1):
        w = _load_w(w_rows, k_w, c * BLOCK_K, K, EVEN_K)
        x = _load_x(x_cols, k_x, c * BLOCK_K, K, x_ok, EVEN_K)
        total += mma_v2(w.to(gl.float16), x.to(gl.float16), zeros)

    rm = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, sums))
    x_scale = gl.load(xs_ptr + rm, mask=rm < M, other=0.0)
    rn = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, sums))
    store_sums(total, gl.expand_dims(x_scale, 0), rn, rm, ws_ptr, y_ptr, part_ptr, counts,
               pid_n, pid_s, splits, M, N, stride_ym)


@gluon.jit
def _load_w(w_rows, k_w, k0, K, EVEN_K: gl.constexpr):
    """The weight tile `[64, BLOCK_K]` at K columns `k0..`, zeros past K."""
    at = w_rows + gl.expand_dims(k0 + k_w, 0)
    if EVEN_K:
        return gl.load(at)
    return gl.load(at, mask=gl.expand_dims(k0 + k_w < K, 0), other=0.0)


@gluon.jit
def _load_x(x_cols, k_x, k0, K, x_ok, EVEN_K: gl.constexpr):
    """x's rows as the MMA's `[BLOCK_K, BLOCK_M]` operand at K `k0..`, zeros past M and K."""
    at = x_cols + gl.expand_dims(k0 + k_x, 1)
    if EVEN_K:
        return gl.load(at, mask=x_ok, other=0.0)
    return gl.load(at, mask=x_ok & gl.expand_dims(k0 + k_x < K, 1), other=0.0)


def default_launch(n: int, k: int, device: torch.device) -> dict[str, int]:
    """256 of K a step; K split so that the launch has about four programs per
    multiprocessor, each slice at least two steps (not yet swept)."""
    block_k = 256
    blocks = triton.cdiv(n, BLOCK_N.value)
    steps = triton.cdiv(k, block_k)
    return dict(block_k=block_k,
                splits=max(1, min(16, steps // 2, triton.cdiv(4 * sm_count(device), blocks))))


def fp8_sync_mma(xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor,
                 scale: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16,
                 **launch: int) -> torch.Tensor:
    """FP8 rows `xq [M, K]` (M <= 32, unit column stride) scaled by `x_scale [M]` (float32)
    times the transpose of the FP8 `weight [N, K]` (contiguous) scaled per channel by
    `scale [N]`: `[M, N]` in `out_dtype`. `launch` (`default_launch`'s keys; none: its) is
    for tuning."""
    m, k = xq.shape
    n = weight.shape[0]
    assert xq.dtype == torch.float8_e4m3fn and 1 <= m <= MAX_ROWS and xq.stride(1) == 1, \
        (xq.dtype, xq.shape)
    assert x_scale.shape == (m,) and x_scale.dtype == torch.float32, x_scale.shape
    assert weight.dtype == torch.float8_e4m3fn and weight.is_contiguous() \
        and weight.shape[1] == k and scale.shape == (n,), (weight.shape, scale.shape)
    launch = launch or default_launch(n, k, xq.device)
    block_k = launch["block_k"]
    steps = triton.cdiv(k, block_k)
    per_split = triton.cdiv(steps, min(launch["splits"], steps))
    splits = triton.cdiv(steps, per_split)
    blocks = triton.cdiv(n, BLOCK_N.value)
    y = torch.empty((m, n), dtype=out_dtype, device=xq.device)
    parts = torch.empty((splits, m, n), dtype=torch.float32, device=xq.device) \
        if splits > 1 else y
    _fp8_sync_mma_kernel[(blocks, splits)](
        xq, x_scale, weight, scale, y, parts,
        launch_counters("fp8_sync_mma", xq.device, MAX_BLOCKS, blocks),
        m, n, k, xq.stride(0) if m > 1 else 0, weight.stride(0), y.stride(0), per_split,
        steps, splits, BLOCK_M=min(MAX_ROWS, max(8, triton.next_power_of_2(m))),
        BLOCK_K=block_k, EVEN_K=k % block_k == 0, num_warps=4)
    return y
