"""A few rows times a weight on tensor cores: `y [M, N] = x [M, K] @ W^T` for M up to 64,
float32 accumulation, W either 16-bit (x's dtype) or 8-bit (int8, or FP8 e4m3 on a GPU)
with `W = w * scale[:, None]`, a scale per output channel or per tile of the weight (as
block-wise FP8 checkpoints store it: each K step's sums scaled by its tile's).

Decode's matmuls read each weight once per step. On the CUDA cores that costs instructions
for every weight: the one-row GEMV (`gemv.py`) issues 1.7 a weight byte, the W8A16 kernel
(`w8a16_matmul.py`) 4.25 for INT8 (each weight made a float32 first), and a CUDA-core
kernel for 5 rows 8.6 (`benchmarks/sass_mix.py`): past the issue rate the SMs have at the
copy rate. Here an MMA multiplies a [16, BLOCK_K] tile of x (32 or 64 rows for more than
16; the real rows, zeros below; one row is broadcast from a vector, so it is loaded and
converted once) by the weight tile: a 16-bit weight as it is (~0.5 instructions a byte),
an 8-bit one made float16 two at a time (INT8: a byte under the bits of 1024 and 1024 + 128
taken off, both exact in float16; FP8: the hardware's pairwise convert), with x made
float16 too (~3.1 and ~2.3 a byte). With BF16_W (`set_bf16_8bit`; two or more rows of
bfloat16 x on a GPU) the weights are made bfloat16 by their bits instead and x stays as it
is (FP8 times 2^64, their products times 2^-120 undone once): no convert instruction, which an
H100 issues at 16 values a cycle per SM, where x's in the MMA's operand layout (each warp
converting all of x's tile) were half of them.

8-bit exactness: products of float16 weights (integers up to 128, or FP8 values) and x are
exact in the MMA's float32 accumulator; x is exact in float16 for |x| between 2^-14 and
65504 (bf16 has 8 significant bits, float16 11). Smaller |x| keep an absolute error of at
most 2^-25 (a float16 subnormal's half step): a dot product moves by at most
2^-25 * sum |w|, below the output's rounding. A row block whose x has any |x| above 65504
is multiplied again on the CUDA cores in float32, so no overflow reaches y.

FP8 by FP8 (`x_scale`: x given in FP8, quantized per row by `fp8_quant.py` once per step,
and FP8 weights scaled per channel): both operands go to the MMA as FP8, no weight
converted (~1.2 instructions a byte). Hopper's FP8 MMA takes 64 rows on its first operand,
so the weight tile is that operand and x's rows the other (the sums come out transposed);
its sums are promoted to float32 each K step (it keeps fewer bits across steps). (A first
form quantized x inside the kernel: every program then passed over all of x for its rows'
scales, which cost more than the MMA saved.)

A program owns BLOCK_N output channels and one of `splits` slices of K; the last program of a
row block to finish adds the slices' float32 parts, scales and stores them (a counter per row
block, left at 0 for the next launch), so the launch needs no second kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from infer.kernels import dependent_launch, gpu_compiled, launch_counters, sm_count
from infer.kernels.activation import gated
from infer.kernels.gemv import _row, _weights
from infer.kernels.split_k import k_slice, sum_of_parts
from infer.kernels.weight_cast import BF16_FP8_UNDO, to_bf16_times, to_float

MAX_ROWS = 64
BLOCK_N, BLOCK_K = 128, 128  # the default launch
F16_MAX = tl.constexpr(65504.0)  # float16's largest finite value
# With BF16_W, FP8 weights' x times X_UP (bfloat16, exact): products of weights times
# 2^-120 (`to_bf16_times`) stay float32 normals; |x| from 2^64 on overflows (the float32
# path then).
X_UP = tl.constexpr(2.0 ** 64)


@triton.jit
def _to_f16(w, PTX: tl.constexpr):
    """8-bit weights as float16, exactly."""
    if w.dtype == tl.int8 and PTX:
        return _int8_to_f16_ptx(w)
    return w.to(tl.float16)


@triton.jit
def _int8_to_f16_ptx(w):
    """Four int8 weights of a register as two float16 pairs: one xor adds 128 to all four
    (as bytes), one `prmt` per pair puts two bytes under float16's 1024 (0x64nn = 1024 + nn),
    one paired subtraction takes 1024 + 128 away."""
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 t, m;
        xor.b32 t, $2, 0x80808080;
        mov.b32 m, 0x64806480;
        prmt.b32 $0, t, 0x64646464, 0x5140;
        prmt.b32 $1, t, 0x64646464, 0x7342;
        sub.f16x2 $0, $0, m;
        sub.f16x2 $1, $1, m;
        }""",
        constraints="=r,=r,r", args=[w], dtype=tl.float16, is_pure=True, pack=4)


