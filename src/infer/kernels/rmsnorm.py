"""RMSNorm and fused residual-add + RMSNorm: one program per row, float32 accumulation.

Rounded as transformers rounds (HF `LlamaRMSNorm`, `Gemma3RMSNorm`), so the torch path
(`infer.models.layers.RMSNorm`) and these kernels agree bit for bit in bf16: `x * w`
(offset 0) rounds the normalised x to the output dtype, then multiplies by the weight and
rounds again; Gemma's `x * (1 + w)` (offset 1) scales in float32 and rounds once.

With `int8_rows` a one-row norm also hands out its output rounded to int8 per 32 values
(`int8_rows.py`'s layout, from the output as stored): what the GGUF int8-x kernels of the
next projection take, without a launch of its own. With `x16_rows`, each row of the output
split into two int8 halves of 16-bit fixed point instead (`int8_x16.split_rows`'s), for the
INT8 kernels that take x so (`int8_x16_gemv.py` at one row, `int8_x16.py`'s int8 tensor
cores at a few). With `fp8_rows`, each row of the output in FP8 with its scale
(`fp8_quant.fp8_quantize_rows`'s values, bit for bit), for the FP8 x FP8 products.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from infer.kernels import dependent_launch
from infer.kernels.fp8_quant import store_fp8_row
from infer.kernels.int8_halves import store_halves_row
from infer.kernels.int8_rows import store_rounded


@triton.jit
def _rmsnorm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, xq_ptr, side_ptr,
    stride_x, stride_res, stride_out,
    n_cols, eps, lo_offset,
    OFFSET: tl.constexpr, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
    INT8_ROWS: tl.constexpr, PDL: tl.constexpr, X16_ROWS: tl.constexpr = False,
    FP8_ROWS: tl.constexpr = False,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    dependent_launch.wait(PDL)
    dependent_launch.release(PDL)
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
        # Round the sum to the residual's dtype before normalising it, so the output is
        # exactly rmsnorm(stored residual), as in the unfused model code.
        s = (x + r.to(tl.float32)).to(r.dtype)
        tl.store(res_ptr + row * stride_res + cols, s, mask=mask)
        x = s.to(tl.float32)
    y = normalised(x, w, n_cols, eps, OFFSET, out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_out + cols, y, mask=mask)
    if INT8_ROWS:  # one row: its blocks of 32
        b = tl.arange(0, BLOCK // 32)[:, None]
        store_rounded(xq_ptr, side_ptr, tl.reshape(y.to(tl.float32), (BLOCK // 32, 32)), b,
                      b * 32 < n_cols)
    if X16_ROWS:  # each row's halves in `[2, rows, n_cols]` at xq_ptr (the low ones
        # lo_offset after), its scale at side_ptr + row
        store_halves_row(y, xq_ptr + row * n_cols + cols, lo_offset, side_ptr + row, mask)
    if FP8_ROWS:  # each row in FP8 at xq_ptr + row * n_cols, its scale at side_ptr + row
        store_fp8_row(y, xq_ptr + row * n_cols + cols, side_ptr + row, mask)


@triton.jit
def normalised(x, w, n_cols, eps, OFFSET: tl.constexpr, dtype: tl.constexpr):
    """One row's RMSNorm (`x`, `w` float32), rounded to `dtype` as the module docstring
    says."""
    inv_rms = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    if OFFSET == 0.0:
        return ((x * inv_rms).to(dtype).to(tl.float32) * w).to(dtype)
    return (x * inv_rms * (w + OFFSET)).to(dtype)


def _launch(x2d: torch.Tensor, res2d: torch.Tensor | None, weight: torch.Tensor,
            out2d: torch.Tensor, eps: float, offset: float,
            rounded: tuple[torch.Tensor, torch.Tensor] | None = None,
            form: str = "") -> None:
    """`rounded`: buffers for the output's rounding (`_rounding`), in the `form`
    they were made for: "int8_rows", "x16_rows" or "fp8_rows"."""
    rows, n = x2d.shape
    block = triton.next_power_of_2(n)
    num_warps = min(max(block // 256, 1), 16)
    xq, side = rounded if rounded is not None else (out2d, out2d)
    _rmsnorm_kernel[(rows,)](
        x2d, res2d if res2d is not None else x2d, weight, out2d, xq, side,
        x2d.stride(0), res2d.stride(0) if res2d is not None else 0, out2d.stride(0),
        n, eps, rows * n,
        OFFSET=offset, HAS_RESIDUAL=res2d is not None, BLOCK=block,
        INT8_ROWS=form == "int8_rows", X16_ROWS=form == "x16_rows",
        FP8_ROWS=form == "fp8_rows", num_warps=num_warps,
        **dependent_launch.launch_options(),
    )


def takes_int8_rows(x: torch.Tensor) -> bool:
    """Whether a norm of `x` can hand out its output rounded to int8 (`int8_rows=True`):
    one row of whole pairs of blocks of 32."""
    return x.numel() == x.shape[-1] and x.shape[-1] % 64 == 0


def _int8_buffers(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    assert takes_int8_rows(x), x.shape
    k = x.shape[-1]
    return (torch.empty(k, dtype=torch.int8, device=x.device),
            torch.empty((k // 64, 4), dtype=torch.float32, device=x.device))


def _x16_buffers(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    k = x.shape[-1]
    rows = x.numel() // k
    return (torch.empty((2, rows, k), dtype=torch.int8, device=x.device),
            torch.empty((rows,), dtype=torch.float32, device=x.device))


def _fp8_buffers(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    k = x.shape[-1]
    rows = x.numel() // k
    return (torch.empty((rows, k), dtype=torch.float8_e4m3fn, device=x.device),
            torch.empty((rows,), dtype=torch.float32, device=x.device))


def _rounding(x: torch.Tensor, int8_rows: bool, x16_rows: bool, fp8_rows: bool
              ) -> tuple[str, tuple[torch.Tensor, torch.Tensor] | None]:
    """The form of rounding asked for (at most one) and its buffers."""
    assert int8_rows + x16_rows + fp8_rows <= 1, (int8_rows, x16_rows, fp8_rows)
    if int8_rows:
        return "int8_rows", _int8_buffers(x)
    if x16_rows:
        return "x16_rows", _x16_buffers(x)
    if fp8_rows:
        assert x.is_cuda, "FP8 rows: a GPU's (Triton's interpreter has no FP8)"
        return "fp8_rows", _fp8_buffers(x)
    return "", None


def _check(x: torch.Tensor, weight: torch.Tensor, offset: float) -> None:
    assert offset in (0.0, 1.0), "offset is 0 (x * w) or 1 (Gemma's x * (1 + w))"
    assert weight.dim() == 1 and weight.shape[0] == x.shape[-1], (weight.shape, x.shape)
    assert weight.is_contiguous() and weight.device == x.device
    assert x.dtype in (torch.float16, torch.bfloat16, torch.float32), x.dtype


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float,
            offset: float = 0.0, int8_rows: bool = False, x16_rows: bool = False,
            fp8_rows: bool = False
            ) -> torch.Tensor | tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """RMSNorm over the last dim of `x` (any leading shape, e.g. `[T, H, D]` for q/k norms).
    Returns a new contiguous tensor in x's dtype; with `int8_rows` (`takes_int8_rows(x)`)
    also that tensor rounded to int8 (`int8_rows.py`), with `x16_rows` its rows' two int8
    halves `[2, rows, K]` and their scales `[rows]` (`int8_x16.split_rows`'s), with
    `fp8_rows` (a GPU) its rows in FP8 `[rows, K]` and their scales `[rows]`
    (`fp8_quant.fp8_quantize_rows`'s)."""
    _check(x, weight, offset)
    n = x.shape[-1]
    # reshape copies only if the leading dims cannot be flattened as a view.
    x2d = x.reshape(-1, n)
    if x2d.stride(-1) != 1:
        x2d = x2d.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    form, rounded = _rounding(x, int8_rows, x16_rows, fp8_rows)
    if x2d.shape[0]:
        _launch(x2d, None, weight, out.view(-1, n), eps, offset, rounded, form)
    return out if rounded is None else (out, rounded)


def fused_add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
    offset: float = 0.0, int8_rows: bool = False, x16_rows: bool = False,
    fp8_rows: bool = False,
) -> tuple[torch.Tensor, torch.Tensor] | tuple[torch.Tensor, torch.Tensor, tuple]:
    """`residual += x` (in place) and returns `(rmsnorm(residual), residual)`; with
    `int8_rows` / `x16_rows` / `fp8_rows`, the norm's rounding third (as `rmsnorm`)."""
    _check(x, weight, offset)
    assert residual.shape == x.shape and residual.device == x.device, (residual.shape, x.shape)
    # Updated in place, so it must be addressable as rows of unit stride.
    assert residual.is_contiguous(), "residual is updated in place and must be contiguous"
    n = x.shape[-1]
    x2d = x.reshape(-1, n)
    if x2d.stride(-1) != 1:
        x2d = x2d.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    form, rounded = _rounding(x, int8_rows, x16_rows, fp8_rows)
    if x2d.shape[0]:
        _launch(x2d, residual.view(-1, n), weight, out.view(-1, n), eps, offset, rounded,
                form)
    return (out, residual) if rounded is None else (out, residual, rounded)
