"""A small decode matmul's weight pulled into L2 while the kernel before it still runs
(the GEMV's, `gemv.py`, and rows_mma's, which reads none of its weight before its wait).

Under dependent launch (`dependent_launch.py`) a decode step's kernel is resident, waiting,
while the kernel before it runs; what it reads before its wait (its weight) overlaps that
kernel. A GEMV's program reads its first weight tile there, into registers: a quarter of
an 8B o projection's INT8 weight where the SMs hold four programs each, the rest read
after the wait. The batch-1 attention before an o projection runs for ~5 µs and reads
little: long enough to copy the whole weight into L2 (50 MB on an H100 / H200), which the
GEMV then reads there.

The launch's first programs (one an SM: the first wave) each prefetch `threads` equal
parts of the weight, one bulk prefetch a thread (`cp.async.bulk.prefetch
.L2`, Hopper's copy engine: no registers held, nothing waited for); the parts past the
weight's end are empty. A hint only: nothing the kernel computes depends on it.

For the launches between `prefetch_weights(True)` and `(False)` (`infer.kernels`: the o
projection, `SelfAttention.prefetch_output`) of weights up to MAX_BYTES, where
`set_enabled` (`EngineConfig.l2_prefetch_after_attention`), under dependent launch, on a
GPU. Every small weight prefetched so (a size cap in place of the scope) made an H200's
Llama-3.2-1B INT8 batch-1 step slower, 0.634 -> 0.697 ms: a gate_up or down projection
follows a kernel that reads as fast as the memory allows, where the prefetch only
competes with it (docs/performance.md).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from infer.kernels import dependent_launch, prefetching_weights, sm_count

_enabled = False
MAX_BYTES = 40 << 20  # L2 holds 50 MB; an 8B o projection's 16-bit weight is 33.5 MB
ALIGN = 16  # a bulk prefetch's address and size are multiples of 16 bytes


class Plan(NamedTuple):
    """`threads` parts of `part` bytes a program (0 threads: no prefetch), covering the
    weight's first `total` bytes."""

    threads: int
    part: int
    total: int


NO_PREFETCH = Plan(0, 0, 0)


def set_enabled(on: bool) -> None:
    """Whether the launches `prefetch_weights` names prefetch their weights."""
    global _enabled
    _enabled = on


def plan(weight: torch.Tensor, grid: int, num_warps: int) -> Plan:
    """How a launch of `grid` programs of `num_warps` warps prefetches `weight [N, K]`
    (rows of unit column stride), or NO_PREFETCH."""
    rows, k = weight.shape
    total = ((rows - 1) * weight.stride(0) + k) * weight.element_size() if rows else 0
    if not (_enabled and prefetching_weights() and 0 < total <= MAX_BYTES
            and dependent_launch.enabled()):
        return NO_PREFETCH
    assert weight.data_ptr() % ALIGN == 0, weight.data_ptr()
    programs = min(grid, sm_count(weight.device))
    threads = 32 * num_warps
    part = triton.cdiv(triton.cdiv(total, programs * threads), ALIGN) * ALIGN
    return Plan(threads, part, total)


@triton.jit
def part_of(total, part, program, THREADS: tl.constexpr):
    """The threads' parts of the program `program` (its index in launch order): byte
    offsets and sizes (multiples of ALIGN; size <= 0 where the part starts past `total`)."""
    start = (program * THREADS + tl.arange(0, THREADS)).to(tl.int64) * part
    size = tl.minimum(total - start, part) // 16 * 16
    return start, size.to(tl.int32)


@triton.jit
def prefetch(w_ptr, total, part, program, THREADS: tl.constexpr, PTX: tl.constexpr):
    """The part of the prefetch that `plan` made of the program `program` (its index in
    launch order; THREADS 0: none)."""
    if PTX and THREADS > 0:
        start, size = part_of(total, part, program, THREADS)
        tl.inline_asm_elementwise(
            asm="""{
            .reg .pred p;
            setp.gt.s32 p, $2, 0;
            @p cp.async.bulk.prefetch.L2.global [$1], $2;
            mov.b32 $0, 0;
            }""",
            constraints="=r,l,r", args=[w_ptr.to(tl.pointer_type(tl.int8)) + start, size],
            dtype=tl.int32, is_pure=False, pack=1)
