"""A residual add and the RMSNorm after it, done in the epilogue of the projection whose
output they take (`gemv.gemv_add_norm`, `rows_mma(..., norm=)`): each program adds its
channels of the projection's rows to the residual stream (in place), and the last
program to finish, as a counter says (`launch_counters`, left at 0), normalises the rows
once.

In its own launch the norm costs a kernel between the projection and the next one (the
q/k/v or gate/up projection), which can start reading its weight only once the norm runs
(dependent launch lets one kernel run ahead, not two): here the next projection's weight
is read while this one runs. (Two forms that moved the norm into the next projection
instead, each program working it out for the whole row again, lost on an H200:
docs/performance.md, sessions 45 and 46.)

Rounded as `rmsnorm.fused_add_rmsnorm` rounds: the projection's output to its dtype, the
sum to the residual's (bit for bit the projection then that kernel), then the norm as
`rmsnorm.normalised` computes it, but for the order in which the squares are summed (over
this launch's warps, a row or two at a time, not the norm kernel's): the same value to
float32 rounding, so the output may differ from that kernel's by an ulp or two (`x * w`
rounds twice) where a product lies on a rounding boundary (bit for bit under the
interpreter, whose sums do not depend on warps).

The last program holds a row or two of the residual and the norm's weight in registers,
with the projection's warps, and goes through the rows in turn: `rows_at_once` keeps that
to FLOATS_PER_THREAD a thread a row (so the projection keeps its registers) and MAX_ROWS
rows (past them the norm's own launch, a program a row, ends sooner).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def add_to_residual(y, res_ptrs, mask):
    """The projection's values `y` (its dtype) added to the residual stream at `res_ptrs`
    (where `mask`), the sum rounded to the residual's dtype and stored back."""
    r = tl.load(res_ptrs, mask=mask, other=0.0)
    tl.store(res_ptrs, (y.to(tl.float32) + r.to(tl.float32)).to(r.dtype), mask=mask)


@triton.jit
def normalise_if_last(res_ptr, stride_res, nw_ptr, out_ptr, stride_out, M, N, counter, eps,
                      OFFSET: tl.constexpr, BLOCK_H: tl.constexpr, ROWS_AT_ONCE: tl.constexpr):
    """Once this program has added its part (every program of the launch's first grid
    dimension does, once): it counts itself in, and the last normalises the M residual
    rows of N values (weights `nw_ptr`) into `out_ptr`, ROWS_AT_ONCE rows a load (one
    round trip to the L2 for each load). Counted in groups of GROUP programs, each on a
    counter of its own (`counter[1 + group]`), the last of each on `counter[0]`, where
    all counted on one: the epilogue then lost 2.1 µs a launch on an H200's 8B o and down
    projections (1,024 programs) and 0.5 on the 1B's (512), same-address atomics the
    suspect (docs/performance.md, session 52)."""
    tl.debug_barrier()  # every thread's part stored before the count releases them
    programs = tl.num_programs(0)
    group = tl.program_id(0) // GROUP
    in_group = tl.minimum(programs - group * GROUP, GROUP)
    if tl.atomic_add(counter + 1 + group, 1, sem="acq_rel") == in_group - 1:
        tl.atomic_xchg(counter + 1 + group, 0, sem="relaxed")
        _normalise_if_last_group(res_ptr, stride_res, nw_ptr, out_ptr, stride_out, M, N,
                                 counter, eps, tl.cdiv(programs, GROUP), OFFSET, BLOCK_H,
                                 ROWS_AT_ONCE)


@triton.jit
def _normalise_if_last_group(res_ptr, stride_res, nw_ptr, out_ptr, stride_out, M, N, counter,
                             eps, groups, OFFSET: tl.constexpr, BLOCK_H: tl.constexpr,
                             ROWS_AT_ONCE: tl.constexpr):
    """The last program of a group (whose count acquired its group's parts) counts the
    group in; the last group's normalises the rows."""
    if tl.atomic_add(counter, 1, sem="acq_rel") == groups - 1:
        cols = tl.arange(0, BLOCK_H)
        w = tl.load(nw_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        if OFFSET != 0.0:
            w = w + OFFSET
        for r0 in range(0, M, ROWS_AT_ONCE):
            rows = r0 + tl.arange(0, ROWS_AT_ONCE)
            inside = (rows[:, None] < M) & (cols[None, :] < N)
            h = tl.load(res_ptr + rows.to(tl.int64)[:, None] * stride_res + cols[None, :],
                        mask=inside, other=0.0, cache_modifier=".cg").to(tl.float32)
            inv_rms = 1.0 / tl.sqrt(tl.sum(h * h, axis=1) / N + eps)
            out = _normalised(h, inv_rms[:, None], w, OFFSET, out_ptr.dtype.element_ty)
            tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_out + cols[None, :], out,
                     mask=inside)
        tl.atomic_xchg(counter, 0, sem="relaxed")


@triton.jit
def _normalised(h, inv_rms, w, OFFSET: tl.constexpr, dtype: tl.constexpr):
    """`rmsnorm.normalised`'s rounding of rows `h` (float32) by `inv_rms`, weights `w`
    (float32, with OFFSET added)."""
    if OFFSET == 0.0:
        return ((h * inv_rms).to(dtype).to(tl.float32) * w).to(dtype)
    return (h * inv_rms * w).to(dtype)


FLOATS_PER_THREAD = 32
MAX_ROWS = 8
GROUP = tl.constexpr(32)
MAX_GROUPS = 1024
COUNTERS = 1 + MAX_GROUPS  # a launch's: the groups', then counter[0]


def counters_for(programs: int) -> int:
    """The counters a launch of `programs` programs (its first grid dimension) uses."""
    return 1 + triton.cdiv(programs, GROUP.value)


def block_for(n: int) -> int:
    """The last program's tile over a row of `n` values."""
    return triton.next_power_of_2(n)


def rows_at_once(n: int, rows: int, num_warps: int) -> int:
    """The rows the last program of a launch of `num_warps` normalises a load, for `rows`
    rows of `n` values: 2 or 1, or 0 where the epilogue does not take them (a row wider
    than FLOATS_PER_THREAD a thread, more than MAX_ROWS rows)."""
    share = block_for(n) // (32 * num_warps)
    if rows > MAX_ROWS or share > FLOATS_PER_THREAD:
        return 0
    return 2 if rows > 1 and 2 * share <= FLOATS_PER_THREAD else 1
