"""K split over a launch's programs, the last program of a row block adding the parts:
the pieces `rows_mma.py`, `int8_x16.py` and the GGUF kernels (`gguf_gemv._store_rows`)
share.

A program owns one block of output channels and one of `splits` slices of K (`k_slice`).
With more than one slice, each program stores its float32 sums as its slice's part and
counts itself in on its row block's counter (`launch_counters`); the program that counts
last reads every part, adds them and sets the counter back to 0, so the next launch (a
CUDA graph's replay too) finds it as this one did."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def k_slice(pid_s, steps_per_split, K, BLOCK_K: tl.constexpr):
    """The columns `[begin, end)` of K slice `pid_s` (every slice has a step)."""
    begin = pid_s * steps_per_split * BLOCK_K
    return begin, tl.minimum(begin + steps_per_split * BLOCK_K, K)


@triton.jit
def sum_of_parts(acc, parts, part_stride, pid_s, splits, counter, mask):
    """Store this slice's sums `acc` at `parts + pid_s * part_stride` (where `mask`); the
    program whose part came last gets (True, the sum of every slice's part) and resets
    `counter`, the others (False, acc)."""
    tl.store(parts + pid_s * part_stride, acc, mask=mask)
    tl.debug_barrier()  # every thread's part stored before the count releases them
    last = tl.atomic_add(counter, 1, sem="acq_rel") == splits - 1
    total = acc
    if last:
        total = tl.load(parts, mask=mask, other=0.0, cache_modifier=".cg")
        for s in range(1, splits):
            total += tl.load(parts + s * part_stride, mask=mask, other=0.0,
                             cache_modifier=".cg")
        tl.atomic_xchg(counter, 0, sem="relaxed")
    return last, total
