"""Verification of draft tokens against the target model, batched on the device.

Row b proposed `num_drafts[b]` tokens `d_1..d_j`; the target's distributions `p_0..p_j` at
those positions came out of one forward (after temperature / top-k / top-p). Greedy rows
accept drafts while each equals the target's argmax, then take the argmax. Sampled rows use
the standard rule (Leviathan et al., Chen et al., 2023), which leaves the output distributed
exactly as the target's:
    accept d_i with probability min(1, p_i(d_i) / q_i(d_i)), q_i the draft's distribution;
    at the first rejection sample from max(0, p_i - q_i) renormalised, and stop;
    if every draft is accepted, sample one more token from p_j.
A draft with no distribution (n-gram: a deterministic proposal) has q_i one-hot at d_i.

The random draws come from the caller (`uniforms`, `noise`), so that a seeded request draws
the same numbers whatever else is in the batch; sampling from a distribution is the
exponential race, argmax_v w_v / E_v (E_v ~ Exp(1)), which needs no normalising.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Verified:
    """`token_ids [B, K + 1]`: row b's first `num_tokens[b]` entries are its accepted drafts
    followed by one token the target chose (the rest -1); `num_accepted = num_tokens - 1`."""

    token_ids: torch.Tensor
    num_tokens: torch.Tensor

    @property
    def num_accepted(self) -> torch.Tensor:
        return self.num_tokens - 1


def _accept(p_draft: torch.Tensor, q_draft: torch.Tensor, uniforms: torch.Tensor
            ) -> torch.Tensor:
    """u < p / q, as u * q < p (no division; q > 0 wherever the draft could propose)."""
    return uniforms * q_draft < p_draft


def verify_greedy(argmax: torch.Tensor, draft_ids: torch.Tensor, num_drafts: torch.Tensor
                  ) -> Verified:
    """`verify` for a batch of greedy rows from the target's argmax alone (`[B, K + 1]`):
    no distributions, no draws."""
    k1 = argmax.shape[1]
    positions = torch.arange(k1 - 1, device=argmax.device)
    ok = (draft_ids == argmax[:, :-1]) & (positions[None, :] < num_drafts[:, None])
    accepted = ok.long().cumprod(dim=1).sum(dim=1)
    keep = torch.arange(k1, device=argmax.device)[None, :] <= accepted[:, None]
    return Verified(torch.where(keep, argmax, -1), accepted + 1)


def verify(target_probs: torch.Tensor, draft_ids: torch.Tensor, num_drafts: torch.Tensor,
           greedy: torch.Tensor, uniforms: torch.Tensor, noise: torch.Tensor,
           draft_probs: torch.Tensor | None = None) -> Verified:
    """`target_probs [B, K + 1, V]` (rows past a row's drafts are ignored), `draft_ids
    [B, K]` (padding anything in range), `num_drafts [B]` (0..K), `greedy [B]` bool,
    `uniforms [B, K]` in [0, 1), `noise [B, K + 1, V]` Exp(1) draws, `draft_probs [B, K, V]`
    or None for deterministic drafts."""
    b, k1, v = target_probs.shape
    k = k1 - 1
    assert k >= 1, "verify needs room for at least one draft"
    assert draft_ids.shape == (b, k) and num_drafts.shape == (b,) and greedy.shape == (b,)
    assert uniforms.shape == (b, k) and noise.shape == (b, k1, v)
    positions = torch.arange(k, device=target_probs.device)
    proposed = positions[None, :] < num_drafts[:, None]
    ids = draft_ids.clamp(0, v - 1).long()
    p_draft = target_probs[:, :k].gather(2, ids[..., None])[..., 0]
    if draft_probs is None:
        q_draft = torch.ones_like(p_draft)
    else:
        q_draft = draft_probs.gather(2, ids[..., None])[..., 0]
    argmax = target_probs.argmax(dim=2)
    ok = torch.where(greedy[:, None], ids == argmax[:, :k], _accept(p_draft, q_draft, uniforms))
    ok &= proposed
    accepted = ok.long().cumprod(dim=1).sum(dim=1)  # drafts accepted before the first miss

    # The token after the accepted drafts: at a rejection the residual max(0, p - q), after
    # all of a row's drafts the target's own distribution.
    at = accepted[:, None, None].expand(b, 1, v)
    p_at = target_probs.gather(1, at)[:, 0]
    rejected = accepted < num_drafts
    last = accepted.clamp(max=k - 1)  # where a row rejected (accepted < its drafts <= K)
    if draft_probs is None:
        q_at = F.one_hot(ids.gather(1, last[:, None])[:, 0], v).to(p_at.dtype)
    else:
        q_at = draft_probs.gather(1, last[:, None, None].expand(b, 1, v))[:, 0]
    weights = torch.where(rejected[:, None], (p_at - q_at).clamp(min=0), p_at)
    sampled = (weights / noise.gather(1, at)[:, 0]).argmax(dim=1)
    chosen = torch.where(greedy, argmax.gather(1, accepted[:, None])[:, 0], sampled)

    token_ids = torch.full((b, k1), -1, dtype=torch.long, device=target_probs.device)
    keep = positions[None, :] < accepted[:, None]
    token_ids[:, :k] = torch.where(keep, ids, token_ids[:, :k])
    token_ids.scatter_(1, accepted[:, None], chosen[:, None])
    return Verified(token_ids, accepted + 1)
