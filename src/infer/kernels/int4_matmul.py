"""A few rows (3 to MAX_ROWS: a small batch's decode, a verify step) times a 4-bit weight
on the tensor cores: `y [M, N] = x [M, K] @ w [N, K]^T` with `int4_gemv.py`'s weights
(`packed [N / B, K / 8, B]` int32, blocks of B channels K-major, a group's values in
stripes; `scale`, `zero` `[N / B, K / G, B]`).

Each program owns BLOCK_M rows by BLOCK_N channels and walks all of K, a step of
STRIPES groups: the step's words `[STRIPES * G / 8, BLOCK_N]` hold, at each nibble
position i, a plane of weights whose inputs are `g G + i G / 8 + j` (word row g G / 8 + j);
each plane is made float in registers, `q * scale + zero`, and multiplied by x's matching
columns (a gathered tile) with `tl.dot` as TF32 (10 bits of mantissa: a 16-bit x exactly,
each weight to 2^-11 of itself; a bfloat16 MMA would round the weights to 2^-8, and the
CPU's Triton interpreter multiplies bfloat16 wrongly), float32 accumulation: eight MMAs a
step, no weight written anywhere (a dequantized copy of the whole weight is the
alternative, `int4_weights.py`'s for larger steps).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from infer.kernels import dependent_launch, gpu_compiled
from infer.kernels.int4_gemv import WORD, check_layout

MAX_ROWS = 64


@triton.jit
def _plane(words, scale16, zero16, i: tl.constexpr, PTX: tl.constexpr):
    """Nibble position i of `words` as the weights `q * scale + zero`, from `scale16 = 16
    scale` and `zero16 = zero - 16 scale`: the nibble or-ed under the bits of 1.0 is
    `f = 1 + q / 16` (no convert instruction: an H100 converts 16 values a cycle per SM),
    and `f scale16 + zero16` the weight."""
    shifted = words << (19 - 4 * i) if 4 * i <= 19 else words >> (4 * i - 19)
    return _under_one(shifted, PTX).to(tl.float32, bitcast=True) * scale16 + zero16


@triton.jit
def _under_one(shifted, PTX: tl.constexpr):
    """Bits 19..22 of `shifted` or-ed into 1.0's (0x3F800000): on a GPU one `lop3`
    (Triton's and-then-or takes two)."""
    if PTX:
        return tl.inline_asm_elementwise(
            asm="""{
            .reg .b32 m, one;
            mov.b32 m, 0x00780000;
            mov.b32 one, 0x3F800000;
            lop3.b32 $0, $1, m, one, 0xEA;
            }""",
            constraints="=r,r", args=[shifted], dtype=tl.int32, is_pure=True, pack=1)
    return (shifted & (0xF << 19)) | 0x3F800000


@triton.jit
def _int4_matmul_kernel(
    x_ptr, w_ptr, s_ptr, z_ptr, y_ptr, M, N, K, groups, stride_xm, stride_wb, stride_sb,
    stride_ym, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, B: tl.constexpr,
    STRIPES: tl.constexpr, SW: tl.constexpr, PTX: tl.constexpr, PDL: tl.constexpr,
):
    rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    # channels past N read the last block, not stored; a block's rows lie B apart
    block = tl.minimum(rn // B, N // B - 1).to(tl.int64)
    w_cols = block * stride_wb + rn % B
    s_cols = block * stride_sb + rn % B
    rw = tl.arange(0, STRIPES * SW)  # the step's word rows: group rw // SW, j = rw % SW
    group_of = rw // SW
    rows = x_ptr + tl.minimum(rm, M - 1).to(tl.int64)[:, None] * stride_xm
    dependent_launch.wait(PDL)
    dependent_launch.release(PDL)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for g0 in range(0, groups, STRIPES):
        gg = g0 + group_of
        inside = gg[:, None] < groups
        words = tl.load(w_ptr + (g0 * SW + rw)[:, None] * B + w_cols[None, :], mask=inside,
                        other=0, eviction_policy="evict_first")
        at = gg[:, None] * B + s_cols[None, :]
        scale16 = tl.load(s_ptr + at, mask=inside, other=0.0).to(tl.float32) * 16.0
        zero16 = tl.load(z_ptr + at, mask=inside, other=0.0).to(tl.float32) - scale16
        # x's columns of plane i: g G + i G / 8 + j, G = 8 SW
        cols = gg * (8 * SW) + rw % SW
        for i in tl.static_range(8):
            x = tl.load(rows + (cols + i * SW)[None, :], mask=(cols + i * SW < K)[None, :],
                        other=0.0).to(tl.float32)
            acc = tl.dot(x, _plane(words, scale16, zero16, i, PTX), acc, input_precision="tf32")
    tl.store(y_ptr + rm.to(tl.int64)[:, None] * stride_ym + rn[None, :],
             acc.to(y_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


def int4_matmul(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                zero: torch.Tensor, block_n: int = 64, block_k: int = 256,
                num_warps: int = 4) -> torch.Tensor:
    """`x [M, K]` (M <= MAX_ROWS; float16 / bfloat16, unit column stride) times the 4-bit
    weight `(packed [N / B, K / 8, B], scale, zero [N / B, K / G, B])`: `[M, N]` in x's
    dtype."""
    assert x.dim() == 2 and 1 <= x.shape[0] <= MAX_ROWS and x.stride(1) == 1, x.shape
    assert x.dtype in (torch.float16, torch.bfloat16), x.dtype
    blocks, words, block = check_layout(packed, scale, zero)
    n, k, groups = blocks * block, words * WORD, scale.shape[1]
    assert x.shape[1] == k, (x.shape, packed.shape)
    group = k // groups
    m = x.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if n == 0:
        return y
    sw = group // WORD
    stripes = max(1, block_k // group, 16 // sw)  # a plane of 16 rows at least (the MMA's K)
    block_m = max(16, triton.next_power_of_2(m))
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m))
    _int4_matmul_kernel[grid](
        x, packed, scale, zero, y, m, n, k, groups, x.stride(0), packed.stride(0),
        scale.stride(0), y.stride(0), BLOCK_M=block_m, BLOCK_N=block_n, B=block,
        STRIPES=stripes, SW=sw, PTX=gpu_compiled(x.device), num_warps=num_warps,
        **dependent_launch.launch_options())
    return y
