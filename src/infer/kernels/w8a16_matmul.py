"""W8A16 matmul: `y = x @ (w * scale[:, None])^T`, `w [N, K]` 8-bit (int8, or FP8 e4m3 on
a GPU: Triton's interpreter has no FP8) read as it is stored, `scale [N]` per output
channel (or one scale per tile of the weight, as block-wise FP8 checkpoints store it),
`x [M, K]` 16-bit (or float32), float32 accumulation.

Meant for decode-sized M (a step's rows): each program owns BLOCK_N output channels of
BLOCK_M rows and walks K, so the int8 weight, the bytes that bound the step, is read
once per row block. The scale is applied once, to the accumulated sum. Larger M (prefill
chunks) is compute-bound: `quantization/int8.py` dequantizes for cuBLAS there,
`quantization/fp8.py` quantizes the activations too for an FP8 GEMM.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _w8a16_kernel(
    x_ptr, w_ptr, s_ptr, y_ptr,
    M, N, K, stride_xm, stride_wn, stride_ym, stride_sn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr, SCALE_ROWS: tl.constexpr, SCALE_COLS: tl.constexpr,
    TILE_SCALE: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        x = tl.load(x_ptr + rm[:, None].to(tl.int64) * stride_xm + kk[None, :],
                    mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
        w_mask = (rn[None, :] < N) & (kk[:, None] < K)
        w = tl.load(w_ptr + rn[None, :].to(tl.int64) * stride_wn + kk[:, None],
                    mask=w_mask, other=0.0)
        if SCALE_COLS > 0 and not TILE_SCALE:  # a scale per weight, gathered
            s = tl.load(s_ptr + (rn[None, :] // SCALE_ROWS) * stride_sn + kk[:, None] // SCALE_COLS,
                        mask=w_mask, other=0.0)
            w = w.to(tl.float32) * s
        if IEEE:  # float32 inputs: no TF32 rounding
            part = tl.dot(x, w.to(x.dtype), input_precision="ieee")
        else:
            part = tl.dot(x, w.to(x.dtype))
        if TILE_SCALE:  # this program's tile lies in one scale tile: scale its sum
            part *= tl.load(s_ptr + (pid_n * BLOCK_N // SCALE_ROWS) * stride_sn
                            + k0 // SCALE_COLS)
        acc += part
    if SCALE_COLS > 0:
        y = acc
    else:
        scale = tl.load(s_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)
        y = acc * scale[None, :]
    tl.store(y_ptr + rm[:, None].to(tl.int64) * stride_ym + rn[None, :],
             y.to(y_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


def w8a16_matmul(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                 scale_block: tuple[int, int] | None = None) -> torch.Tensor:
    """`x [M, K]` (float16 / bfloat16 / float32, unit column stride), `weight [N, K]` int8
    or float8_e4m3fn, contiguous, `scale [N]`, or with `scale_block = (rows, cols)` one
    float32 scale per tile of the weight, `scale [ceil(N / rows), ceil(K / cols)]`
    (block-wise FP8 checkpoints): `[M, N]` in x's dtype."""
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
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    # Tuned on the H100 over the Llama-3.2-1B / 3.1-8B projections (decode rows): 32
    # channels per program; longer K steps for long rows.
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    block_n, block_k = 32, (512 if k >= 8192 and m <= 32 else 256)  # smem: 3 stages
    # Block-wise scales: when a program's block of the weight never straddles two scale
    # tiles, one scale multiplies each K step's partial sum (a gathered scale per weight
    # made the kernel 8x slower on the H100).
    tile_scale = False
    if scale_block is not None:
        step = block_k
        while step > 16 and scale_cols % step:
            step //= 2
        tile_scale = scale_rows % block_n == 0 and scale_cols % step == 0
        block_k = step if tile_scale else block_k
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m))
    _w8a16_kernel[grid](
        x, weight, scale, y, m, n, k, x.stride(0), weight.stride(0), y.stride(0),
        scale.stride(0), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        IEEE=x.dtype == torch.float32, SCALE_ROWS=scale_rows, SCALE_COLS=scale_cols,
        TILE_SCALE=tile_scale, num_warps=4, num_stages=3,
    )
    return y
