"""A step's drafts judged from its logits: the target's distributions at each drafted
position (the sampler's own temperature / top-k / top-p / min-p and banned tokens, per
position), the random draws (per seeded request and position, so batch-invariant), then
`rejection.verify`."""

from __future__ import annotations

import torch

from infer.engine.sampler import SamplingBatch, filter_logits, seeded_draws
from infer.spec.rejection import Verified, verify, verify_greedy
from infer.transfer import to_device


def verify_drafts(logits: torch.Tensor, batch: SamplingBatch, counts: list[int],
                  drafts: list[list[int]], greedy: list[bool], seeds: list[int | None],
                  positions: list[int]) -> Verified:
    """`logits [sum(counts), V]`: request i's `counts[i] = 1 + len(drafts[i])` rows in
    order, `batch` built for those rows (each at its own output position); `positions[i]`:
    the output index of request i's first row. Penalties are not applied (requests with
    penalties are not speculated)."""
    b, k = len(counts), max(counts) - 1
    v, device = logits.shape[1], logits.device
    x = logits.float()
    if batch.banned is not None:
        x = x.masked_fill(batch.banned, float("-inf"))
    # [B, K + 1]: request i's rows, its last one repeated past them (never read)
    index = to_device(torch.tensor([start + min(j, c - 1)
                                    for start, c in zip(_starts(counts), counts)
                                    for j in range(k + 1)]), device)
    draft_ids = torch.tensor([d + [0] * (k - len(d)) for d in drafts], dtype=torch.long)
    num_drafts = to_device(torch.tensor([len(d) for d in drafts]), device)
    if all(greedy):  # a draft's verdict needs only the argmax
        return verify_greedy(x.argmax(dim=-1)[index].view(b, k + 1),
                             to_device(draft_ids, device), num_drafts)
    probs = (x if batch.all_greedy else filter_logits(x, batch)).softmax(dim=-1)
    target = probs[index].view(b, k + 1, v)
    uniforms = torch.rand(b, k, device=device)
    noise = torch.empty(b, k + 1, v, device=device).exponential_()
    for i, (seed, pos) in enumerate(zip(seeds, positions)):
        if seed is not None and not greedy[i]:
            uniforms[i] = seeded_draws(seed, pos, (k,), device, "uniform")
            for j in range(k + 1):
                noise[i, j] = seeded_draws(seed, pos + j, (v,), device)
    noise.clamp_min_(torch.finfo(noise.dtype).tiny)
    return verify(target, to_device(draft_ids, device), num_drafts,
                  to_device(torch.tensor(greedy), device), uniforms, noise)


def _starts(counts: list[int]) -> list[int]:
    starts, total = [], 0
    for c in counts:
        starts.append(total)
        total += c
    return starts
