"""INT8 weights times 16-bit rows on the int8 tensor cores, each row of x carried as two
int8 halves.

On tensor cores a W8A16 matmul has made each int8 weight a float16 first (`rows_mma.py`,
~3 instructions a weight byte: past what the SMs issue at the copy rate from ~16 rows
up, so INT8 decode at 32 rows ran no faster than bfloat16). The int8 MMA takes the weight
as it is stored, at twice the bfloat16 rate. So each row of x is scaled to 16-bit fixed
point, `q = round(x / s)` with `s = max |x| / QMAX` (`int8_halves.py`), and split into
two int8 rows `q = 256 hi + lo` (hi in [-127, 127], lo in [-128, 127]); two int8 MMAs per
K step share the weight tile, and `y = s * scale_w * (256 (w . hi) + w . lo)`, the int32
sums exact.
x's rounding is the only error: each value moves by at most s / 2, a 16-bit step of its
row's range (bfloat16 keeps 8 significant bits of each value: finer than this below 2^-7
of the row's largest, coarser above).

A program owns BLOCK_N output channels and one of `splits` slices of K; the last program
of a row block to finish adds the slices' float32 parts (a counter per row block, left at
0 for the next launch), as `rows_mma.py`'s do. Hopper's integer MMA takes 64 rows on its
first operand, so the weight tile is that operand and x's rows the other (the sums come
out transposed).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from infer.kernels import dependent_launch, launch_counters
from infer.kernels.int8_halves import row_scale, store_halves, store_halves_row
from infer.kernels.rows_mma import block_rows, launch_by_width
from infer.kernels.split_k import k_slice, sum_of_parts

MAX_ROWS = 64
MAX_BLOCKS = 1 << 16  # row blocks a launch may have: a counter each


@triton.jit
def _split_rows_kernel(x_ptr, q_ptr, s_ptr, M, K, stride_x, BLOCK: tl.constexpr,
                       ONE_PASS: tl.constexpr, PDL: tl.constexpr):
    """Row `row` of x -> its scale, and q's halves: hi in plane 0, lo in plane 1 of
    q `[2, M, K]`; with ONE_PASS (BLOCK >= K) the row read once."""
    dependent_launch.wait(PDL)
    dependent_launch.release(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    if ONE_PASS:
        x = tl.load(x_ptr + row * stride_x + cols, mask=cols < K, other=0.0)
        store_halves_row(x, q_ptr + row * K + cols, M * K, s_ptr + row, cols < K)
    else:
        amax = tl.zeros((BLOCK,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK):
            part = tl.load(x_ptr + row * stride_x + k0 + cols, mask=k0 + cols < K, other=0.0)
            amax = tl.maximum(amax, tl.abs(part.to(tl.float32)))
        scale, inv = row_scale(tl.max(amax, axis=0))
        for k0 in range(0, K, BLOCK):
            mask = k0 + cols < K
            part = tl.load(x_ptr + row * stride_x + k0 + cols, mask=mask, other=0.0)
            store_halves(q_ptr + row * K + k0 + cols, M * K, part.to(tl.float32), inv, mask)
        tl.store(s_ptr + row, scale)


Halves = tuple[torch.Tensor, torch.Tensor]


def attach_halves(x: torch.Tensor, halves: Halves) -> torch.Tensor:
    """`x`, carrying its rows' `split_rows` (made by the kernel that made x: the
    RMSNorm's) for the matmuls it goes into; the same invariant as `int8_rows.attach`'s (x
    never changed in place)."""
    x.x16_halves = halves
    return x


def attached_halves(x: torch.Tensor) -> Halves | None:
    """The halves `x` carries (`attach_halves`), if any."""
    return getattr(x, "x16_halves", None)


def split_rows(x: torch.Tensor) -> Halves:
    """`x [M, K]` (unit column stride) -> (int8 `[2, M, K]`: the rows' high and low halves,
    float32 `[M]`: their scales), `x ~ scale[:, None] * (256 hi + lo)`."""
    assert x.dim() == 2 and x.stride(1) == 1, (x.shape, x.stride())
    m, k = x.shape
    q = torch.empty((2, m, k), dtype=torch.int8, device=x.device)
    scale = torch.empty((m,), dtype=torch.float32, device=x.device)
    if m and k:
        block = min(16384, triton.next_power_of_2(k))
        _split_rows_kernel[(m,)](x, q, scale, m, k, x.stride(0), BLOCK=block,
                                 ONE_PASS=block >= k, num_warps=min(max(block // 512, 4), 16),
                                 **dependent_launch.launch_options())
    return q, scale


@triton.jit
def _int8_x16_kernel(q_ptr, xs_ptr, w_ptr, ws_ptr, y_ptr, part_ptr, counts, M, N, K,
                     stride_ym, steps_per_split, splits, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                     PDL: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    k_begin, k_end = k_slice(pid_s, steps_per_split, K, BLOCK_K)
    # Rows past N read row N - 1 (no mask on the weight's loads) and are not stored.
    w_rows = w_ptr + tl.minimum(rn, N - 1).to(tl.int64)[:, None] * K
    hi_rows = q_ptr + rm.to(tl.int64)[:, None] * K
    lo_rows = hi_rows + M * K
    row_mask = rm[:, None] < M
    dependent_launch.wait(PDL)
    dependent_launch.release(PDL)
    acc_hi = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.int32)
    acc_lo = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.int32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        kk = k0 + rk
        if EVEN_K:
            w = tl.load(w_rows + kk[None, :], eviction_policy="evict_first")
            mask = row_mask
        else:
            w = tl.load(w_rows + kk[None, :], mask=kk[None, :] < K, other=0,
                        eviction_policy="evict_first")
            mask = row_mask & (kk[None, :] < K)
        hi = tl.load(hi_rows + kk[None, :], mask=mask, other=0)
        lo = tl.load(lo_rows + kk[None, :], mask=mask, other=0)
        acc_hi = tl.dot(w, tl.trans(hi), acc_hi, out_dtype=tl.int32)
        acc_lo = tl.dot(w, tl.trans(lo), acc_lo, out_dtype=tl.int32)
    acc = acc_hi.to(tl.float32) * 256.0 + acc_lo.to(tl.float32)  # [BLOCK_N, BLOCK_M]
    y_at = y_ptr + rm.to(tl.int64)[None, :] * stride_ym + rn[:, None]
    mask = (rm[None, :] < M) & (rn[:, None] < N)
    if splits == 1:
        acc = _scaled(acc, ws_ptr, xs_ptr, rn, rm, N, M)
        tl.store(y_at, acc.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        parts = part_ptr + rm[None, :] * N + rn[:, None]  # [splits, M, N] float32
        last, total = sum_of_parts(acc, parts, M * N, pid_s, splits, counts + pid_n, mask)
        if last:
            total = _scaled(total, ws_ptr, xs_ptr, rn, rm, N, M)
            tl.store(y_at, total.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _scaled(acc, ws_ptr, xs_ptr, rn, rm, N, M):
    """The sums `[BLOCK_N, BLOCK_M]` times their channels' and rows' scales."""
    ws = tl.load(ws_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)
    xs = tl.load(xs_ptr + rm, mask=rm < M, other=0.0)
    return acc * ws[:, None] * xs[None, :]


def launch_for(n: int, k: int, device: torch.device) -> dict[str, int]:
    """The launch for a weight `[n, k]`, swept on an H200 over the 8B shape's projections
    at 32 rows (`benchmarks/w8a16_sweep.py --tensor-cores --int8-x16`): 128 channels by
    128 of K for wide layers, else 64 by 256, in two K slices where those tiles are fewer
    than ~0.7 per SM (o 14.5 -> 11.5 µs, down 29.1 -> 25.7 against four slices)."""
    return launch_by_width(n, k, device, (128, 128), most_splits=2)


def int8_x16_matmul(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                    halves: Halves | None = None, **launch: int) -> torch.Tensor:
    """`x [M, K]` (M <= MAX_ROWS; float16 / bfloat16 / float32, unit column stride) times
    the transpose of `weight [N, K]` int8 (contiguous) scaled by `scale [N]`: `[M, N]` in
    x's dtype. `halves`: x's `split_rows`, where the kernel that made x made them (none:
    split here, a launch of its own). `launch` (all of `launch_for`'s keys; none:
    `launch_for`'s) is for tuning."""
    assert x.dim() == 2 and 1 <= x.shape[0] <= MAX_ROWS and x.stride(1) == 1, x.shape
    assert x.dtype in (torch.float16, torch.bfloat16, torch.float32), x.dtype
    assert weight.dtype == torch.int8 and weight.dim() == 2 and weight.is_contiguous()
    m, (n, k) = x.shape[0], weight.shape
    assert x.shape[1] == k and scale.shape == (n,), (x.shape, weight.shape, scale.shape)
    launch = launch or launch_for(n, k, x.device)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if n == 0 or k == 0:
        return y.zero_()
    q, x_scale = halves or split_rows(x)
    assert q.shape == (2, m, k) and x_scale.shape == (m,), (q.shape, x_scale.shape)
    block_n, block_k = launch["block_n"], launch["block_k"]
    steps = triton.cdiv(k, block_k)
    per_split = triton.cdiv(steps, min(launch["splits"], steps))
    n_splits = triton.cdiv(steps, per_split)
    blocks = triton.cdiv(n, block_n)
    parts = (torch.empty((n_splits, m, n), dtype=torch.float32, device=x.device)
             if n_splits > 1 else y)
    _int8_x16_kernel[(blocks, n_splits)](
        q, x_scale, weight, scale, y, parts,
        launch_counters("int8_x16", x.device, MAX_BLOCKS, blocks), m, n, k, y.stride(0),
        per_split, n_splits, BLOCK_M=block_rows(m),
        BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=k % block_k == 0,
        num_warps=launch["num_warps"], num_stages=launch["num_stages"],
        **dependent_launch.launch_options())
    return y
