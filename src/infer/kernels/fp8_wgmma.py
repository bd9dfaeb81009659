"""FP8 (e4m3) weights scaled per channel times 1..64 rows of bfloat16 x on Hopper's wgmma,
written in Gluon: `y [M, N] = x [M, K] @ (w [N, K] * scale[:, None])^T`, x as it is
(no FP8 rounding of x: the numbers of the one-row GEMV, products exact and summed in float32).

Why (docs/performance.md): the one-row GEMV (`gemv.py`) makes every FP8 weight a float32 and
multiplies it on the CUDA cores, 5.6 instructions a weight byte compiled for sm_90 against
bfloat16's 1.6-1.9, and the 8B FP8 batch-1 step reads at 80 % of the copy rate against
bfloat16's 94 %; from 2 rows the FP8 paths round x to FP8 too (`rows_mma`, `_scaled_mm`).
Here each weight becomes a bfloat16 in registers (two instructions a weight) and goes to the
wgmma as its register operand; the tensor cores do the multiply-adds.

A program owns 64 channels (the wgmma's M, one warpgroup) and BLOCK_M rows of x (its N, at
least 8: rows past M load as 0), and one of `splits` K slices, 128 of K a step. Each thread
loads 32 contiguous bytes of each of its two rows a step (rows `g` and `g + 8` of its warp's
16, `g` = lane // 4; `t` = lane % 4 picks the 32 bytes); byte `j = 4 s + 2 h + e` of
them, at `k = 32 t + j`, is the wgmma operand's element at `k' = 16 s + 8 h + 2 t + e`, so a
reshape and permutation of the converted tile is the operand's layout (asserted free at
compile time) and x is gathered into the order k' (pairs of e contiguous: 4-byte `cp.async`,
three buffers). The next step's bytes are asked for before this step's wgmma is issued; each
wgmma is waited for at once (ptxas reuses the registers of a register operand still in
flight, triton-lang/triton#9433).

FP8 -> bfloat16 without a convert (`_fp8_to_bf16`): a byte permute spreads two e4m3 bytes
into two 16-bit lanes, sign-extended; a shift and a mask leave each lane `sign << 15 |
(byte & 0x7F) << 4`, the bfloat16 of the value times 2^-120 (e4m3's subnormals bfloat16
subnormals, exactly), and a packed multiply by 2^120 makes it the value. The channel scales
and the K slices' parts are applied as `w8_wgmma.store_sums` does.

A gated MLP's `[gate | up]` weight goes in one launch (`act`): a program's 64 rows are 32
gate channels and their 32 up rows, and once its sums are whole (`w8_wgmma.sum_parts`) they
pass through shared memory so that each thread holds a gate and its up, and `act(gate) * up`
is stored, as the GEMV's gate_up form does at one row.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma

from infer.kernels import launch_counters, sm_count
from infer.kernels.register_wgmma import (
    async_load,
    sums_layout,
    weights_layout,
    x_gather_layout,
    x_shared_layout,
)
from infer.kernels.w8_wgmma import MAX_BLOCKS, barrier, store_sums, sum_parts

MAX_ROWS = 64
BLOCK_K = gl.constexpr(128)


@gluon.jit
def _fp8_to_bf16(words):
    """Words of four e4m3 weights -> the weights as bfloat16, exactly (the module's
    docstring): four tensors, byte 0..3 of each word."""
    return gl.inline_asm_elementwise(
        asm="""{
        .reg .b32 u0, u1, big;
        prmt.b32 u0, $4, 0, 0x9180;
        prmt.b32 u1, $4, 0, 0xB3A2;
        shl.b32 u0, u0, 4;
        shl.b32 u1, u1, 4;
        and.b32 u0, u0, 0x87F087F0;
        and.b32 u1, u1, 0x87F087F0;
        mov.b32 big, 0x7B807B80;
        mul.rn.bf16x2 u0, u0, big;
        mul.rn.bf16x2 u1, u1, big;
        mov.b32 {$0, $1}, u0;
        mov.b32 {$2, $3}, u1;
        }""",
        constraints="=h,=h,=h,=h,r", args=[words],
        dtype=(gl.bfloat16, gl.bfloat16, gl.bfloat16, gl.bfloat16), is_pure=True, pack=1)


@gluon.jit
def _fp8_wgmma_kernel(x_ptr, w_ptr, ws_ptr, y_ptr, part_ptr, counts, M, N, K, pairs_xm,
                      stride_wn, stride_ym, steps_per_split, steps, splits,
                      BLOCK_M: gl.constexpr, EVEN_K: gl.constexpr, GATED: gl.constexpr,
                      num_warps: gl.constexpr):
    """Program (n, s): channels `64 n..`, K steps `s * steps_per_split..` (of `steps`).
    Channels past N read the last one (not stored); rows of x past M load as 0. With GATED
    ("silu" / "gelu_tanh") W is a gated MLP's `[gate | up]`, `[2N, K]`: the program's rows
    are gate channels `32 n..` and their up rows, and it stores `act(gate) * up`."""
    BLOCK_N: gl.constexpr = 64
    # [channel, word of 4 weights]: registers s (words 1..4) and channel 8, lanes t (words
    # 8, 16) and channel 1..4, warps channel 16, 32
    w_layout: gl.constexpr = gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [0, 4], [8, 0]],
        lane_bases=[[0, 8], [0, 16], [1, 0], [2, 0], [4, 0]],
        warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[BLOCK_N, BLOCK_K // 4])
    acc_layout: gl.constexpr = sums_layout(BLOCK_M)
    a_layout: gl.constexpr = weights_layout(BLOCK_M)
    x_layout: gl.constexpr = x_gather_layout()
    x_smem: gl.constexpr = x_shared_layout(BLOCK_M, BLOCK_K)

    pid_n = gl.program_id(0)
    pid_s = gl.program_id(1)
    rn_w = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, w_layout))
    k_w = gl.arange(0, BLOCK_K // 4, layout=gl.SliceLayout(0, w_layout))
    w_rows = (w_ptr + gl.expand_dims(_weight_rows(pid_n, rn_w, N, GATED).to(gl.int64)
                                     * stride_wn, 1)).to(gl.pointer_type(gl.int32), bitcast=True)
    kp = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, x_layout))
    kx = 32 * (kp // 2 % 4) + 4 * (kp // 16) + 2 * (kp // 8 % 2) + kp % 2
    rm = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, x_layout))
    # x's row stride in pairs of elements: every row 4-byte aligned, as cp.async needs
    x_rows = x_ptr + gl.expand_dims(rm.to(gl.int64) * (2 * pairs_xm), 1)
    x_ok = gl.expand_dims(rm < M, 1)
    xs = gl.allocate_shared_memory(gl.bfloat16, [3, BLOCK_M, BLOCK_K], x_smem)

    c0 = pid_s * steps_per_split
    c1 = gl.minimum(c0 + steps_per_split, steps)
    acc = gl.zeros((BLOCK_N, BLOCK_M), dtype=gl.float32, layout=acc_layout)
    w = _load_w(w_rows, k_w, c0 * BLOCK_K, K, EVEN_K)
    _load_x(xs.index(0), x_rows, kx, c0 * BLOCK_K, K, x_ok, EVEN_K)
    async_copy.commit_group()
    for c in range(c0, c1):
        # The next step's bytes are asked for now (the last step's again at the end); its
        # x goes to the buffer the wgmma of two steps back read. Buffers are counted from
        # the slice's first step, whose x went to buffer 0.
        cn = gl.minimum(c + 1, c1 - 1)
        w_next = _load_w(w_rows, k_w, cn * BLOCK_K, K, EVEN_K)
        _load_x(xs.index((c - c0 + 1) % 3), x_rows, kx, cn * BLOCK_K, K, x_ok, EVEN_K)
        async_copy.commit_group()
        b0, b1, b2, b3 = _fp8_to_bf16(w)
        # byte 2 h + e of each word: [channel, word, e, h] (join's new dimension is last)
        wb = gl.join(gl.join(b0, b1), gl.join(b2, b3))
        # [channel, t, s, e, h] -> [channel, s, h, t, e]: k' in order
        tile = gl.permute(gl.reshape(wb, (BLOCK_N, 4, 8, 2, 2)), (0, 2, 4, 1, 3))
        a = gl.convert_layout(gl.reshape(tile, (BLOCK_N, BLOCK_K)), a_layout,
                              assert_trivial=True)
        async_copy.wait_group(1)  # this step's x is in
        fence_async_shared()
        # Waited for at once: ptxas reuses the registers of a wgmma's A operand while it
        # is in flight (triton-lang/triton#9433: a warp's sums came out garbage at random)
        acc = warpgroup_mma(a, xs.index((c - c0) % 3).permute((1, 0)), acc)
        w = w_next
    async_copy.wait_group(0)
    # every thread's last copy has landed before the gated store's buffer (which may
    # share the x buffers' memory) is written
    barrier()

    rm_out = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, acc_layout))
    if GATED != "":
        _store_gated(acc, pid_n, rm_out, ws_ptr, y_ptr, part_ptr, counts, pid_s, splits,
                     M, N, stride_ym, BLOCK_M, GATED)
    else:
        rn = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, acc_layout))
        store_sums(acc, 1.0, rn, rm_out, ws_ptr, y_ptr, part_ptr, counts, pid_n, pid_s,
                   splits, M, N, stride_ym)


@gluon.jit
def _weight_rows(pid_n, r, N, GATED: gl.constexpr):
    """The rows of W that program pid_n's rows `r` (0..63) read: channels `64 pid_n + r`
    (past N the last); with GATED gate rows `32 pid_n + r` for r < 32 and their up rows
    `N + 32 pid_n + r - 32` (past N the last of each)."""
    if GATED != "":
        return r // 32 * N + gl.minimum(32 * pid_n + r % 32, N - 1)
    return gl.minimum(64 * pid_n + r, N - 1)


@gluon.jit
def _store_gated(total, pid_n, rm, ws_ptr, y_ptr, part_ptr, counts, pid_s, splits, M, N,
                 stride_ym, BLOCK_M: gl.constexpr, ACT: gl.constexpr):
    """`act(gate) * up` of the sums `total [64, rows rm]` (32 gate rows, then their up
    rows; `store_sums` for one channel set) at `y [M, N]`, columns `32 pid_n..`."""
    r = gl.arange(0, 64, layout=gl.SliceLayout(1, total.type.layout))
    c = 32 * pid_n + r % 32
    # rows of channels past N are left out of the parts (their places belong to others)
    rows = gl.where(c < N, r // 32 * N + c, 2 * N)
    total, last = sum_parts(total, rows, rm, part_ptr, counts, pid_n, pid_s, splits, M,
                            2 * N)
    exchange = gl.allocate_shared_memory(gl.float32, [64, BLOCK_M], gl.SwizzledSharedLayout(
        vec=1, per_phase=1, max_phase=1, order=[1, 0]))
    if last:
        ws = gl.load(ws_ptr + rows, mask=rows < 2 * N, other=0.0).to(gl.float32)
        exchange.store(total * gl.expand_dims(ws, 1))
        barrier()  # each thread reads rows other threads stored
        half: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 1], threads_per_warp=[32, 1],
                                              warps_per_cta=[1, 4], order=[0, 1])
        gate = exchange.slice(0, 32).load(half)
        up = exchange.slice(32, 32).load(half)
        cy = 32 * pid_n + gl.arange(0, 32, layout=gl.SliceLayout(1, half))
        my = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, half))
        y = y_ptr + gl.expand_dims(my.to(gl.int64) * stride_ym, 0) + gl.expand_dims(cy, 1)
        gl.store(y, _gated(gate, up, ACT).to(y_ptr.dtype.element_ty),
                 mask=gl.expand_dims(my < M, 0) & gl.expand_dims(cy < N, 1))


@gluon.jit
def _gated(gate, up, ACT: gl.constexpr):
    """`act(gate) * up` in float32 (`activation.gated`'s numbers: Gluon kernels cannot call
    Triton ones): silu, or gelu's tanh form as `g sigmoid(2 z)`."""
    if ACT == "silu":
        return gate / (1.0 + gl.exp(-gate)) * up
    z = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
    return gate / (1.0 + gl.exp(-2.0 * z)) * up