@triton.jit
def _times_x_up(x):
    """bfloat16 x times X_UP (2^64), two values an instruction."""
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 up, nzero;
        mov.b32 up, 0x5F805F80;
        mov.b32 nzero, 0x80008000;
        fma.rn.bf16x2 $0, $1, up, nzero;
        }""",
        constraints="=r,r", args=[x], dtype=tl.bfloat16, is_pure=True, pack=2)


@triton.jit
def _x_for_bf16(x, w):
    """bfloat16 x as BF16_W multiplies it by 8-bit weights `w`: FP8 ones' times X_UP."""
    if w.dtype == tl.float8e4nv:
        return _times_x_up(x)
    return x


@triton.jit
def _x_rows(x_ptr, stride_xm, M, kk, K, EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr):
    """x's columns kk, [BLOCK_M, len(kk)] (rows past M and columns past K: 0)."""
    rm = tl.arange(0, BLOCK_M)
    mask = rm[:, None] < M
    if not EVEN_K:
        mask = mask & (kk[None, :] < K)
    at = x_ptr + rm.to(tl.int64)[:, None] * stride_xm + kk[None, :]
    return tl.load(at, mask=mask, other=0.0)


@triton.jit
def _cuda_core_rows(x_ptr, w_rows, s_row, stride_xm, M, k_begin, k_end, K,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, STEP: tl.constexpr,
                    SCALE_COLS: tl.constexpr, PTX: tl.constexpr):
    """The same [BLOCK_M, BLOCK_N] sums over K in [k_begin, k_end), x and the weights as
    float32, one row at a time, in short K steps (few registers: the overflow path); with
    tile scales (`s_row`: the program's row of them), each step's weights scaled."""
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, STEP)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r in range(0, M):
        part = tl.zeros((BLOCK_N, STEP), dtype=tl.float32)
        for k0 in range(k_begin, k_end, STEP):
            kk = k0 + rk
            w = to_float(tl.load(w_rows + kk[None, :], mask=kk[None, :] < K, other=0.0), PTX)
            if SCALE_COLS > 0:
                w *= tl.load(s_row + k0 // SCALE_COLS)
            x = _row(x_ptr + r * stride_xm, kk, K, False).to(tl.float32)
            part += w * x[None, :]
        acc = tl.where(rm[:, None] == r, tl.sum(part, axis=1)[None, :], acc)
    return acc


@triton.jit
def _scaled(acc, s_ptr, wn, x_scale, SCALE: tl.constexpr, SCALE_COLS: tl.constexpr,
            FP8_X: tl.constexpr):
    """The float32 sums times what is left of their scales: the channels' (weight rows
    `wn`; tile scales were applied each K step) and, with FP8_X, the rows'."""
    if SCALE and SCALE_COLS == 0:
        acc *= tl.load(s_ptr + wn).to(tl.float32)[None, :]
    if FP8_X:
        acc = acc * x_scale[:, None]
    return acc


@triton.jit
def _store(acc, y_ptr, stride_ym, rm, M, pid_n, N, BLOCK_N: tl.constexpr,
           GATE_UP: tl.constexpr):
    """The program's sums `acc [BLOCK_M, BLOCK_N]`, rounded to y's dtype; with GATE_UP,
    `act(gate) * up` of each channel's column pair (rounded as `activation.gated_rows`
    rounds what it reads and stores)."""
    y = acc.to(y_ptr.dtype.element_ty)
    if GATE_UP == "":
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    else:
        rn = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        gate, up = tl.split(tl.reshape(y, (y.shape[0], BLOCK_N // 2, 2)))
        y = gated(gate, up, GATE_UP).to(y_ptr.dtype.element_ty)
    y_rows = y_ptr + rm.to(tl.int64)[:, None] * stride_ym + rn[None, :]
    tl.store(y_rows, y, mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit
def _rows_mma_kernel(
    x_ptr, w_ptr, s_ptr, xs_ptr, y_ptr, part_ptr, counts,
    M, N, K, stride_xm, stride_wn, stride_ym, stride_sn, steps_per_split, splits,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SCALE: tl.constexpr, SCALE_ROWS: tl.constexpr, SCALE_COLS: tl.constexpr,
    EVEN_K: tl.constexpr, ONE_ROW: tl.constexpr, PTX: tl.constexpr,
    FP8_X: tl.constexpr, W_FIRST: tl.constexpr, GATE_UP: tl.constexpr, BF16_W: tl.constexpr,
    PDL: tl.constexpr,
):
    """SCALE: the weight is 8-bit, scaled per channel (SCALE_COLS 0) or per tile; else it
    is 16-bit, x's dtype, unscaled. FP8_X (FP8 weights scaled per channel): x is FP8 (its
    bytes, as int8), scaled per row by `xs_ptr`'s, and multiplied FP8 by FP8. W_FIRST (always
    with FP8_X): the weight tile is the MMA's first operand, the sums come out transposed.
    GATE_UP ("silu" / "gelu_tanh"; never with tile scales): the weight is a gated MLP's
    `[gate | up]`, 2N rows, and y gets `act(gate) * up`, N channels. BF16_W (8-bit weights,
    bfloat16 x): the weights made bfloat16 by their bits and x left bfloat16 (FP8's times
    X_UP), no convert instruction."""
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    r = tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    rm = tl.arange(0, BLOCK_M)
    k_begin, k_end = k_slice(pid_s, steps_per_split, K, BLOCK_K)
    # The tile's columns (its weight rows), and where they lie in the parts `[M, N]`, or
    # with GATE_UP `[M, 2N]`: column 2c gate channel c's, 2c + 1 up channel c's.
    rn = pid_n * BLOCK_N + r
    if GATE_UP == "":
        in_n = rn < N
        wn = tl.minimum(rn, N - 1)
    else:
        channel = pid_n * (BLOCK_N // 2) + r // 2
        in_n = channel < N
        wn = tl.minimum(channel, N - 1) + (r % 2) * N
    # Columns past N read row N - 1 (no mask on the weight's loads) and are not stored.
    w_rows = w_ptr + wn.to(tl.int64)[:, None] * stride_wn
    # Tile scales (SCALE_COLS > 0): the program's rows and each K step lie in one tile.
    s_row = s_ptr + (pid_n * BLOCK_N // SCALE_ROWS) * stride_sn
    dependent_launch.wait(PDL)
    dependent_launch.release(PDL)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if ONE_ROW:
        x_max = tl.zeros((BLOCK_K,), dtype=tl.float32)
    else:
        x_max = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
    x_scale = 1.0
    if FP8_X:
        x_scale = tl.load(xs_ptr + rm, mask=rm < M, other=0.0)
    if W_FIRST:
        # Hopper's warp-group MMA takes 64 rows at a time on its first operand (and FP8
        # only so): the weight's, x's rows the second operand's columns.
        acc_t = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        kk = k0 + rk
        w = _weights(w_rows, kk, K, EVEN_K)
        if FP8_X:  # bytes, zeros past the rows
            x = _x_rows(x_ptr, stride_xm, M, kk, K, EVEN_K, BLOCK_M)
            x = x.to(tl.float8e4nv, bitcast=True)
        elif ONE_ROW:  # one vector, broadcast: loaded and converted once, not per padded row
            x1 = _row(x_ptr, kk, K, EVEN_K)
            if BF16_W:
                x1 = _x_for_bf16(x1, w)
            elif SCALE:
                x_max = tl.maximum(x_max, tl.abs(x1.to(tl.float32)))
                x1 = x1.to(tl.float16)
            x = tl.where(rm[:, None] == 0, x1[None, :], 0.0).to(x1.dtype)
        else:
            x = _x_rows(x_ptr, stride_xm, M, kk, K, EVEN_K, BLOCK_M)
            if BF16_W:
                x = _x_for_bf16(x, w)
            elif SCALE:
                x_max = tl.maximum(x_max, tl.abs(x.to(tl.float32)))
                x = x.to(tl.float16)
        if FP8_X:  # Hopper's FP8 MMA sums in less than float32: promoted each K step
            acc_t = tl.dot(w, tl.trans(x), acc_t, max_num_imprecise_acc=BLOCK_K)
        else:
            if BF16_W:
                w = to_bf16_times(w, PTX)
            elif SCALE:
                w = _to_f16(w, PTX)
            if SCALE_COLS > 0:
                tile_scale = tl.load(s_row + k0 // SCALE_COLS)
                if W_FIRST:
                    acc_t += tl.dot(w, tl.trans(x)) * tile_scale
                else:
                    acc += tl.dot(x, tl.trans(w)) * tile_scale
            elif W_FIRST:
                acc_t = tl.dot(w, tl.trans(x), acc_t)
            else:
                acc = tl.dot(x, tl.trans(w), acc)
    if W_FIRST:
        acc = tl.trans(acc_t)
    if BF16_W:
        if w_ptr.dtype.element_ty == tl.float8e4nv:
            acc *= BF16_FP8_UNDO / X_UP
        if tl.max(tl.abs(acc)) == float("inf") or tl.max((acc != acc).to(tl.int32)) != 0:
            # an x overflowed (times X_UP) or was not finite: this part in float32
            acc = _cuda_core_rows(x_ptr, w_rows, s_row, stride_xm, M, k_begin, k_end, K,
                                  BLOCK_M, BLOCK_N, 32, SCALE_COLS, PTX)
    elif SCALE and not FP8_X:  # noqa: SIM102 (constexpr; the test below runs)
        if tl.max(x_max) > F16_MAX:  # an |x| overflowed float16: this part again, in float32
            acc = _cuda_core_rows(x_ptr, w_rows, s_row, stride_xm, M, k_begin, k_end, K,
                                  BLOCK_M, BLOCK_N, 32, SCALE_COLS, PTX)
    if splits == 1:
        acc = _scaled(acc, s_ptr, wn, x_scale, SCALE, SCALE_COLS, FP8_X)
        _store(acc, y_ptr, stride_ym, rm, M, pid_n, N, BLOCK_N, GATE_UP)
    else:
        width = N if GATE_UP == "" else 2 * N
        parts = part_ptr + rm[:, None] * width + rn[None, :]  # [splits, M, width] float32
        mask = (rm[:, None] < M) & in_n[None, :]
        last, total = sum_of_parts(acc, parts, M * width, pid_s, splits, counts + pid_n,
                                   mask)
        if last:
            total = _scaled(total, s_ptr, wn, x_scale, SCALE, SCALE_COLS, FP8_X)
            _store(total, y_ptr, stride_ym, rm, M, pid_n, N, BLOCK_N, GATE_UP)


# Row blocks a launch may have (8M output channels at 128 a block): a counter each.
MAX_BLOCKS = 1 << 16


def splits_for(n: int, k: int, device: torch.device, block_n: int, block_k: int) -> int:
    """K slices a launch takes: enough programs for two per SM, each slice at least four
    K steps."""
    blocks = triton.cdiv(n, block_n)
    steps = triton.cdiv(k, block_k)
    wanted = triton.cdiv(2 * sm_count(device), blocks)
    return max(1, min(wanted, steps // 4))


def launch_by_width(n: int, k: int, device: torch.device, wide_block: tuple[int, int],
                    most_splits: int) -> dict[str, int]:
    """The launch rule the weight-first products were swept to: a layer at least 16,384
    wide in `wide_block` (channels, K) tiles without K slices; a narrower one in tiles of
    64 channels by 256 of K, split into up to `most_splits` K slices of at least four
    steps each where those tiles are fewer than ~0.7 per SM."""
    if n >= 16384:
        return dict(block_n=wide_block[0], block_k=wide_block[1], splits=1, num_warps=4,
                    num_stages=4)
    few = triton.cdiv(n, 64) < 0.7 * sm_count(device)
    splits = max(1, min(most_splits, triton.cdiv(k, 256) // 4)) if few else 1
    return dict(block_n=64, block_k=256, splits=splits, num_warps=4, num_stages=4)


def fp8_x_launch(n: int, k: int, device: torch.device) -> dict[str, int | None]:
    """The launch of an FP8 x FP8 product with a weight `[n, k]`, as swept on an H200 (the
    8B shape's projections at 17-64 rows, `benchmarks/w8a16_sweep.py --fp8-x`): tiles of
    64 channels by 256 of K, in four K slices where those tiles are fewer than ~0.7 per SM
    (qkv at 32 rows 18.9 -> 12.4 µs, o 17.7 -> 11.4, down 31.9 -> 24.2), 128 by 128 without
    slices for wide layers (gate_up 49.1 -> 34.7); an LM head-sized one (already ~97 % of
    the copy rate) keeps the default launch."""
    if n >= 65536:
        return {}  # rows_mma's own
    return launch_by_width(n, k, device, (128, 128), most_splits=4)


_weight_first = True  # EngineConfig.mma_weight_first, set by the runner's set-up


def set_weight_first(on: bool) -> None:
    """Whether the engine's 16-bit products of a few rows take the weight as the MMA's
    first operand (`engine_launch`)."""
    global _weight_first
    _weight_first = on


def weight_first_launch(n: int, k: int, device: torch.device) -> dict:
    """The launch of a 16-bit weight `[n, k]` as the first operand, as swept on an H200
    (the 8B shape's projections at 5 rows, `benchmarks/gemv_sweep.py --rows 5
    --weight-first`): 64 channels by 256 of K, in two K slices where those tiles are fewer
    than ~0.7 per SM (down 31.0 -> 30.6 µs), 64 by 128 for wide layers (gate_up 57.5 ->
    56.2, LM head 237.0 -> 233.3)."""
    return dict(launch_by_width(n, k, device, (64, 128), most_splits=2), weight_first=True)


_bf16_8bit = True  # EngineConfig.mma_8bit_bf16, set by the runner's set-up


def set_bf16_8bit(on: bool) -> None:
    """Whether 8-bit weights by two or more rows of bfloat16 x take the kernel's BF16_W
    form from now on (the weights made bfloat16 by their bits, x as it is) instead of both
    made float16 (one row, x converted once for the tile, stays: an H100's 8B LM head
    176.5 µs against 179.9 with BF16_W)."""
    global _bf16_8bit
    _bf16_8bit = on


def engine_launch(n: int, k: int, device: torch.device) -> dict:
    """The launch an engine layer's 16-bit weight `[n, k]` takes: `weight_first_launch`
    once `set_weight_first`, else rows_mma's default."""
    return weight_first_launch(n, k, device) if _weight_first else {}


def block_rows(m: int) -> int:
    """The rows of x's tile: 16, 32 or 64, the fewest that hold `m`."""
    return 16 if m <= 16 else 32 if m <= 32 else 64


def takes(scale_block: tuple[int, int] | None, block_n: int = BLOCK_N,
          block_k: int = BLOCK_K) -> bool:
    """Whether the kernel takes a weight with these scales: per channel, or tiles whose
    rows and columns are whole multiples of the launch's."""
    return scale_block is None or (scale_block[0] % block_n == 0
                                   and scale_block[1] % block_k == 0)


def rows_mma(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None,
             scale_block: tuple[int, int] | None = None, *,
             x_scale: torch.Tensor | None = None, block_n: int = BLOCK_N,
             block_k: int = BLOCK_K,
             splits: int | None = None, num_warps: int = 4, num_stages: int = 3,
             out_dtype: torch.dtype | None = None, weight_first: bool = False,
             gate_up: str = "") -> torch.Tensor:
    """`x [M, K]` (M <= MAX_ROWS; float16 / bfloat16, unit column stride) times the
    transpose of `weight [N, K]` (contiguous): x's dtype, unscaled (`scale` None), or int8 /
    float8_e4m3fn scaled by `scale [N]`, or with `scale_block = (rows, cols)` (`takes` it)
    by one float32 scale per tile, `scale [ceil(N / rows), ceil(K / cols)]`: `[M, N]` in x's
    dtype. With `x_scale [M]` (float32; FP8 weights scaled per channel, on a GPU): x is
    float8_e4m3fn, `x * x_scale[:, None]` the rows (as `fp8_quant.fp8_quantize_rows` gives
    them), multiplied FP8 by FP8; `out_dtype` (16-bit) then names y's dtype.
    `weight_first`: the weight tile is the MMA's first operand (as FP8 by FP8 always is).
    `gate_up` ("silu" / "gelu_tanh"; not with `scale_block`): `weight [2I, K]` is a gated
    MLP's gate rows then up rows, and the result `[M, I]` is `act(gate) * up`, stored by
    the program that multiplied both (the activation's own launch saved), bit for bit the
    product then `activation.gated_rows` at the same launch."""
    fp8_x = x_scale is not None
    assert x.dim() == 2 and 1 <= x.shape[0] <= MAX_ROWS and x.stride(1) == 1, x.shape
    assert x.shape[0] == 1 or x.stride(0) >= x.shape[1], x.stride()
    assert x.dtype == torch.float8_e4m3fn if fp8_x else x.dtype in (torch.float16,
                                                                    torch.bfloat16), x.dtype
    assert weight.dim() == 2 and weight.is_contiguous()
    assert weight.shape[1] == x.shape[1], (weight.shape, x.shape)
    m, n, k = x.shape[0], weight.shape[0], weight.shape[1]
    scale_rows, scale_cols = scale_block or (0, 0)
    if gate_up:
        assert gate_up in ("silu", "gelu_tanh") and scale_block is None, gate_up
        assert n % 2 == 0 and block_n % 2 == 0, (n, block_n)
    if scale is None:
        assert weight.dtype == x.dtype and scale_block is None, (weight.dtype, x.dtype)
    else:
        assert weight.dtype in (torch.int8, torch.float8_e4m3fn), weight.dtype
        assert scale.device == x.device == weight.device
        if scale_block is None:
            assert scale.shape == (n,), (scale.shape, n)
        else:
            assert takes(scale_block, block_n, block_k), (scale_block, block_n, block_k)
            assert scale.shape == (-(-n // scale_rows), -(-k // scale_cols)), scale.shape
            assert scale.stride(1) == 1
    if fp8_x:
        assert weight.dtype == torch.float8_e4m3fn and scale_block is None, weight.dtype
        assert x_scale.shape == (m,) and x_scale.dtype == torch.float32
        assert out_dtype in (torch.float16, torch.bfloat16), out_dtype
        x = x.view(torch.int8)  # its bytes: loads with zeros past the rows
    channels = n // 2 if gate_up else n
    y = torch.empty((m, channels), dtype=out_dtype if fp8_x else x.dtype, device=x.device)
    if n == 0 or k == 0:
        return y.zero_()  # act(0) * 0 = 0 too
    steps = triton.cdiv(k, block_k)
    splits = splits or splits_for(n, k, x.device, block_n, block_k)
    per_split = triton.cdiv(steps, min(splits, steps))
    splits = triton.cdiv(steps, per_split)
    blocks = triton.cdiv(n, block_n)
    ptx = gpu_compiled(x.device)
    parts = (torch.empty((splits, m, n), dtype=torch.float32, device=x.device)
             if splits > 1 else y)
    _rows_mma_kernel[(blocks, splits)](
        x, weight, y if scale is None else scale, x_scale if fp8_x else y, y, parts,
        launch_counters("rows_mma", x.device, MAX_BLOCKS, blocks),
        m, channels, k, x.stride(0), weight.stride(0), y.stride(0),
        1 if scale is None else scale.stride(0), per_split, splits,
        BLOCK_M=block_rows(m), BLOCK_N=block_n, BLOCK_K=block_k,
        SCALE=scale is not None, SCALE_ROWS=scale_rows or 1, SCALE_COLS=scale_cols,
        EVEN_K=k % block_k == 0, ONE_ROW=m == 1 and not fp8_x,
        PTX=ptx, FP8_X=fp8_x,
        W_FIRST=weight_first or fp8_x, GATE_UP=gate_up,
        BF16_W=_bf16_8bit and ptx and m > 1 and scale is not None and not fp8_x
        and x.dtype == torch.bfloat16,
        num_warps=num_warps, num_stages=num_stages, **dependent_launch.launch_options(),
    )
    return y
