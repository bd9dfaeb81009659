"""W8A16 matmul: `y = x @ (w * scale[:, None])^T`, `w [N, K]` 8-bit (int8, or FP8 e4m3 on
a GPU: Triton's interpreter has no FP8) read as it is stored, `scale [N]` per output
channel (or one scale per tile of the weight, as block-wise FP8 checkpoints store it),
`x [M, K]` 16-bit (or float32), float32 accumulation.

Meant for decode-sized M (a step's rows): each program owns BLOCK_N output channels of
BLOCK_M rows and walks its share of K (all of it, or one of SPLIT slices whose float32
partial sums are added after), so the 8-bit weight, the bytes that bound the step, is read
once per row block. One row is multiplied in registers and reduced once at the end; more
rows go through `tl.dot`. The scale is applied once, to the accumulated sum. Larger M
(prefill chunks) is compute-bound: `quantization/int8.py` dequantizes for cuBLAS there,
`quantization/fp8.py` quantizes the activations too for an FP8 GEMM.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from infer.kernels import dependent_launch, gpu_compiled
from infer.kernels.weight_cast import to_float


@triton.jit
def _weight_tile(w_ptr, rn, kk, N, K, stride_wn):
    return tl.load(w_ptr + rn[:, None].to(tl.int64) * stride_wn + kk[None, :],
                   mask=(rn[:, None] < N) & (kk[None, :] < K), other=0.0)


@triton.jit
def _one_row_step(acc2, w, x_ptr, s_ptr, pid_m, pid_n, rn, kk, N, K, stride_xm, stride_sn,
                  BLOCK_N: tl.constexpr, SCALE_ROWS: tl.constexpr, SCALE_COLS: tl.constexpr,
                  SCALE_IN_X: tl.constexpr, PTX: tl.constexpr):
    """acc2 plus one K step's products of the weight tile `w` and x's columns kk."""
    wf = to_float(w, PTX)
    if SCALE_COLS > 0 and not SCALE_IN_X:  # a scale per weight
        wf *= tl.load(s_ptr + (rn[:, None] // SCALE_ROWS) * stride_sn + kk[None, :] // SCALE_COLS,
                      mask=(rn[:, None] < N) & (kk[None, :] < K), other=0.0)
    x = tl.load(x_ptr + pid_m.to(tl.int64) * stride_xm + kk, mask=kk < K,
                other=0.0).to(tl.float32)
    if SCALE_IN_X:  # the program's rows share their scales along K: x takes them
        x *= tl.load(s_ptr + (pid_n * BLOCK_N // SCALE_ROWS) * stride_sn
                     + kk // SCALE_COLS, mask=kk < K, other=0.0)
    return acc2 + wf * x[None, :]


@triton.jit
def _w8a16_kernel(
    x_ptr, w_ptr, s_ptr, y_ptr,
    M, N, K, stride_xm, stride_wn, stride_ys, stride_ym, stride_sn, steps_per_split,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr, SCALE_ROWS: tl.constexpr, SCALE_COLS: tl.constexpr,
    TILE_SCALE: tl.constexpr, SCALE_IN_X: tl.constexpr, PTX: tl.constexpr,
    PDL: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_s = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    k_begin = pid_s * steps_per_split * BLOCK_K  # < K: every split has a step
    k_end = tl.minimum(k_begin + steps_per_split * BLOCK_K, K)
    if BLOCK_M == 1:  # products summed in registers, reduced once
        # The first weight tile is read before the kernel before this one has finished
        # (dependent_launch.py); x and the scales only after.
        w = _weight_tile(w_ptr, rn, k_begin + rk, N, K, stride_wn)
        dependent_launch.wait(PDL)
        dependent_launch.release(PDL)
        acc2 = _one_row_step(tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32), w, x_ptr, s_ptr,
                             pid_m, pid_n, rn, k_begin + rk, N, K, stride_xm, stride_sn,
                             BLOCK_N, SCALE_ROWS, SCALE_COLS, SCALE_IN_X, PTX)
        for k0 in range(k_begin + BLOCK_K, k_end, BLOCK_K):
            kk = k0 + rk
            acc2 = _one_row_step(acc2, _weight_tile(w_ptr, rn, kk, N, K, stride_wn), x_ptr,
                                 s_ptr, pid_m, pid_n, rn, kk, N, K, stride_xm, stride_sn,
                                 BLOCK_N, SCALE_ROWS, SCALE_COLS, SCALE_IN_X, PTX)
        acc = tl.sum(acc2, axis=1)[None, :]
    else:
        dependent_launch.wait(PDL)
        dependent_launch.release(PDL)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(k_begin, k_end, BLOCK_K):
            kk = k0 + rk
            w = _weight_tile(w_ptr, rn, kk, N, K, stride_wn)
            if SCALE_COLS > 0 and not TILE_SCALE:  # a scale per weight
                s = tl.load(s_ptr + (rn[:, None] // SCALE_ROWS) * stride_sn
                            + kk[None, :] // SCALE_COLS,
                            mask=(rn[:, None] < N) & (kk[None, :] < K), other=0.0)
                w = to_float(w, PTX) * s
            x = tl.load(x_ptr + rm[:, None].to(tl.int64) * stride_xm + kk[None, :],
                        mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
            if IEEE:  # float32 inputs: no TF32 rounding
                part = tl.dot(x, tl.trans(w.to(x.dtype)), input_precision="ieee")
            else:
                part = tl.dot(x, tl.trans(w.to(x.dtype)))
            if TILE_SCALE:  # this program's tile lies in one scale tile: scale its sum
                part *= tl.load(s_ptr + (pid_n * BLOCK_N // SCALE_ROWS) * stride_sn
                                + k0 // SCALE_COLS)
            acc += part
    if SCALE_COLS == 0:
        acc *= tl.load(s_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + pid_s * stride_ys + rm[:, None].to(tl.int64) * stride_ym + rn[None, :],
             acc.to(y_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


# One row on tensor cores pays (against this kernel's one-row form) only where a layer has
# columns for many 128-wide tiles (`w8a16_sweep.py --tensor-cores`, H200: the LM head 128 vs
# 157 µs, the 8B gate_up 36.5 vs 38.5; the narrow 8B qkv / o / down lost 12-30 %). From 2
# rows on it gains on nearly every projection (5 rows, 8B down: 25 vs 39 µs).
TENSOR_CORES_ONE_ROW_MIN_N = 16384
# Two rows in the GEMV pay only on narrow layers, where the tensor-core kernels have few
# column tiles (`gemv_sweep.py --gemv --rows 2`, H200, µs against int8_x16 / rows_mma: the 1B
# qkv 6.5 / 6.2 against 8.0 / 6.9, o 4.8 / 4.4 against 7.9 / 6.5, down 10.3 / 10.1 against
# 13.4 / 10.7; the 8B o 11.8 against 10.6 and every wider layer lost, up to 2x).
GEMV_TWO_ROWS_MAX_N = 3072


def gemv_takes(rows: int, n: int, gemv_rows: int) -> bool:
    """Whether a step of `rows` rows by an `[n, K]` weight scaled per channel goes to
    `gemv.py`, the engine letting it take up to `gemv_rows` (0: none)."""
    return rows <= gemv_rows and (rows == 1 or n <= GEMV_TWO_ROWS_MAX_N)


def gate_up_gemv(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, act: str,
                 gemv_rows: int, rows_apart: bool = False) -> torch.Tensor | None:
    """`act(gate) * up` of `w8a16_matmul(x, weight, scale, gemv_rows=gemv_rows)` for a gated
    MLP's `[gate | up]` weight scaled per channel, from the GEMV's own launch
    (`gemv.gemv_gate_up`) where the rows go to the GEMV; with `rows_apart`, two rows too
    wide for its two-row launch whose first may be skipped (`row_skip`) as two one-row
    launches (`gemv.gemv_gate_up_rows_apart`); None otherwise."""
    from infer.kernels import gemv, row_skip

    if gemv_takes(x.shape[0], weight.shape[0], gemv_rows):
        return gemv.gemv_gate_up(x, weight, act, scale)
    if rows_apart and x.shape[0] == 2 and gemv_rows >= 1 and row_skip.skip_flag() is not None:
        return gemv.gemv_gate_up_rows_apart(x, weight, act, scale)
    return None


def w8a16_matmul(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                 scale_block: tuple[int, int] | None = None,
                 tensor_core_rows: int = 0, gemv_rows: int = 0) -> torch.Tensor:
    """`x [M, K]` (float16 / bfloat16 / float32, unit column stride), `weight [N, K]` int8
    or float8_e4m3fn, contiguous, `scale [N]`, or with `scale_block = (rows, cols)` one
    float32 scale per tile of the weight, `scale [ceil(N / rows), ceil(K / cols)]`
    (block-wise FP8 checkpoints): `[M, N]` in x's dtype. Up to `gemv_rows` rows (0: none)
    scaled per channel go to `gemv.py` (two only where `gemv_takes`), whose unmasked loads
    and launch rule beat this kernel's dot-free one-row form (`_matmul`'s `one_row_gemv`)
    and rows_mma at one row (`gemv_sweep.py --dtype int8`, H200: the 8B gate_up 32.8 µs
    against 37.9 and 36.6, the 1B 11.4 against 13.6 and 13.9; the LM heads within 2 % of
    rows_mma). With
    `tensor_core_rows` (0: off) the steps `rows_mma.py` takes (16-bit x, up to its MAX_ROWS)
    go there where they gained on an H200: 2 to `tensor_core_rows` rows, or one row of a
    layer at least TENSOR_CORES_ONE_ROW_MIN_N wide."""
    from infer.kernels import rows_mma

    rows = x.shape[0]
    if scale_block is None and gemv_takes(rows, weight.shape[0], gemv_rows):
        from infer.kernels.gemv import gemv

        return gemv(x, weight, scale=scale)
    if (tensor_core_rows and rows_mma.takes(scale_block)
            and rows <= min(tensor_core_rows, rows_mma.MAX_ROWS)
            and x.dtype in (torch.float16, torch.bfloat16)
            and (rows > 1 or weight.shape[0] >= TENSOR_CORES_ONE_ROW_MIN_N)):
        return rows_mma.rows_mma(x, weight, scale, scale_block)
    # Tuned on the H100 over the Llama-3.1-8B projections, their weights cycled past the
    # L2 cache (benchmarks/w8a16_sweep.py): one row runs the dot-free kernel on 8 channels
    # a program (enough programs to keep every SM's loads in flight); more rows use
    # `tl.dot` on 16 channels a program, 64 when the layer has channels for 256 programs.
    if rows == 1:
        launch = dict(block_n=8, block_k=1024, one_row_gemv=True, num_stages=2)
    elif weight.shape[0] >= 256 * 64:
        launch = dict(block_n=64, block_k=128, one_row_gemv=False, num_stages=3)
    else:
        launch = dict(block_n=16, block_k=256, one_row_gemv=False, num_stages=3)
    return _matmul(x, weight, scale, scale_block, split=1, num_warps=4, **launch)


def _matmul(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
            scale_block: tuple[int, int] | None, *, block_n: int, block_k: int, split: int,
            one_row_gemv: bool, num_warps: int, num_stages: int) -> torch.Tensor:
    """w8a16_matmul with its launch spelled out (for tuning): `split` > 1 splits K over
    that many programs, summing float32 partials; `one_row_gemv` multiplies one row
    without `tl.dot`."""
    assert x.dim() == 2 and x.stride(1) == 1, (x.shape, x.stride())
    assert x.dtype in (torch.float16, torch.bfloat16, torch.float32), x.dtype
    assert weight.dtype in (torch.int8, torch.float8_e4m3fn), weight.dtype
    assert weight.dim() == 2 and weight.is_contiguous()
    assert weight.shape[1] == x.shape[1], (weight.shape, x.shape)
    m, k = x.shape
    n = weight.shape[0]
    scale_rows, scale_cols = scale_block or (0, 0)
    if scale_block is None:
        assert scale.shape == (n,), (scale.shape, n)
    else:
        assert scale.shape == (-(-n // scale_rows), -(-k // scale_cols)), scale.shape
        assert scale.dtype == torch.float32 and scale.stride(1) == 1
    assert scale.device == x.device == weight.device
    block_m = 1 if m == 1 and one_row_gemv else 16 if m <= 16 else 32 if m <= 32 else 64
    # Block-wise scales (a gathered scale per weight made the kernel 8x slower on the
    # H100). When a program's channels lie in one row of scale tiles: one row multiplies
    # x by its columns' scales, shared by the channels, whatever the K step; more rows
    # scale each K step's partial sum, the step shortened to lie in one tile.
    scale_in_x = scale_block is not None and block_m == 1 and scale_rows % block_n == 0
    tile_scale = False
    if scale_block is not None and not scale_in_x:
        step = block_k
        while step > 16 and scale_cols % step:
            step //= 2
        tile_scale = scale_rows % block_n == 0 and scale_cols % step == 0
        block_k = step if tile_scale else block_k
    steps = triton.cdiv(k, block_k)
    per_split = triton.cdiv(steps, max(1, min(split, steps)))
    split = max(1, triton.cdiv(steps, per_split))
    shape = (m, n) if split == 1 else (split, m, n)
    y = torch.empty(shape, dtype=x.dtype if split == 1 else torch.float32, device=x.device)
    if m > 0 and n > 0:
        grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m), split)
        _w8a16_kernel[grid](
            x, weight, scale, y, m, n, k, x.stride(0), weight.stride(0), m * n, n,
            scale.stride(0), per_split, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
            IEEE=x.dtype == torch.float32, SCALE_ROWS=scale_rows, SCALE_COLS=scale_cols,
            TILE_SCALE=tile_scale, SCALE_IN_X=scale_in_x,
            PTX=gpu_compiled(x.device),
            num_warps=num_warps, num_stages=num_stages, **dependent_launch.launch_options(),
        )
    return y if split == 1 else y.sum(0).to(x.dtype)
