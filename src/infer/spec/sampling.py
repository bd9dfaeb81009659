"""A step's drafts judged from its logits: the target's distributions at each drafted
position (the sampler's own banned tokens and logit bias, penalties, temperature / top-k /
top-p / min-p, per position), the random draws (per seeded request and position, so
batch-invariant), then `rejection.verify`; and the raw logprobs of the tokens it keeps."""

from __future__ import annotations

from typing import NamedTuple

import torch

from infer.engine.sampler import (
    SamplingBatch,
    apply_bans_and_bias,
    apply_penalties,
    argmax,
    fill_seeded,
    filter_logits,
    raw_logprobs,
)
from infer.kernels import triton_available
from infer.spec.rejection import Verified, verify, verify_greedy
from infer.transfer import to_device


def verify_drafts(logits: torch.Tensor, batch: SamplingBatch, counts: list[int],
                  drafts: list[list[int]], greedy: list[bool], seeds: list[int | None],
                  positions: list[int], on_device: list[torch.Tensor | None] | None = None
                  ) -> Verified:
    """`logits [sum(counts), V]`: request i's `counts[i] = 1 + len(drafts[i])` rows in
    order, `batch` built for those rows (each at its own output position, its drafts
    before it counted as output); `positions[i]`: the output index of request i's first
    row. `on_device[i]`, where given: request i's drafts on the device (`drafts[i]` then
    holds placeholders of their number)."""
    b, k = len(counts), max(counts) - 1
    v, device = logits.shape[1], logits.device
    x = apply_penalties(apply_bans_and_bias(logits.float(), batch), batch)
    # One copy to the device: the rows' index, then each request's number of drafts.
    rows_and_counts = to_device(
        torch.tensor(_padded_row_index(counts) + [len(d) for d in drafts]), device)
    index, num_drafts = rows_and_counts[:b * (k + 1)], rows_and_counts[b * (k + 1):]
    draft_ids = _draft_ids(drafts, k, on_device, device)
    if all(greedy):  # a draft's verdict needs only the argmax
        best = argmax(x)
        if best.is_cuda and triton_available():
            from infer.kernels.greedy_verdict import greedy_verdict

            return Verified(*greedy_verdict(best, index, draft_ids, num_drafts))
        return verify_greedy(best[index].view(b, k + 1), draft_ids, num_drafts)
    probs = (x if batch.all_greedy else filter_logits(x, batch)).softmax(dim=-1)
    target = probs[index].view(b, k + 1, v)
    uniforms = torch.rand(b, k, device=device)
    noise = torch.empty(b, k + 1, v, device=device).exponential_()
    seeded = [i for i, seed in enumerate(seeds) if seed is not None and not greedy[i]]
    fill_seeded(uniforms, seeded, [seeds[i] for i in seeded], [positions[i] for i in seeded],
                "uniform")
    at = [(i, j) for i in seeded for j in range(k + 1)]  # the draw of position j of row i
    fill_seeded(noise.view(b * (k + 1), v), [i * (k + 1) + j for i, j in at],
                [seeds[i] for i, _ in at], [positions[i] + j for i, j in at])
    noise.clamp_min_(torch.finfo(noise.dtype).tiny)
    return verify(target, draft_ids, num_drafts,
                  to_device(torch.tensor(greedy), device), uniforms, noise)


class VerifiedLogprobs(NamedTuple):
    chosen: torch.Tensor  # [B, K + 1]: each kept token's raw logprob (garbage past them)
    ranks: torch.Tensor  # [B, K + 1]: each kept token's rank (1 = most likely)
    top_ids: torch.Tensor | None  # [B, K + 1, n]: the n most likely tokens at each position
    top_logprobs: torch.Tensor | None  # [B, K + 1, n]


def verified_logprobs(logits: torch.Tensor, counts: list[int], token_ids: torch.Tensor,
                      num_logprobs: int) -> VerifiedLogprobs:
    """Raw logprobs (the model's log-softmax, as the sampler reports them) at each position
    of a verified row: of the token kept there (`token_ids [B, K + 1]`, -1 past the kept
    ones), with its rank, and of the `num_logprobs` most likely tokens (none if 0)."""
    b, k1 = token_ids.shape
    x = logits.float()[_padded_rows(counts, logits.device)]
    chosen, ranks, ids, lps = raw_logprobs(x, token_ids.view(-1), num_logprobs)
    if ids is None:
        return VerifiedLogprobs(chosen.view(b, k1), ranks.view(b, k1), None, None)
    return VerifiedLogprobs(chosen.view(b, k1), ranks.view(b, k1), ids.view(b, k1, -1),
                            lps.view(b, k1, -1))


def _padded_rows(counts: list[int], device: torch.device) -> torch.Tensor:
    """[B x (K + 1)] row indices: request i's rows, its last one repeated past them (those
    are never read)."""
    return to_device(torch.tensor(_padded_row_index(counts)), device)


def _padded_row_index(counts: list[int]) -> list[int]:
    k1 = max(counts)
    index, start = [], 0
    for c in counts:
        index.extend(start + min(j, c - 1) for j in range(k1))
        start += c
    return index


def _draft_ids(drafts: list[list[int]], k: int, on_device: list[torch.Tensor | None] | None,
               device: torch.device) -> torch.Tensor:
    """`[B, K]` int64 on the device: each request's drafts, zeros past them; those of
    `on_device` taken from there (without a copy to make where one request has K)."""
    if on_device and all(ids is not None and len(ids) == k for ids in on_device):
        return on_device[0][None] if len(on_device) == 1 else torch.stack(on_device)
    draft_ids = to_device(torch.tensor([[max(t, 0) for t in d] + [0] * (k - len(d))
                                        for d in drafts], dtype=torch.long), device)
    for i, ids in enumerate(on_device or ()):
        if ids is not None:
            draft_ids[i, :len(ids)] = ids
    return draft_ids
