"""W8A16 matmul: `y = x @ (w * scale[:, None])^T`, `w [N, K]` 8-bit (int8, or FP8 e4m3 on
a GPU: Triton's interpreter has no FP8) read as it is stored, `scale [N]` per output
channel, `x [M, K]` 16-bit (or float32), float32 accumulation.

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
    M, N, K, stride_xm, stride_wn, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,
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
        w = tl.load(w_ptr + rn[None, :].to(tl.int64) * stride_wn + kk[:, None],
                    mask=(rn[None, :] < N) & (kk[:, None] < K), other=0.0)
        if IEEE:  # float32 inputs: no TF32 rounding
            acc += tl.dot(x, w.to(x.dtype), input_precision="ieee")
        else:
            acc += tl.dot(x, w.to(x.dtype))
    scale = tl.load(s_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)
    y = acc * scale[None, :]
    tl.store(y_ptr + rm[:, None].to(tl.int64) * stride_ym + rn[None, :],
             y.to(y_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


def w8a16_matmul(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`x [M, K]` (float16 / bfloat16 / float32, unit column stride), `weight [N, K]` int8
    or float8_e4m3fn, contiguous, `scale [N]`: `[M, N]` in x's dtype."""
    assert x.dim() == 2 and x.stride(1) == 1, (x.shape, x.stride())
    assert x.dtype in (torch.float16, torch.bfloat16, torch.float32), x.dtype
    assert weight.dtype in (torch.int8, torch.float8_e4m3fn), weight.dtype
    assert weight.dim() == 2 and weight.is_contiguous()
    assert weight.shape[1] == x.shape[1], (weight.shape, x.shape)
    assert scale.shape == (weight.shape[0],) and scale.device == x.device == weight.device
    m, k = x.shape
    n = weight.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    # Tuned on the H100 over the Llama-3.2-1B / 3.1-8B projections (decode rows): 32
    # channels per program; longer K steps for long rows.
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    block_n, block_k = 32, (512 if k >= 8192 and m <= 32 else 256)  # smem: 3 stages
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m))
    _w8a16_kernel[grid](
        x, weight, scale, y, m, n, k, x.stride(0), weight.stride(0), y.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, IEEE=x.dtype == torch.float32,
        num_warps=4, num_stages=3,
    )
    return y
