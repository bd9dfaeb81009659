"""GGUF Q4_K and Q6_K at 2..64 rows of bfloat16 `x` on Hopper's wgmma, written in Gluon
(Triton's dialect with explicit layouts): the decoded weights go to the wgmma as its
register operand, never through shared memory, and the next super-block's bytes are on
their way while one is decoded and multiplied (each wgmma waited for at once: ptxas reuses
the registers of a register operand still in flight, triton-lang/triton#9433); the K slices'
sums are added by the launch's last program of each channel block. What differs by type
(where a thread's values lie in a super-block, how they become floats, x's order) is in
`gguf_q4k_wgmma.py` and `gguf_q6k_wgmma.py`.

Why (docs/performance.md, session 64): gguf_gemm.py's `tl.dot` stages the decoded tile through
shared memory (store, barrier, `ldmatrix`) and waits on every wgmma, so each program's steps
run in series; with 4 programs a multiprocessor (its shared memory) and 0.85 of a wave, the
8B gate_up at 32 rows issues on 41 % of cycles and reads at 24 % of DRAM bandwidth.

A program owns 64 rows of W (the wgmma's M, one warpgroup of 4 warps) and up to 64 rows of x
(its N), one super-block (256 of K) a step. A thread holds, for 2 rows of W, the values of
words 4g + t (g < 8) of a super-block's 4-bit fields (`words_layout`: lane 4 (row % 8) + t,
registers row + 8 and g), each word's bytes e and nibbles h; joined over e and h and
reordered, they are exactly the wgmma A operand's registers for the order
`k' = 128 h + 16 g + 8 (e // 2) + 2 t + e % 2` (the conversion is asserted free at compile
time); x's tile is gathered in that order (pairs of e contiguous: 4-byte `cp.async`, three
buffers).

Gluon is experimental: importing this module fails on a Triton without Gluon's Hopper calls
(`kernels.gluon_hopper` asks).
"""

from __future__ import annotations

import torch
import triton
from gguf import GGMLQuantizationType as QType
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma

from infer.kernels import gguf_q4k_wgmma as q4k
from infer.kernels import gguf_q6k_wgmma as q6k
from infer.kernels import launch_counters, sm_count
from infer.kernels.gguf_gemm import UNITS_OF
from infer.kernels.register_wgmma import (
    async_load,
    sums_layout,
    weights_layout,
    x_gather_layout,
    x_shared_layout,
)
from infer.kernels.w8_wgmma import MAX_BLOCKS, sum_parts

ONE = 0x3F800000  # 1.0 as float32 bits
MAX_ROWS = 64  # x's rows: one program's wgmma N
Q4_K = gl.constexpr(int(QType.Q4_K))


