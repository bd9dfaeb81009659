"""Row-wise argmax of `[rows, vocab]` logits in two short launches.

torch's argmax of a single row reduces it in one thread block (~28 µs for 128k columns on
an H100); here every row is cut into parts of `BLOCK` columns, each part reduced by its
own program, then one program per row picks the best part. Ties go to the lowest index,
as torch's; a NaN counts as +inf (torch ranks it above +inf: the two differ only on a
row holding both).

Optional `masks`, a grammar's token bitmask per row in `token_bitmask.py`'s layout, take
part in the same pass: a token they do not allow counts as -inf (`masked_out`, shared with
`race_sample.py`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

BLOCK = 4096


@triton.jit
def masked_out(row_masks_ptr, cols, n_words):
    """True where a row's bitmask (bit j of word i: token 32 i + j allowed) does not allow
    the column; columns past its words are never allowed."""
    words = cols // 32
    w = tl.load(row_masks_ptr + words, mask=words < n_words, other=0)
    # int32 shifts are arithmetic; `& 1` keeps only the bit asked for (bit 31 included).
    return ((w >> (cols % 32)) & 1) == 0


@triton.jit
def _part_kernel(x_ptr, stride_x, n_cols, n_parts, masks_ptr, stride_masks, n_words,
                 val_ptr, idx_ptr, HAS_MASKS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    cols = part * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * stride_x + cols, mask=cols < n_cols,
                other=float("-inf")).to(tl.float32)
    x = tl.where(x != x, float("inf"), x)
    if HAS_MASKS:  # after the NaN rule: a NaN the grammar refuses stays out
        x = tl.where(masked_out(masks_ptr + row * stride_masks, cols, n_words),
                     float("-inf"), x)
    best, at = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(val_ptr + row * n_parts + part, best)
    tl.store(idx_ptr + row * n_parts + part, part * BLOCK + at)


@triton.jit
def _pick_kernel(val_ptr, idx_ptr, out_ptr, n_parts, BLOCK_P: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    parts = tl.arange(0, BLOCK_P)
    vals = tl.load(val_ptr + row * n_parts + parts, mask=parts < n_parts,
                   other=float("-inf"))
    _, at = tl.max(vals, axis=0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(out_ptr + row, tl.load(idx_ptr + row * n_parts + at).to(tl.int64))


def best_of_parts(rows: int, n_parts: int, device: torch.device,
                  parts: Callable[[torch.Tensor, torch.Tensor], None]) -> torch.Tensor:
    """int64 `[rows]`: each row's best column, where `parts(vals, idx)` launches a kernel
    that writes every row's best value `vals [rows, n_parts]` (float32) in each part and
    its column `idx` (int32); one program per row then picks the best part."""
    out = torch.empty(rows, dtype=torch.int64, device=device)
    if rows == 0:
        return out
    vals = torch.empty(rows, n_parts, dtype=torch.float32, device=device)
    idx = torch.empty(rows, n_parts, dtype=torch.int32, device=device)
    parts(vals, idx)
    _pick_kernel[(rows,)](vals, idx, out, n_parts,
                          BLOCK_P=max(16, triton.next_power_of_2(n_parts)), num_warps=1)
    return out


def check_masks(masks: torch.Tensor | None, x: torch.Tensor) -> None:
    """`masks`, if any: [rows of x, words] int32, contiguous, on x's device."""
    if masks is not None:
        assert masks.dim() == 2 and len(masks) == len(x), (masks.shape, x.shape)
        assert masks.dtype == torch.int32 and masks.is_contiguous(), masks.dtype
        assert masks.device == x.device, (masks.device, x.device)


def mask_strides(masks: torch.Tensor | None) -> tuple[int, int]:
    """The kernels' (row stride, words) of `masks` (unused without)."""
    return (0, 0) if masks is None else (masks.stride(0), masks.shape[1])


def argmax_rows(x: torch.Tensor, masks: torch.Tensor | None = None) -> torch.Tensor:
    """int64 `[rows]`: the column of each row's largest value (`x.argmax(dim=-1)`), among
    the columns `masks` [rows, words] allows if given (`check_masks`)."""
    assert x.dim() == 2 and x.stride(1) == 1, (x.shape, x.stride())
    check_masks(masks, x)
    rows, n_cols = x.shape
    n_parts = triton.cdiv(n_cols, BLOCK)

    def parts(vals: torch.Tensor, idx: torch.Tensor) -> None:
        _part_kernel[(rows, n_parts)](x, x.stride(0), n_cols, n_parts,
                                      masks if masks is not None else vals,
                                      *mask_strides(masks), vals, idx,
                                      HAS_MASKS=masks is not None, BLOCK=BLOCK, num_warps=8)

    return best_of_parts(rows, n_parts, x.device, parts)
