"""A few rows times a 16-bit weight: `y [M, N] = x [M, K] @ w [N, K]^T`, float32
accumulation, for M up to MAX_ROWS (one row: batch-1 decode; a few: a verify step's k + 1
positions, small batches).

Batch-1 decode multiplies one row by every projection; the weight's bytes bound the time,
and on small projections cuBLAS splits K over programs and then adds the parts in a
second kernel. Here each program owns BLOCK_N output channels and walks all of K,
multiplying in registers and reducing once at the end: one launch. (Splitting K over
programs, the last of a row block adding the parts, was tried: on an H200 it was the
fastest launch for none of the 1B, 8B and 8B-at-TP=2 projections, `gemv_sweep_h200.json`.)

With `act` ("silu" / "gelu_tanh") the row is a gated MLP's `gate_up [1, 2K]`: the kernel
multiplies by `act(gate) * up`, rounded to x's dtype as the activation kernel stores it,
so the product is the one `gemv(swiglu(gate_up), w)` computes, without its launch.

Several rows share each weight tile read (`_gemv_rows_kernel`: a [rows, BLOCK_N, BLOCK_K]
product, the rows padded to a power of two); one row keeps its own kernel, whose launch
rule was tuned on its own.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from infer.kernels import dependent_launch
from infer.kernels.activation import gated

MAX_ROWS = 16


class Launch(NamedTuple):
    block_n: int
    block_k: int
    num_warps: int


@triton.jit
def _weights(w_rows, kk, K, EVEN_K: tl.constexpr):
    if EVEN_K:
        return tl.load(w_rows + kk[None, :], eviction_policy="evict_first")
    return tl.load(w_rows + kk[None, :], mask=kk[None, :] < K, other=0.0,
                   eviction_policy="evict_first")


@triton.jit
def _row(x_ptr, kk, K, EVEN_K: tl.constexpr, ACT: tl.constexpr):
    """x's columns kk (or act(gate) * up there, rounded to x's dtype)."""
    if EVEN_K:
        x = tl.load(x_ptr + kk)
        if ACT != "":
            x = gated(x, tl.load(x_ptr + K + kk), ACT).to(x.dtype)
    else:
        x = tl.load(x_ptr + kk, mask=kk < K, other=0.0)
        if ACT != "":
            x = gated(x, tl.load(x_ptr + K + kk, mask=kk < K, other=0.0), ACT).to(x.dtype)
    return x


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, y_ptr, N, K, stride_wn,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, ACT: tl.constexpr,
    PDL: tl.constexpr,
):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    # Rows past N read row N - 1 (no mask on the weight's loads) and are not stored.
    w_rows = w_ptr + tl.minimum(rn, N - 1).to(tl.int64)[:, None] * stride_wn
    # The first weight tile is read before the kernel before this one has finished
    # (dependent_launch.py); x only after.
    w = _weights(w_rows, rk, K, EVEN_K)
    dependent_launch.wait(PDL)
    dependent_launch.release(PDL)
    acc = w.to(tl.float32) * _row(x_ptr, rk, K, EVEN_K, ACT).to(tl.float32)[None, :]
    for k0 in range(BLOCK_K, K, BLOCK_K):
        kk = k0 + rk
        acc += (_weights(w_rows, kk, K, EVEN_K).to(tl.float32)
                * _row(x_ptr, kk, K, EVEN_K, ACT).to(tl.float32)[None, :])
    tl.store(y_ptr + rn, tl.sum(acc, axis=1).to(y_ptr.dtype.element_ty), mask=rn < N)


@triton.jit
def _rows(x_ptr, stride_xm, M, kk, K, EVEN_K: tl.constexpr, ACT: tl.constexpr,
          ROWS: tl.constexpr):
    """Columns kk of x's rows ([ROWS, len(kk)]; rows past M read as 0), or act(gate) * up."""
    rm = tl.arange(0, ROWS)
    at = x_ptr + rm.to(tl.int64)[:, None] * stride_xm + kk[None, :]
    mask = rm[:, None] < M
    if not EVEN_K:
        mask = mask & (kk[None, :] < K)
    x = tl.load(at, mask=mask, other=0.0)
    if ACT != "":
        x = gated(x, tl.load(at + K, mask=mask, other=0.0), ACT).to(x.dtype)
    return x