@gluon.constexpr_function
def words_layout():
    """A super-block's words of 4-bit fields, `[64 rows, 8 g, 4 t]` (word 4g + t)."""
    return gl.DistributedLinearLayout(
        reg_bases=[[8, 0, 0], [0, 1, 0], [0, 2, 0], [0, 4, 0]],
        lane_bases=[[0, 0, 1], [0, 0, 2], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
        warp_bases=[[16, 0, 0], [32, 0, 0]], block_bases=[], shape=[64, 8, 4])


@gluon.jit
def _gguf_wgmma_kernel(x_ptr, q_ptr, y_ptr, part_ptr, counts, M, N, K, pairs_xm, stride_qn,
                       stride_ym, units_per_split, splits, one, QTYPE: gl.constexpr,
                       BLOCK_M: gl.constexpr, num_warps: gl.constexpr):
    """Program (n, s): rows `64 n..` of W (words at q_ptr: Q4_K 32-bit, Q6_K 16-bit), every
    row of x (M <= BLOCK_M), super-blocks `s * units_per_split..` of K; the slices' float32
    sums added by the last program of the channel block (`w8_wgmma.sum_parts`) and stored
    at `y [M, N]` as bfloat16. Rows of W past N read the last row (not stored); rows of x
    past M load as 0."""
    BLOCK_N: gl.constexpr = 64
    layout: gl.constexpr = words_layout()
    row_layout: gl.constexpr = gl.SliceLayout(2, layout)
    acc_layout: gl.constexpr = sums_layout(BLOCK_M)
    a_layout: gl.constexpr = weights_layout(BLOCK_M)
    x_layout: gl.constexpr = x_gather_layout()
    x_smem: gl.constexpr = x_shared_layout(BLOCK_M, 256)

    pid_n = gl.program_id(0)
    pid_s = gl.program_id(1)
    rows = gl.arange(0, 64, layout=gl.SliceLayout(1, row_layout))
    g = gl.expand_dims(gl.arange(0, 8, layout=gl.SliceLayout(0, row_layout)), 0)
    t = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, layout)))
    t = gl.expand_dims(gl.expand_dims(t, 0), 1)
    row_ptr = q_ptr + gl.minimum(pid_n * BLOCK_N + rows, N - 1).to(gl.int64) * stride_qn
    # x's tile [BLOCK_M, 256] in the order k' of the weights' registers
    kp = gl.arange(0, 256, layout=gl.SliceLayout(0, x_layout))
    if QTYPE == Q4_K:
        word_off, c = q4k.offsets(g, t)
        kx = q4k.x_order(kp)
    else:
        ql_off, qh_off, sc_off = q6k.offsets(g, t)
        kx = q6k.x_order(kp)
    rm = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, x_layout))
    # x's row stride in pairs of elements: every row 4-byte aligned, as cp.async needs
    x_rows = x_ptr + gl.expand_dims(rm.to(gl.int64) * (2 * pairs_xm), 1)
    x_ok = gl.expand_dims(rm < M, 1)
    xs = gl.allocate_shared_memory(gl.bfloat16, [3, BLOCK_M, 256], x_smem)

    u0 = pid_s * units_per_split
    u1 = gl.minimum(u0 + units_per_split, K // 256)
    acc = gl.zeros((BLOCK_N, BLOCK_M), dtype=gl.float32, layout=acc_layout)
    # a super-block's bytes as each type loads them: five tensors
    if QTYPE == Q4_K:
        p0, p1, p2, p3, p4 = q4k.load_unit(row_ptr, word_off, u0)
    else:
        p0, p1, p2, p3, p4 = q6k.load_unit(row_ptr, ql_off, qh_off, sc_off, u0)
    async_load(xs.index(0), x_rows + gl.expand_dims(u0 * 256 + kx, 0), mask=x_ok)
    async_copy.commit_group()
    for u in range(u0, u1):
        # The next super-block's bytes are asked for now and used in the next iteration;
        # its x goes to the buffer that the wgmma of two super-blocks back read. Buffers
        # are counted from the slice's first super-block, whose x went to buffer 0.
        un = gl.minimum(u + 1, u1 - 1)
        if QTYPE == Q4_K:
            n0, n1, n2, n3, n4 = q4k.load_unit(row_ptr, word_off, un)
        else:
            n0, n1, n2, n3, n4 = q6k.load_unit(row_ptr, ql_off, qh_off, sc_off, un)
        async_load(xs.index((u - u0 + 1) % 3), x_rows + gl.expand_dims(un * 256 + kx, 0),
                   mask=x_ok)
        async_copy.commit_group()
        if QTYPE == Q4_K:
            values = q4k.decode(p0, p1, p2, p3, p4, c, one)
        else:
            values = q6k.decode(p0, p1, p2, p3, p4, g, one)
        # [row, g, t, e % 2, e // 2, h] -> [row, h, g, e // 2, t, e % 2]: k' in order
        tile = gl.permute(values, (0, 5, 1, 4, 2, 3))
        a = gl.convert_layout(gl.reshape(tile, (BLOCK_N, 256)).to(gl.bfloat16), a_layout,
                              assert_trivial=True)
        async_copy.wait_group(1)  # this super-block's x is in
        fence_async_shared()
        # Waited for at once: ptxas reuses the registers of a wgmma's A operand while it
        # is in flight (triton-lang/triton#9433: a warp's sums came out garbage at random)
        acc = warpgroup_mma(a, xs.index((u - u0) % 3).permute((1, 0)), acc)
        p0, p1, p2, p3, p4 = n0, n1, n2, n3, n4
    async_copy.wait_group(0)  # the last iteration's copy (of the last super-block again)
    out_m = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, acc_layout))
    out_n = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, acc_layout))
    total, last = sum_parts(acc, out_n, out_m, part_ptr, counts, pid_n, pid_s, splits, M, N)
    if last:
        y = y_ptr + gl.expand_dims(out_m.to(gl.int64) * stride_ym, 0) + gl.expand_dims(out_n, 1)
        gl.store(y, total.to(gl.bfloat16),
                 mask=gl.expand_dims(out_m < M, 0) & gl.expand_dims(out_n < N, 1))


