"""Token bitmask: disallowed tokens -> -inf on chosen rows of the logits, in place.

The grammar library's layout: bit j of word i of a mask row set means token 32 i + j is
allowed; tokens at or past 32 * words are never allowed (the logits may be wider than the
mask). Mask row r applies to logits row r, for the rows in `rows` (default: every row of
the mask). Each program expands one block of one row's mask words and writes -inf where a
token is disallowed: the logits are never read, allowed entries never written.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_WORDS = 64  # 2048 tokens per program


@triton.jit
def _token_bitmask_kernel(
    logits_ptr, masks_ptr, rows_ptr,
    stride_logits, stride_masks, n_cols, n_words,
    HAS_ROWS: tl.constexpr, BLOCK_WORDS: tl.constexpr,
):
    if HAS_ROWS:
        row = tl.load(rows_ptr + tl.program_id(0)).to(tl.int64)
    else:
        row = tl.program_id(0).to(tl.int64)
    words = tl.program_id(1) * BLOCK_WORDS + tl.arange(0, BLOCK_WORDS)
    bits = tl.arange(0, 32)
    # Past the mask's words `other=0` reads as "nothing allowed".
    w = tl.load(masks_ptr + row * stride_masks + words, mask=words < n_words, other=0)
    # int32 shifts are arithmetic; `& 1` keeps only the bit asked for (bit 31 included).
    allowed = (w[:, None] >> bits[None, :]) & 1
    cols = words[:, None] * 32 + bits[None, :]
    neg_inf = tl.full([BLOCK_WORDS, 32], float("-inf"), logits_ptr.dtype.element_ty)
    tl.store(logits_ptr + row * stride_logits + cols, neg_inf,
             mask=(cols < n_cols) & (allowed == 0))


def apply_token_bitmask(logits: torch.Tensor, masks: torch.Tensor,
                        rows: torch.Tensor | None = None) -> None:
    """`logits[r, j] = -inf` where token j is not allowed by `masks[r]`, for r in `rows`
    (default: `range(len(masks))`). `logits` [B, V] float with unit column stride; `masks`
    [R, W] int32 contiguous, on the same device; `rows` [n] integer ids < min(B, R) (not
    checked: that would read them back)."""
    assert logits.dim() == 2 and logits.stride(1) == 1, (logits.shape, logits.stride())
    assert logits.dtype in (torch.float16, torch.bfloat16, torch.float32), logits.dtype
    assert masks.dim() == 2 and masks.dtype == torch.int32 and masks.is_contiguous()
    assert masks.device == logits.device, (masks.device, logits.device)
    if rows is None:
        assert len(masks) <= len(logits), (masks.shape, logits.shape)
        n = len(masks)
    else:
        assert rows.dim() == 1 and rows.is_contiguous() and rows.device == logits.device
        assert not rows.is_floating_point() and not rows.is_complex(), rows.dtype
        n = len(rows)
    n_cols = logits.shape[1]
    if n == 0 or n_cols == 0:
        return
    grid = (n, triton.cdiv(triton.cdiv(n_cols, 32), BLOCK_WORDS))
    _token_bitmask_kernel[grid](
        logits, masks, rows if rows is not None else masks,
        logits.stride(0), masks.stride(0), n_cols, masks.shape[1],
        HAS_ROWS=rows is not None, BLOCK_WORDS=BLOCK_WORDS, num_warps=4,
    )