@triton.jit
def _gemv_rows_kernel(
    x_ptr, w_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    ACT: tl.constexpr, PDL: tl.constexpr,
):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + tl.minimum(rn, N - 1).to(tl.int64)[:, None] * stride_wn
    w = _weights(w_rows, rk, K, EVEN_K)
    dependent_launch.wait(PDL)
    dependent_launch.release(PDL)
    acc = (w.to(tl.float32)[None, :, :]
           * _rows(x_ptr, stride_xm, M, rk, K, EVEN_K, ACT, ROWS).to(tl.float32)[:, None, :])
    for k0 in range(BLOCK_K, K, BLOCK_K):
        kk = k0 + rk
        acc += (_weights(w_rows, kk, K, EVEN_K).to(tl.float32)[None, :, :]
                * _rows(x_ptr, stride_xm, M, kk, K, EVEN_K, ACT, ROWS).to(tl.float32)[:, None, :])
    rm = tl.arange(0, ROWS)
    tl.store(y_ptr + rm.to(tl.int64)[:, None] * stride_ym + rn[None, :],
             tl.sum(acc, axis=2).to(y_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


def default_launch(n: int, k: int, rows: int = 1) -> Launch:
    """The launch for an `[n, k]` weight and `rows` rows. One row: from
    `benchmarks/gemv_sweep.py` on an H200 (`gemv_sweep_h200.json`), the best single rule
    over the 1B, 8B and 8B-at-TP=2 projections: within 1.14x of each shape's fastest
    launch, 1.7 % slower than those over all fifteen (cuBLAS: 8.5 %). More rows: the same
    weight tiles, K steps shortened so that the [rows, BLOCK_N, BLOCK_K] product keeps the
    one-row kernel's registers (not yet swept)."""
    if n * k <= 1 << 24:  # up to 32 MB: longer steps, more warps in flight per row block
        launch = Launch(block_n=8, block_k=1024, num_warps=8)
    else:
        launch = Launch(block_n=8, block_k=512, num_warps=4)
    padded = triton.next_power_of_2(rows)
    return launch._replace(block_k=max(64, launch.block_k // padded))


def gemv(x: torch.Tensor, weight: torch.Tensor, launch: Launch | None = None,
         act: str = "") -> torch.Tensor:
    """`x [M, K]` (M <= MAX_ROWS; float16 / bfloat16 / float32, unit column stride) times
    the transpose of `weight [N, K]` (same dtype, unit column stride): `[M, N]` in x's
    dtype. With `act`, `x` is `[M, 2K]` (gate | up) and each row multiplied is
    `act(gate) * up`."""
    assert x.dim() == 2 and 1 <= x.shape[0] <= MAX_ROWS, x.shape
    assert x.stride(1) == 1 and (x.shape[0] == 1 or x.stride(0) >= x.shape[1]), x.stride()
    assert weight.dim() == 2 and weight.stride(1) == 1, (weight.shape, weight.stride())
    assert act in ("", "silu", "gelu_tanh"), act
    assert weight.shape[1] * (2 if act else 1) == x.shape[1], (weight.shape, x.shape)
    assert weight.dtype == x.dtype, (weight.dtype, x.dtype)
    rows = x.shape[0]
    n, k = weight.shape
    block_n, block_k, num_warps = launch or default_launch(n, k, rows)
    y = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    if n == 0 or k == 0:
        return y.zero_()
    grid = (triton.cdiv(n, block_n),)
    if rows == 1:
        _gemv_kernel[grid](
            x, weight, y, n, k, weight.stride(0), BLOCK_N=block_n, BLOCK_K=block_k,
            EVEN_K=k % block_k == 0, ACT=act, num_warps=num_warps,
            **dependent_launch.launch_options(),
        )
    else:
        _gemv_rows_kernel[grid](
            x, weight, y, rows, n, k, x.stride(0), weight.stride(0), y.stride(0),
            ROWS=triton.next_power_of_2(rows), BLOCK_N=block_n, BLOCK_K=block_k,
            EVEN_K=k % block_k == 0, ACT=act, num_warps=num_warps,
            **dependent_launch.launch_options(),
        )
    return y
