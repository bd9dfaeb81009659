"""The greedy verdict in one launch (kernels/greedy_verdict.py) against
`rejection.verify_greedy` and a hand-worked case: in the interpreter on the CPU, on the GPU
with CUDA."""

from __future__ import annotations

import os

import pytest
import torch

from infer.kernels import triton_available
from infer.spec.rejection import verify_greedy

pytestmark = pytest.mark.skipif(not triton_available(), reason="triton is not installed")

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRETED else "cpu"


def _padded_index(counts: list[int]) -> torch.Tensor:
    """Each sequence's rows, its last repeated up to the longest (as spec.sampling pads)."""
    k1, index, start = max(counts), [], 0
    for c in counts:
        index.extend(start + min(j, c - 1) for j in range(k1))
        start += c
    return torch.tensor(index)


def test_a_hand_worked_batch():
    from infer.kernels.greedy_verdict import greedy_verdict

    # three sequences of 3, 4 and 1 rows (2, 3 and 0 drafts), their rows' argmax in order
    best = torch.tensor([5, 6, 7, 1, 2, 3, 4, 9])
    drafts = torch.tensor([[5, 0, 0], [1, 2, 3], [0, 0, 0]])
    tokens, num_tokens = greedy_verdict(best.to(DEVICE), _padded_index([3, 4, 1]).to(DEVICE),
                                        drafts.to(DEVICE), torch.tensor([2, 3, 0]).to(DEVICE))
    # row 0: 5 accepted, 0 != 6 -> 6; row 1: all three, then 4; row 2: no drafts -> 9
    assert tokens.tolist() == [[5, 6, -1, -1], [1, 2, 3, 4], [9, -1, -1, -1]]
    assert num_tokens.tolist() == [2, 4, 1]


@pytest.mark.parametrize("k", [1, 4, 16])
def test_random_batches_match_the_torch_verdict(k):
    from infer.kernels.greedy_verdict import greedy_verdict

    gen = torch.Generator().manual_seed(k)
    counts = torch.randint(1, k + 2, (40,), generator=gen).tolist()
    best = torch.randint(0, 3, (sum(counts),), generator=gen)
    index = _padded_index(counts)
    padded = best[index].view(40, k + 1)
    # drafts that mostly equal the argmax, so that many rows accept several
    drafts = torch.where(torch.rand(40, k, generator=gen) < 0.8, padded[:, :k],
                         torch.randint(0, 3, (40, k), generator=gen))
    num_drafts = torch.tensor(counts) - 1
    want = verify_greedy(padded, drafts, num_drafts)
    tokens, num_tokens = greedy_verdict(best.to(DEVICE), index.to(DEVICE), drafts.to(DEVICE),
                                        num_drafts.to(DEVICE))
    assert torch.equal(tokens.cpu(), want.token_ids)
    assert torch.equal(num_tokens.cpu(), want.num_tokens)
    assert len(set(want.num_tokens.tolist())) > 1  # rows that stopped at different drafts


def test_no_sequences():
    from infer.kernels.greedy_verdict import greedy_verdict

    empty = torch.zeros(0, 4, dtype=torch.int64, device=DEVICE)
    tokens, num_tokens = greedy_verdict(torch.zeros(0, dtype=torch.int64, device=DEVICE),
                                        torch.zeros(0, dtype=torch.int64, device=DEVICE),
                                        empty, torch.zeros(0, dtype=torch.int64, device=DEVICE))
    assert tokens.shape == (0, 5) and num_tokens.shape == (0,)
