"""Row-wise argmax of `[rows, vocab]` logits in one short launch.

torch's argmax of a single row reduces it in one thread block (~28 µs for 128k columns on
an H100); here every row is cut into parts of `BLOCK` columns, each part reduced by its
own program, and the row's last program to finish (a counter per row, left at zero)
picks the best part. Ties go to the lowest index, as torch's; a NaN counts as +inf
(torch ranks it above +inf: the two differ only on a row holding both).

Optional `masks`, a grammar's token bitmask per row in `token_bitmask.py`'s layout, take
part in the same pass: a token they do not allow counts as -inf (`masked_out`, shared with
`race_sample.py`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from infer.kernels import launch_counters

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
                 val_ptr, idx_ptr, out_ptr, counts_ptr, HAS_MASKS: tl.constexpr,
                 BLOCK: tl.constexpr, BLOCK_P: tl.constexpr):
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
    store_part(best, part * BLOCK + at, val_ptr, idx_ptr, out_ptr, counts_ptr, row, part,
               n_parts, BLOCK_P)


@triton.jit
def store_part(best, at, val_ptr, idx_ptr, out_ptr, counts_ptr, row, part, n_parts,
               BLOCK_P: tl.constexpr):
    """Store a part's best value and its column; the row's last part to get here writes
    the row's best column to `out` and sets its counter back to zero."""
    tl.store(val_ptr + row * n_parts + part, best)
    tl.store(idx_ptr + row * n_parts + part, at)
    tl.debug_barrier()  # the part stored before the count releases it
    if tl.atomic_add(counts_ptr + row, 1, sem="acq_rel") == n_parts - 1:
        parts = tl.arange(0, BLOCK_P)
        vals = tl.load(val_ptr + row * n_parts + parts, mask=parts < n_parts,
                       other=float("-inf"), cache_modifier=".cg")
        _, k = tl.max(vals, axis=0, return_indices=True, return_indices_tie_break_left=True)
        column = tl.load(idx_ptr + row * n_parts + k, cache_modifier=".cg")
        tl.store(out_ptr + row, column.to(tl.int64))
        tl.atomic_xchg(counts_ptr + row, 0, sem="relaxed")


MAX_ROWS = 1 << 16  # rows a launch may have: a counter each
_SCRATCH: dict[tuple[torch.device, int, int], tuple[torch.Tensor, torch.Tensor]] = {}


def _part_scratch(device: torch.device, rows: int, n_parts: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The parts' values and columns, `[rows, n_parts]`: one pair per device and shape,
    reused by every launch (a launch's last programs read its parts before the stream's
    next launch writes them); a graph being captured gets its own."""
    key = (device, rows, n_parts)
    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    scratch = None if capturing else _SCRATCH.get(key)
    if scratch is None:
        scratch = (torch.empty(rows, n_parts, dtype=torch.float32, device=device),
                   torch.empty(rows, n_parts, dtype=torch.int32, device=device))
        if not capturing:
            _SCRATCH[key] = scratch
    return scratch


def best_of_parts(rows: int, n_parts: int, device: torch.device,
                  parts: Callable[..., None]) -> torch.Tensor:
    """int64 `[rows]`: each row's best column, where `parts(vals, idx, out, counts,
    BLOCK_P=...)` launches a kernel whose programs each reduce one part of a row and end
    in `store_part` (`vals [rows, n_parts]` float32, `idx` int32: scratch, reused; `counts`
    the rows' counters, zero, and zero again after the launch)."""
    out = torch.empty(rows, dtype=torch.int64, device=device)
    if rows == 0:
        return out
    counts = launch_counters("argmax", device, MAX_ROWS, rows)
    vals, idx = _part_scratch(device, rows, n_parts)
    parts(vals, idx, out, counts, BLOCK_P=max(16, triton.next_power_of_2(n_parts)))
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

    def parts(vals: torch.Tensor, idx: torch.Tensor, out: torch.Tensor, counts: torch.Tensor,
              BLOCK_P: int) -> None:
        _part_kernel[(rows, n_parts)](x, x.stride(0), n_cols, n_parts,
                                      masks if masks is not None else vals,
                                      *mask_strides(masks), vals, idx, out, counts,
                                      HAS_MASKS=masks is not None, BLOCK=BLOCK,
                                      BLOCK_P=BLOCK_P, num_warps=8)

    return best_of_parts(rows, n_parts, x.device, parts)