def default_split(rows: int, n: int, cols: int, device: torch.device) -> int:
    """K slices for `rows` rows of x and `n` of W. Swept on an H100 (8B shapes at 8 / 16 /
    32 / 64 rows, weights cycled past L2; benchmarks/quantized_gemv.py --gemm-sweep times
    the rule beside half and twice it): 4 slices where the programs stay few (Q4_K q/k/v,
    o, down: 12-15 / 12-14 / 29-32 us at 8-32 rows against gguf_gemm's 22-25 / 18-19 /
    42-43; Q6_K o and down likewise best at 4), fewer as the programs a multiprocessor
    holds shrink with the rows (Q4_K gate_up: 2 slices at 8-16 rows, 51-52 us, one at 32,
    65 us, against 80-84)."""
    blocks = triton.cdiv(n, 64)
    limit = (8 if rows <= 16 else 4 if rows <= 32 else 2) * sm_count(device)
    split = 1
    while split < 4 and 2 * split <= cols // 256 and 2 * split * blocks <= limit:
        split *= 2
    return split


def gguf_wgmma(x: torch.Tensor, words: torch.Tensor, qtype: QType, cols: int, *,
               split: int | None = None, maxnreg: int | None = None) -> torch.Tensor:
    """`x [M, cols]` (bfloat16, up to 64 rows, 4-byte aligned rows) times the transpose of
    the Q4_K or Q6_K weight `words [N, cols / 256 * UNITS_OF[qtype][1]]`
    (gguf_gemm.gemm_words: Q4_K 32-bit, Q6_K 16-bit), K split over `split` programs a
    channel block (none: `default_split`'s): `[M, N]` bfloat16. `maxnreg` caps the
    registers a thread (for tuning)."""
    assert x.dtype == torch.bfloat16 and x.stride(1) == 1 and cols % 256 == 0, (
        x.dtype, x.stride(), cols)
    assert x.stride(0) % 2 == 0 and x.data_ptr() % 4 == 0, "x in 4-byte pairs"
    qtype = QType(qtype)
    assert qtype in (QType.Q4_K, QType.Q6_K), qtype.name
    assert words.shape[1] == cols // 256 * UNITS_OF[qtype][1], (qtype.name, words.shape)
    assert words.dtype == (torch.int32 if qtype == QType.Q4_K else torch.int16), words.dtype
    m, n = x.shape[0], words.shape[0]
    assert m <= MAX_ROWS, m
    units = cols // 256
    split = split or default_split(m, n, cols, x.device)
    per_split = triton.cdiv(units, max(1, min(split, units)))
    split = triton.cdiv(units, per_split)
    blocks = triton.cdiv(n, 64)
    y = torch.empty((m, n), dtype=torch.bfloat16, device=x.device)
    parts = torch.empty((split, m, n), dtype=torch.float32, device=x.device) \
        if split > 1 else y
    if m and n:
        _gguf_wgmma_kernel[(blocks, split)](
            x, words, y, parts, launch_counters("gguf_wgmma", x.device, MAX_BLOCKS, blocks),
            m, n, cols, x.stride(0) // 2, words.stride(0), y.stride(0), per_split, split, ONE,
            QTYPE=int(qtype), BLOCK_M=min(MAX_ROWS, max(16, triton.next_power_of_2(m))),
            num_warps=4, **({} if maxnreg is None else {"maxnreg": maxnreg}))
    return y
