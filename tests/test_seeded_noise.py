"""Seeded draws for many rows at once: the Philox4x32-10 reference against Random123's
published answers; the kernel (in the Triton interpreter on the CPU, on the GPU with
INFER_TEST_DEVICE=cuda) against the reference; the sampler's seeded rows through it, on
the test device: the same token wherever the row sits, and the right distribution."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from test_sampler import LOGITS, PROBS, assert_samples_from, restricted

from infer.engine.sampler import SamplingBatch, fill_seeded, sample
from infer.kernels import triton_available
from infer.kernels.reference import philox4x32_ref, seeded_noise_ref
from infer.sampling_params import SamplingParams as P

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = os.environ.get("INFER_TEST_DEVICE", "cpu")


@pytest.mark.parametrize(("counter", "key", "expected"), [
    # Random123's kat_vectors for philox4x32-10.
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
])
def test_philox_reference_gives_random123s_answers(counter, key, expected):
    def t(x):
        return torch.tensor([x], dtype=torch.int64)

    out = philox4x32_ref(tuple(map(t, counter)), tuple(map(t, key)))
    assert tuple(int(word) for word in out) == expected


SEEDS = [0, -1, 7, 2**40 + 3, 2**63 - 1, -(2**63)]
POSITIONS = [0, 5, 2**31 + 9, 1, 300, 4]


@pytest.mark.parametrize("exponential", [True, False])
@pytest.mark.parametrize("stream", [0, 1])
def test_the_kernel_draws_what_the_reference_does(exponential, stream):
    if not triton_available():
        pytest.skip("triton is not installed")
    from infer.kernels.seeded_noise import seeded_noise

    device = "cpu" if INTERPRETED else DEVICE
    n_cols = 2500  # not a multiple of the kernel's block
    rows = torch.tensor([7, 0, 3, 5, 1, 6], device=device)
    seeds = torch.tensor(SEEDS, device=device)
    positions = torch.tensor(POSITIONS, device=device)
    got = torch.full((8, n_cols), -5.0, device=device)
    want = torch.full((8, n_cols), -5.0)
    seeded_noise(got, rows, seeds, positions, exponential, stream)
    seeded_noise_ref(want, rows.cpu(), seeds.cpu(), positions.cpu(), exponential, stream)
    got = got.cpu()
    assert (got[[2, 4]] == -5).all()  # rows not asked for are untouched
    if exponential:  # the integer part is exact; -log may round differently
        torch.testing.assert_close(got, want, rtol=2e-6, atol=0)
    else:
        assert torch.equal(got, want)


def test_draws_are_uniform_and_exponential_and_differ_by_key():
    out = torch.zeros(4, 1 << 16)
    rows = torch.arange(4)
    seeded_noise_ref(out, rows, torch.tensor([1, 2, 1, 1]), torch.tensor([0, 0, 1, 0]), False)
    u = out.numpy().astype(np.float64)
    assert u.min() > 0 and u.max() < 1
    for r in range(3):  # mean 1/2, variance 1/12, flat over 16 bins (chi-square, 15 df)
        assert abs(u[r].mean() - 0.5) < 0.01 and abs(u[r].var() - 1 / 12) < 0.003
        counts = np.histogram(u[r], bins=16, range=(0, 1))[0]
        expected = len(u[r]) / 16
        assert ((counts - expected) ** 2 / expected).sum() < 60  # p ~ 1e-7
    assert not np.array_equal(u[0], u[1]) and not np.array_equal(u[0], u[2])
    assert np.array_equal(u[0], u[3])  # the same key and counter: the same draws
    e = torch.zeros(1, 1 << 16)
    seeded_noise_ref(e, torch.tensor([0]), torch.tensor([9]), torch.tensor([0]))
    assert abs(e.mean().item() - 1) < 0.02 and abs(e.var().item() - 1) < 0.05
    other = torch.zeros(1, 1 << 16)
    seeded_noise_ref(other, torch.tensor([0]), torch.tensor([9]), torch.tensor([0]), stream=1)
    assert not torch.equal(e, other)


def _batch(params: list[P], v: int, positions: list[int]) -> SamplingBatch:
    n = len(params)
    return SamplingBatch.build(params, [[]] * n, [[]] * n, v, DEVICE, positions=positions)


def test_a_seeded_row_draws_the_same_wherever_it_sits_on_the_test_device():
    v = 3000
    target = torch.zeros(5, v, device=DEVICE)
    fill_seeded(target, [2], [1234], [17])
    crowd = torch.zeros(5, v, device=DEVICE)
    fill_seeded(crowd, [4, 0, 1], [99, 1234, 5], [17, 17, 3])
    assert torch.equal(crowd[0], target[2])
    assert not torch.equal(crowd[4], target[2]) and not torch.equal(crowd[1], target[2])
    # A sampled token depends on the row's own logits, seed and position only.
    logits = torch.randn(6, v, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    params = [P(seed=s, temperature=0.9) for s in (11, 12, 1234, 13, 14, 15)]
    tokens = sample(logits, _batch(params, v, [3, 3, 17, 3, 3, 3])).token_ids
    [alone] = sample(logits[2:3], _batch(params[2:3], v, [17])).token_ids.tolist()
    assert tokens[2].item() == alone


def test_seeded_rows_sample_the_right_distribution_on_the_test_device():
    n = 4000
    logits = torch.tensor([LOGITS] * n, device=DEVICE)
    params = [P(seed=s, top_p=0.9) for s in range(n)]
    tokens = sample(logits, _batch(params, 6, [0] * n)).token_ids.cpu().numpy()
    assert_samples_from(np.bincount(tokens, minlength=6), restricted(PROBS, {0, 1, 3, 4}),
                        [PROBS])
