"""The verdict on greedy drafts in one launch: `spec.rejection.verify_greedy` over the
target's argmax of a verify step's rows, which in torch takes a gather and a dozen small
launches (comparisons, a cumulative product, a sum, a select: ~30 µs of a batch-1 drafted
step on an H200)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _greedy_verdict_kernel(best_ptr, index_ptr, drafts_ptr, num_drafts_ptr, tokens_ptr,
                           num_tokens_ptr, K, BLOCK: tl.constexpr):
    """Row b: its positions' argmax `best[index[b, j]]`, j <= K; drafts accepted up to the
    first that differs (or the first past its num_drafts); those, then the argmax."""
    b = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BLOCK)
    positions = j < K + 1
    rows = tl.load(index_ptr + b * (K + 1) + j, mask=positions, other=0)
    target = tl.load(best_ptr + rows, mask=positions, other=-1)
    drafts = tl.load(drafts_ptr + b * K + j, mask=j < K, other=-1)
    miss = (j >= K) | (j >= tl.load(num_drafts_ptr + b)) | (drafts != target)
    accepted = tl.min(tl.where(miss, j, BLOCK), axis=0)
    tl.store(tokens_ptr + b * (K + 1) + j, tl.where(j <= accepted, target, -1),
             mask=positions)
    tl.store(num_tokens_ptr + b, (accepted + 1).to(tl.int64))


def greedy_verdict(best: torch.Tensor, index: torch.Tensor, draft_ids: torch.Tensor,
                   num_drafts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`verify_greedy(best[index].view(B, K + 1), draft_ids, num_drafts)`'s (token_ids
    `[B, K + 1]`, num_tokens `[B]`), int64: `best` the argmax of every row, `index
    [B * (K + 1)]` the rows of each sequence's positions, `draft_ids [B, K]`, `num_drafts
    [B]` (0..K)."""
    b, k = draft_ids.shape
    assert index.shape == (b * (k + 1),) and num_drafts.shape == (b,), (index.shape, b, k)
    assert best.dim() == 1 and best.device == index.device == draft_ids.device
    tokens = torch.empty(b, k + 1, dtype=torch.int64, device=best.device)
    num_tokens = torch.empty(b, dtype=torch.int64, device=best.device)
    if b:
        _greedy_verdict_kernel[(b,)](
            best, index.contiguous(), draft_ids.contiguous(), num_drafts.contiguous(),
            tokens, num_tokens, k, BLOCK=max(16, triton.next_power_of_2(k + 1)), num_warps=1)
    return tokens, num_tokens
