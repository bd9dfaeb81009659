"""One row of x rounded to int8 per 32 values, as the GGUF int8-x kernels take it
(`gguf_q4k_int8x`, `gguf_q6k_int8x`, `gguf_q8_0_int8x`): `(int8 [K], side [K / 64, 4])`,
each value `round(x / step)` (half away from zero) with its block's step `amax / 127` (0
for a block of zeros); for each pair of blocks of 32, `side` holds their two steps, then
their two exact sums (float32).

`quantize_x` rounds a row as it is, or the gated activation `act(gate) * up` of a
`[gate | up]` row (first rounded to the row's dtype, as `activation.gated_rows` stores
it): the activation and the rounding in one launch. `store_rounded` is the rounding for
a kernel that has the row in registers (the RMSNorm's, `rmsnorm.py`).

A row rounded by the kernel that made it travels with it to the matmul (`attach`,
`attached`): the tensor object carries its rounding. Invariant: such a tensor is never
changed in place (a norm's output goes straight into its projections), since under
`torch.inference_mode` no version counter could tell.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from infer.kernels import dependent_launch
from infer.kernels.activation import gated

SUB_K = 32  # values a step


@triton.jit
def store_rounded(xq_ptr, side_ptr, x, b, in_row):
    """Round `x [B, 32]` (float32), blocks `b [B, 1]` of the row (those where `in_row`;
    every block whole) and store the int8 values, steps and sums in this module's
    layout."""
    amax = tl.max(tl.abs(x), axis=1, keep_dims=True)
    inverse = tl.where(amax > 0, 127.0 / amax, 0.0)
    q = (x * inverse + tl.where(x < 0, -0.5, 0.5)).to(tl.int32)
    q = tl.minimum(tl.maximum(q, -127), 127)
    tl.store(xq_ptr + b * 32 + tl.arange(0, 32)[None, :], q.to(tl.int8), mask=in_row)
    at = side_ptr + b // 2 * 4 + b % 2
    tl.store(at, amax / 127.0, mask=in_row)
    tl.store(at + 2, tl.sum(x, axis=1, keep_dims=True), mask=in_row)


@triton.jit
def _quantize_x_kernel(x_ptr, xq_ptr, side_ptr, blocks, inter, BLOCKS: tl.constexpr,
                       ACT: tl.constexpr, PDL: tl.constexpr):
    """Blocks of 32 values of x (ACT "": x itself; else act(gate) * up of the row
    `[gate | up]`, gate and up `inter` wide, rounded to x's dtype first)."""
    dependent_launch.wait(PDL)
    dependent_launch.release(PDL)
    b = tl.program_id(0) * BLOCKS + tl.arange(0, BLOCKS)[:, None]
    at = b * 32 + tl.arange(0, 32)[None, :]
    x = tl.load(x_ptr + at, mask=b < blocks, other=0.0)
    if ACT != "":
        up = tl.load(x_ptr + inter + at, mask=b < blocks, other=0.0)
        x = gated(x, up, ACT).to(x_ptr.dtype.element_ty)
    store_rounded(xq_ptr, side_ptr, x.to(tl.float32), b, b < blocks)


def quantize_x(x: torch.Tensor, act: str = "") -> tuple[torch.Tensor, torch.Tensor]:
    """`x [1, K]` (K a multiple of 64) rounded, in this module's layout; with `act` (one
    of `activation.gated`'s), `x [1, 2K]` is `[gate | up]` and `act(gate) * up` is."""
    k = x.shape[-1] // (2 if act else 1)
    assert k % (2 * SUB_K) == 0 and x.stride(-1) == 1 and x.numel() == x.shape[-1], (
        x.shape, x.stride())
    blocks = k // SUB_K
    xq = torch.empty(k, dtype=torch.int8, device=x.device)
    side = torch.empty((blocks // 2, 4), dtype=torch.float32, device=x.device)
    per_program = 32
    _quantize_x_kernel[(triton.cdiv(blocks, per_program),)](
        x, xq, side, blocks, k, BLOCKS=per_program, ACT=act, num_warps=4,
        **dependent_launch.launch_options())
    return xq, side


Rounded = tuple[torch.Tensor, torch.Tensor]


def attach(x: torch.Tensor, rounded: Rounded) -> torch.Tensor:
    """`x`, carrying `rounded` (this module's rounding of x as it is) for the matmuls it
    goes into."""
    x.int8_rows = rounded
    return x


def attached(x: torch.Tensor) -> Rounded | None:
    """The rounding `x` carries (`attach`), if any."""
    return getattr(x, "int8_rows", None)
