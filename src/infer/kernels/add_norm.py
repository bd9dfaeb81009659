"""A residual add and the RMSNorm after it, done in the epilogue of the projection whose
output they take (`gemv.gemv_add_norm`): each program adds its channels of the
projection's row to the residual stream (in place), and the last program to finish, as
a counter says (`launch_counters`, left at 0), normalises the whole row once.

In its own launch the norm costs a kernel between the projection and the next one (the
q/k/v or gate/up projection), which can start reading its weight only once the norm runs
(dependent launch lets one kernel run ahead, not two): here the next projection's weight
is read while this one runs. (Two forms that moved the norm into the next projection
instead, each program working it out for the whole row again, lost on an H200:
docs/performance.md, sessions 45 and 46.)

Rounded as `rmsnorm.fused_add_rmsnorm` rounds: the projection's output to its dtype, the
sum to the residual's, then `rmsnorm.normalised`: bit for bit the projection then that
kernel.
"""

from __future__ import annotations

import triton
import triton.language as tl

from infer.kernels.rmsnorm import normalised


@triton.jit
def add_norm_epilogue(y, rn, N, res_ptr, nw_ptr, out_ptr, counter, eps,
                      OFFSET: tl.constexpr, BLOCK_H: tl.constexpr):
    """This program's channels `rn` of the projection's row, `y` (its dtype), added to
    the residual row at `res_ptr` (N values, stored back); the last program of the launch
    stores the norm of the whole residual row, weights `nw_ptr`, at `out_ptr`."""
    mask = rn < N
    r = tl.load(res_ptr + rn, mask=mask, other=0.0)
    tl.store(res_ptr + rn, (y.to(tl.float32) + r.to(tl.float32)).to(r.dtype), mask=mask)
    tl.debug_barrier()  # every thread's channels stored before the count releases them
    programs = tl.num_programs(0)
    if tl.atomic_add(counter, 1, sem="acq_rel") == programs - 1:
        cols = tl.arange(0, BLOCK_H)
        inside = cols < N
        h = tl.load(res_ptr + cols, mask=inside, other=0.0, cache_modifier=".cg")
        w = tl.load(nw_ptr + cols, mask=inside, other=0.0).to(tl.float32)
        out = normalised(h.to(tl.float32), w, N, eps, OFFSET, out_ptr.dtype.element_ty)
        tl.store(out_ptr + cols, out, mask=inside)
        tl.atomic_xchg(counter, 0, sem="relaxed")


def block_for(n: int) -> int:
    """The last program's tile over a row of `n` values."""
    return triton.next_power_of_2(n)