@gluon.jit
def _load_w(w_rows, k_w, k0, K, EVEN_K: gl.constexpr):
    """The weight tile's words (of four bytes) at K columns `k0..k0 + 128`, zeros past K
    (K a multiple of 4)."""
    at = w_rows + gl.expand_dims(k0 // 4 + k_w, 0)
    if EVEN_K:
        return gl.load(at)
    return gl.load(at, mask=gl.expand_dims(k0 + 4 * k_w < K, 0), other=0)


@gluon.jit
def _load_x(buffer, x_rows, kx, k0, K, x_ok, EVEN_K: gl.constexpr):
    """x's rows at K columns `k0 + kx` into `buffer` (cp.async), zeros past M and K."""
    at = x_rows + gl.expand_dims(k0 + kx, 0)
    if EVEN_K:
        async_load(buffer, at, mask=x_ok)
    else:
        async_load(buffer, at, mask=x_ok & gl.expand_dims(k0 + kx < K, 0))


def default_launch(n: int, k: int, device: torch.device) -> dict[str, int]:
    """K split so that the launch has about two programs per multiprocessor (not yet
    swept: `benchmarks/w8_wgmma_sweep.py`)."""
    blocks = triton.cdiv(n, 64)
    steps = triton.cdiv(k, BLOCK_K.value)
    return dict(splits=max(1, min(8, steps // 4, (2 * sm_count(device)) // blocks)))


def fp8_wgmma(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, *,
              act: str | None = None, splits: int | None = None) -> torch.Tensor:
    """`x [M, K]` (bfloat16, M <= 64, unit column stride, 4-byte aligned rows) times the
    transpose of the FP8 `weight [N, K]` (contiguous) scaled per channel by `scale [N]`:
    `[M, N]` bfloat16. With `act` ("silu" / "gelu_tanh") the weight is a gated MLP's
    `[gate | up]` and the result `act(gate) * up`, `[M, N / 2]`, from the same launch.
    `splits`: K slices (none: `default_launch`'s), for tuning."""
    m, k = x.shape
    rows = weight.shape[0]
    assert x.dtype == torch.bfloat16 and 1 <= m <= MAX_ROWS and x.stride(1) == 1, x.shape
    # one row's stride is any (is_contiguous ignores it) and never read: passed as 0
    pairs = x.stride(0) // 2 if m > 1 else 0
    assert k % 4 == 0 and (m == 1 or x.stride(0) % 2 == 0) and x.data_ptr() % 4 == 0, \
        "x in 4-byte pairs"
    assert weight.dtype == torch.float8_e4m3fn and weight.is_contiguous() \
        and weight.shape[1] == k and scale.shape == (rows,), (weight.shape, scale.shape)
    assert act in (None, "silu", "gelu_tanh") and (act is None or rows % 2 == 0), act
    n = rows // 2 if act else rows
    splits = splits or default_launch(rows, k, x.device)["splits"]
    steps = triton.cdiv(k, BLOCK_K.value)
    per_split = triton.cdiv(steps, min(splits, steps))
    splits = triton.cdiv(steps, per_split)
    blocks = triton.cdiv(n, 32 if act else 64)
    y = torch.empty((m, n), dtype=torch.bfloat16, device=x.device)
    parts = torch.empty((splits, m, rows), dtype=torch.float32, device=x.device) \
        if splits > 1 else y
    _fp8_wgmma_kernel[(blocks, splits)](
        x, weight, scale, y, parts, launch_counters("fp8_wgmma", x.device, MAX_BLOCKS, blocks),
        m, n, k, pairs, weight.stride(0), y.stride(0), per_split, steps, splits,
        BLOCK_M=min(64, max(8, triton.next_power_of_2(m))), EVEN_K=k % BLOCK_K.value == 0,
        GATED=act or "", num_warps=4)
    return y
