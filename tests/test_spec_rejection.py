"""Verification of draft tokens (`spec/rejection.py`): greedy rows by hand, sampled rows by
their distribution — with a deliberately bad draft, every emitted token must still follow
the target's distribution (a chi-square test over 20,000 draws per case), and the same
test must reject a wrong acceptance rule."""

from __future__ import annotations

import math

import pytest
import torch

from infer.spec import rejection
from infer.spec.rejection import verify

V, K, DRAWS = 7, 3, 20_000


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """P(chi2 >= observed) for counts against probs, V - 1 = 6 degrees of freedom (even:
    the survival function is exp(-x/2) * sum_{i<3} (x/2)^i / i!)."""
    n = counts.sum().item()
    expected = probs.double() * n
    x = (((counts.double() - expected) ** 2) / expected).sum().item()
    return math.exp(-x / 2) * sum((x / 2) ** i / math.factorial(i) for i in range(3))


def case(seed: int, deterministic: bool, mixed_lengths: bool):
    gen = torch.Generator().manual_seed(seed)
    target = torch.softmax(torch.randn(K + 1, V, generator=gen) * 1.5, dim=1)
    target = (target + 0.02) / (target + 0.02).sum(dim=1, keepdim=True)  # every count >= ~5
    # a bad draft: most of its mass where the target puts little
    draft = torch.softmax(-torch.log(target[:K]) * 2, dim=1)
    if deterministic:  # n-gram-like: one fixed proposal per position, the second likeliest
        draft_ids = torch.tensor([int(target[i].argsort()[-2]) for i in range(K)]).repeat(
            DRAWS, 1)
        draft_probs = None
    else:
        draft_ids = torch.stack([torch.multinomial(draft[i], DRAWS, replacement=True,
                                                   generator=gen) for i in range(K)], dim=1)
        draft_probs = draft.expand(DRAWS, K, V)
    num_drafts = (torch.randint(0, K + 1, (DRAWS,), generator=gen) if mixed_lengths
                  else torch.full((DRAWS,), K))
    out = verify(target.expand(DRAWS, K + 1, V), draft_ids, num_drafts,
                 torch.zeros(DRAWS, dtype=torch.bool), torch.rand(DRAWS, K, generator=gen),
                 torch.empty(DRAWS, K + 1, V).exponential_(generator=gen), draft_probs)
    return target, out, num_drafts


def position_p_values(target, out) -> list[float]:
    values = []
    for j in range(K + 1):
        reached = out.num_tokens > j
        if reached.sum() < 500:
            continue
        counts = torch.bincount(out.token_ids[reached, j], minlength=V)
        values.append(chi_square_p(counts, target[j]))
    return values


@pytest.mark.parametrize(("deterministic", "mixed"), [(False, False), (False, True),
                                                      (True, False), (True, True)])
def test_every_emitted_token_follows_the_target(deterministic, mixed):
    target, out, num_drafts = case(1 + deterministic + 2 * mixed, deterministic, mixed)
    assert ((out.num_tokens >= 1) & (out.num_tokens <= num_drafts + 1)).all()
    values = position_p_values(target, out)
    assert len(values) >= 2, values
    assert min(values) > 0.001, values


def test_a_wrong_acceptance_rule_is_caught(monkeypatch):
    """Accepting with probability p(d) (forgetting the draft's q) skews the output toward
    the draft: the same test must fail."""
    monkeypatch.setattr(rejection, "_accept", lambda p, q, u: u < p)
    target, out, _ = case(1, False, False)
    assert min(position_p_values(target, out)) < 0.001


def test_greedy_rows_accept_while_the_draft_is_the_argmax():
    #                   position 0        1                2                3
    probs = torch.tensor([[0.1, 0.7, 0.2], [0.6, 0.3, 0.1], [0.2, 0.2, 0.6], [0.5, 0.4, 0.1]])
    target = probs.expand(3, 4, 3)
    drafts = torch.tensor([[1, 0, 0], [1, 0, 2], [2, 0, 2]])
    out = verify(target, drafts, torch.tensor([3, 3, 2]), torch.ones(3, dtype=torch.bool),
                 torch.zeros(3, 3), torch.ones(3, 4, 3))
    # row 0: 1, 0 accepted, 0 != argmax 2 -> 2; row 1: all three, then the bonus argmax 0;
    # row 2: its first draft misses -> the argmax 1
    assert out.token_ids.tolist() == [[1, 0, 2, -1], [1, 0, 2, 0], [1, -1, -1, -1]]
    assert out.num_tokens.tolist() == [3, 4, 1]
    assert out.num_accepted.tolist() == [2, 3, 0]


def test_the_greedy_shortcut_matches_the_full_rule():
    """`verify_greedy` (argmax only) against `verify` with every row greedy, on drafts that
    often equal the argmax and rows with fewer drafts than room."""
    gen = torch.Generator().manual_seed(1)
    target = torch.softmax(torch.randn(200, K + 1, 4, generator=gen) * 3, dim=2)
    argmax = target.argmax(dim=2)
    drafts = torch.where(torch.rand(200, K, generator=gen) < 0.7, argmax[:, :K],
                         torch.randint(0, 4, (200, K), generator=gen))
    num_drafts = torch.randint(0, K + 1, (200,), generator=gen)
    full = verify(target, drafts, num_drafts, torch.ones(200, dtype=torch.bool),
                  torch.rand(200, K, generator=gen), torch.ones(200, K + 1, 4))
    short = rejection.verify_greedy(argmax, drafts, num_drafts)
    assert torch.equal(short.token_ids, full.token_ids)
    assert torch.equal(short.num_tokens, full.num_tokens)
    assert 0 < (full.num_tokens - 1).float().mean() < K  # some accepted, some not


def test_a_draft_equal_to_the_target_is_always_accepted():
    gen = torch.Generator().manual_seed(0)
    target = torch.softmax(torch.randn(64, K + 1, V, generator=gen), dim=2)
    drafts = torch.stack([torch.multinomial(target[b, :K], 1, generator=gen)[:, 0]
                          for b in range(64)])
    out = verify(target, drafts, torch.full((64,), K), torch.zeros(64, dtype=torch.bool),
                 torch.rand(64, K, generator=gen) * 0.999,
                 torch.empty(64, K + 1, V).exponential_(generator=gen), target[:, :K])
    assert (out.num_tokens == K + 1).all()
    assert torch.equal(out.token_ids[:, :K], drafts)
