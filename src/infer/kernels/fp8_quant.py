"""Per-row dynamic FP8 quantization: `x [M, K]` -> (`q [M, K]` float8_e4m3fn, `scale [M]`
float32) with `q = x * (1 / scale)`, `scale = max |x[row]| * (1 / 448)` (1 for a row of
zeros), the values `quantization/fp8.py`'s `quantize_fp8` computes, in one kernel: each
program reads its row once (kept in registers for its largest magnitude, then the scaled
values; rows wider than 16384 are read twice) and writes it once, where the eager version
passes over a float32 copy six times. GPU only: Triton's
interpreter has no FP8.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# The widest row one program holds in its registers (read from memory once).
ROW_IN_REGISTERS = 16384


@triton.jit
def fp8_scales(amax):
    """A row's scale and its reciprocal from its largest |x| (elementwise: one row or a
    vector of rows): the same float32 operations as torch, a product with 1/448 and an
    IEEE reciprocal (Triton's `/` is approximate)."""
    scale = amax * (1.0 / 448.0)
    scale = tl.where(scale > 0, scale, 1.0)
    return scale, tl.math.div_rn(tl.zeros_like(scale) + 1.0, scale)


@triton.jit
def to_fp8(x, inv):
    """x times its row's reciprocal scale, rounded to nearest even straight from float32."""
    q = tl.clamp(x.to(tl.float32) * inv, -448.0, 448.0)
    return q.to(tl.float8e4nv, fp_downcast_rounding="rtne")


@triton.jit
def store_fp8_row(y, q_at, s_at, mask):
    """A whole row `y` held by one program (masked columns 0, no larger than any |y|) in
    FP8 at `q_at`, its scale at `s_at`: `fp8_quantize_rows`' values, bit for bit."""
    scale, inv = fp8_scales(tl.max(tl.abs(y.to(tl.float32)), axis=0))
    tl.store(q_at, to_fp8(y, inv), mask=mask)
    tl.store(s_at, scale)


@triton.jit
def _fp8_rows_kernel(x_ptr, q_ptr, s_ptr, K, stride_x, stride_q, BLOCK: tl.constexpr,
                     ONE_PASS: tl.constexpr):
    # float32 arithmetic throughout
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    if ONE_PASS:  # the row is one block, read once
        x = tl.load(x_ptr + row * stride_x + cols, mask=cols < K, other=0.0)
        store_fp8_row(x, q_ptr + row * stride_q + cols, s_ptr + row, cols < K)
    else:
        amax = tl.zeros((BLOCK,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK):
            x = tl.load(x_ptr + row * stride_x + k0 + cols, mask=k0 + cols < K, other=0.0)
            amax = tl.maximum(amax, tl.abs(x.to(tl.float32)))
        scale, inv = fp8_scales(tl.max(amax, axis=0))
        for k0 in range(0, K, BLOCK):
            x = tl.load(x_ptr + row * stride_x + k0 + cols, mask=k0 + cols < K, other=0.0)
            tl.store(q_ptr + row * stride_q + k0 + cols, to_fp8(x, inv), mask=k0 + cols < K)
        tl.store(s_ptr + row, scale)


def fp8_quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`x [M, K]` (unit column stride) on a GPU -> (float8_e4m3fn `[M, K]`, float32 `[M]`)."""
    assert x.dim() == 2 and x.stride(1) == 1 and x.is_cuda, (x.shape, x.stride(), x.device)
    m, k = x.shape
    q = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((m,), dtype=torch.float32, device=x.device)
    if m:
        # Rows up to ROW_IN_REGISTERS wide (every model here) are read from memory once.
        block = min(ROW_IN_REGISTERS, triton.next_power_of_2(k))
        _fp8_rows_kernel[(m,)](x, q, scale, k, x.stride(0), q.stride(0), BLOCK=block,
                               ONE_PASS=k <= block, num_warps=8 if block <= 4096 else 16)
    return q, scale


def attach_fp8_rows(x: torch.Tensor, rows: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """`x`, carrying its rows in FP8 with their scales (`fp8_quantize_rows`'s values, made
    by the kernel that made x: an RMSNorm's or a gated activation's) for the FP8 x FP8
    products it goes into; the same invariant as `int8_rows.attach`'s (x never changed in
    place)."""
    x.fp8_rows = rows
    return x


def attached_fp8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The FP8 rows and scales `x` carries (`attach_fp8_rows`), if any."""
    return getattr(x, "fp8_rows", None)
