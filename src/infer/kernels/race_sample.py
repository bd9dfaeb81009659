"""One sampled token per row by the exponential race, fused: temperature, noise and argmax
in one pass over the logits (each row's last program picks its best part, as in
`argmax.py`).

The sampler's torch path (`engine.sampler._race`) makes the noise tensor, clamps it, takes
its log, subtracts and reduces: five passes over a float32 `[rows, vocab]` and as many
launches. Here each program reads one part of one row's logits, divides by the row's
temperature (if given), draws its Exp(1) noise E from Philox (`seeded_noise.philox_uniform`)
and keeps the best x - log E of its part, as `argmax.py`'s parts do.

A row's mode picks its noise: 0 none (a greedy row: its argmax), 1 a seeded request's
stream, key = its seed, counter = (column, output position, 0, 0) -- the very draws of
`seeded_noise` stream 0 --, 2 an unseeded row's, key = this step's key, counter = (column,
row, 2, 0). Without per-row modes every row is unseeded. A seeded row's position is its
entry in the modes plus `position_shift`: the same rows' next steps keep their modes on the
device and move every position by one scalar.

With `masks` (a grammar's token bitmask per row, `token_bitmask.py`'s layout) a token they
do not allow counts as -inf before anything else: constrained rows cost no launch of
their own.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from infer.kernels.argmax import (
    best_of_parts,
    check_masks,
    mask_strides,
    masked_out,
    store_part,
)
from infer.kernels.seeded_noise import philox_uniform

BLOCK = 4096
# A row's mode (the kernel's constants; `.value` on the host)
GREEDY, SEEDED, UNSEEDED = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)


@triton.jit(do_not_specialize=["step_key", "n_rows", "position_shift"])
def _race_part_kernel(x_ptr, stride_x, n_cols, n_parts, temperature_ptr, modes_ptr, n_rows,
                      step_key, position_shift, masks_ptr, stride_masks, n_words, val_ptr,
                      idx_ptr, out_ptr, counts_ptr, HAS_TEMPERATURE: tl.constexpr,
                      HAS_MODES: tl.constexpr, HAS_MASKS: tl.constexpr, BLOCK: tl.constexpr,
                      BLOCK_P: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    cols = part * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * stride_x + cols, mask=cols < n_cols,
                other=float("-inf")).to(tl.float32)
    if HAS_MASKS:
        x = tl.where(masked_out(masks_ptr + row * stride_masks, cols, n_words),
                     float("-inf"), x)
    if HAS_TEMPERATURE:
        x = x / tl.load(temperature_ptr + row)
    if HAS_MODES:
        mode = tl.load(modes_ptr + row)
        seed = tl.where(mode == UNSEEDED, step_key.to(tl.int64),
                        tl.load(modes_ptr + n_rows + row))
        position = tl.load(modes_ptr + 2 * n_rows + row)
        position = tl.where(mode == SEEDED, position + position_shift, position)
    else:
        mode = UNSEEDED
        seed = step_key.to(tl.int64)  # typed i32 where the value fits
        position = row
    stream = tl.where(mode == UNSEEDED, 2, 0).to(tl.uint32)
    u = philox_uniform(seed, position, cols, stream)
    score = x - tl.log(-tl.log(u))  # u in (0, 1): E = -log u is finite and > 0
    score = tl.where(mode == GREEDY, x, score)
    score = tl.where(score != score, float("inf"), score)
    best, at = tl.max(score, axis=0, return_indices=True, return_indices_tie_break_left=True)
    store_part(best, part * BLOCK + at, val_ptr, idx_ptr, out_ptr, counts_ptr, row, part,
               n_parts, BLOCK_P)


def race_sample(x: torch.Tensor, step_key: int, temperature: torch.Tensor | None = None,
                modes: torch.Tensor | None = None, block: int = BLOCK,
                masks: torch.Tensor | None = None, position_shift: int = 0) -> torch.Tensor:
    """int64 `[rows]`: each row's token, argmax over columns of x / temperature - log E.

    `x` [rows, vocab] float, unit column stride; `temperature` [rows] or [rows, 1] float32
    (none: x is already divided); `modes` [3, rows] int64 (mode, seed, position per row,
    see the module's doc; an unseeded row's seed is not read; none: every row unseeded);
    `position_shift` added to the seeded rows' positions; `step_key` a 64-bit key for the
    unseeded rows (two's complement int), new each step; `block`: columns per program (a
    power of two); `masks` [rows, words] int32 token bitmasks (`check_masks`)."""
    assert x.dim() == 2 and x.stride(1) == 1, (x.shape, x.stride())
    rows, n_cols = x.shape
    if temperature is not None:
        assert temperature.dtype == torch.float32 and temperature.numel() == rows
        assert temperature.is_contiguous() and temperature.device == x.device
    if modes is not None:
        assert modes.shape == (3, rows) and modes.dtype == torch.int64, modes.shape
        assert modes.is_contiguous() and modes.device == x.device
    assert -(2**63) <= step_key < 2**63, step_key
    assert 0 <= position_shift < 2**31, position_shift
    check_masks(masks, x)
    n_parts = triton.cdiv(n_cols, block)

    def parts(vals: torch.Tensor, idx: torch.Tensor, out: torch.Tensor, counts: torch.Tensor,
              BLOCK_P: int) -> None:
        _race_part_kernel[(rows, n_parts)](
            x, x.stride(0), n_cols, n_parts, temperature if temperature is not None else x,
            modes if modes is not None else vals, rows, step_key, position_shift,
            masks if masks is not None else vals, *mask_strides(masks), vals, idx, out,
            counts, HAS_TEMPERATURE=temperature is not None, HAS_MODES=modes is not None,
            HAS_MASKS=masks is not None, BLOCK=block, BLOCK_P=BLOCK_P, num_warps=8)

    return best_of_parts(rows, n_parts, x.device, parts)
