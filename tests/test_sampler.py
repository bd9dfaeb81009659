"""The batched sampler against hand-computed references on small vocabularies."""

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from infer.engine import sampler as sampler_mod
from infer.engine.sampler import SamplingBatch, apply_penalties, filter_logits, sample
from infer.sampling_params import SamplingParams as P

# Chi-square critical values at significance 1e-6, by degrees of freedom.
CHI2_CRIT = {1: 23.928, 2: 27.631, 3: 30.664, 4: 33.377, 5: 35.888}
N = 20_000

# Token probabilities chosen so that top_p cut-offs land exactly on cumulative sums:
# sorted: 0.40 (id 1), 0.25 (id 0), 0.15 (id 3), 0.10 (id 4), 0.06 (id 5), 0.04 (id 2);
# cumulative: 0.40, 0.65, 0.80, 0.90, 0.96, 1.00.
PROBS = np.array([0.25, 0.40, 0.04, 0.15, 0.10, 0.06])
LOGITS = np.log(PROBS).tolist()
ALL = set(range(6))


def build(params, v, prompts=None, outputs=None, **kw):
    b = len(params)
    return SamplingBatch.build(
        params, prompts or [[] for _ in range(b)], outputs or [[] for _ in range(b)], v, "cpu",
        **kw,
    )


def draw(row, p, n=N):
    """Counts per token of n samples of one row (n identical rows in one call)."""
    logits = torch.tensor(row, dtype=torch.float32).repeat(n, 1)
    tokens = sample(logits, build([p] * n, len(row))).token_ids
    return np.bincount(tokens.numpy(), minlength=len(row))


def softmax64(x):
    x = np.asarray(x, dtype=np.float64)
    e = np.exp(x - x.max())
    return e / e.sum()


def restricted(probs, kept):
    out = np.zeros_like(probs)
    idx = sorted(kept)
    out[idx] = probs[idx] / probs[idx].sum()
    return out


def chi2(counts, expected):
    """Pearson's statistic and its degrees of freedom; cells expecting < 5 are pooled."""
    n = counts.sum()
    big = n * expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(n * expected[big], n * expected[~big].sum())
    if exp[-1] < 5:  # too small even pooled: fold into the smallest big cell
        j = int(np.argmin(exp[:-1]))
        obs[j] += obs[-1]
        exp[j] += exp[-1]
        obs, exp = obs[:-1], exp[:-1]
    return float(((obs - exp) ** 2 / exp).sum()), len(exp) - 1


def assert_samples_from(counts, expected, wrong=()):
    """Support exactly `expected > 0`, and a chi-square fit at significance 1e-6.

    Each `wrong` distribution (a plausible bug) must be rejected by the same counts, so the
    check cannot pass by accident.
    """
    support = expected > 0
    assert counts[~support].sum() == 0, f"tokens outside {np.flatnonzero(support)}: {counts}"
    common = counts.sum() * expected >= 20  # missing one by chance: p < e^-20
    assert (counts[common] > 0).all(), f"a kept token never sampled: {counts}"
    stat, df = chi2(counts, expected)
    if df:
        assert stat < CHI2_CRIT[df], (counts, expected)
    for alt in wrong:
        if alt[~support].sum() > 0.01 or counts[alt == 0].sum() > 0:  # wrong support
            continue
        stat, df = chi2(counts, alt)
        assert stat > 10 * CHI2_CRIT[max(df, 1)], alt


def kept_set(row, p):
    x = filter_logits(torch.tensor([row], dtype=torch.float32), build([p], len(row)))
    return set(torch.isfinite(x[0]).nonzero().flatten().tolist())


# -- greedy and temperature ----------------------------------------------------------------
def test_greedy_is_argmax_and_all_greedy_fast_path(monkeypatch):
    logits = torch.randn(16, 100)
    batch = build([P(temperature=0, top_k=3, top_p=0.5, min_p=0.2)] * 16, 100)
    assert batch.all_greedy and batch.temperature is None and batch.greedy is None
    assert batch.output_counts is None and batch.banned is None and batch.top_k is None

    def boom(*_):
        raise AssertionError("an all-greedy batch must not filter or draw noise")

    monkeypatch.setattr(sampler_mod, "_race", boom)
    monkeypatch.setattr(sampler_mod, "filter_logits", boom)
    out = sample(logits, batch)
    assert torch.equal(out.token_ids, logits.argmax(-1))
    assert out.token_ids.dtype == torch.int64 and out.top_logprobs is None


@pytest.mark.parametrize("t", [0.5, 2.0])
def test_temperature_distribution(t):
    row = [2.0, 1.0, 0.5, 0.0, -1.0, -3.0]
    expected = softmax64(np.array(row) / t)
    assert_samples_from(draw(row, P(temperature=t)), expected, wrong=[softmax64(row)])


def test_grammar_masks_restrict_the_draw_and_the_logprobs_to_what_they_allow():
    """Mask bits 0, 3, 5 set (tokens 0, 3, 5 allowed; the most likely, 1, refused): sampled
    rows draw from the distribution renormalised over them, greedy rows take the best of
    them, and logprobs are those of the masked logits."""
    allowed = {0, 3, 5}
    masks = torch.tensor([[sum(1 << t for t in allowed)]], dtype=torch.int32)
    logits = torch.tensor(LOGITS).repeat(N, 1)
    tokens = sample(logits, build([P(temperature=1.0)] * N, 6), masks.repeat(N, 1)).token_ids
    assert_samples_from(np.bincount(tokens.numpy(), minlength=6), restricted(PROBS, allowed),
                        wrong=[PROBS])
    rows = torch.tensor([LOGITS, LOGITS])
    out = sample(rows, build([P(temperature=0), P(temperature=0, logprobs=1)], 6),
                 masks.repeat(2, 1))
    assert out.token_ids.tolist() == [0, 0]
    want = np.log(restricted(PROBS, allowed))
    np.testing.assert_allclose(out.logprobs.numpy(), [want[0]] * 2, atol=1e-6)


# -- top_k / top_p / min_p -----------------------------------------------------------------
def test_top_k_support_and_distribution():
    row = [0.5, 2.0, -1.0, 1.0, 0.0, -3.0]
    assert kept_set(row, P(top_k=3)) == {0, 1, 3}
    assert kept_set(row, P(top_k=1)) == {1}
    assert kept_set(row, P(top_k=6)) == ALL and kept_set(row, P(top_k=99)) == ALL
    expected = restricted(softmax64(np.array(row) / 0.5), {0, 1, 3})
    wrong = [softmax64(np.array(row) / 0.5), restricted(softmax64(row), {0, 1, 3})]
    assert_samples_from(draw(row, P(top_k=3, temperature=0.5)), expected, wrong)


def test_top_k_keeps_ties_at_the_cut():
    assert kept_set([1.0, 0.0, 1.0, 1.0, -1.0, 0.0], P(top_k=2)) == {0, 2, 3}


@pytest.mark.parametrize("top_p, kept", [
    (1e-6, {1}), (0.3, {1}), (0.4, {1}), (0.41, {0, 1}), (0.65, {0, 1}), (0.66, {0, 1, 3}),
    (0.8, {0, 1, 3}), (0.9, {0, 1, 3, 4}), (0.96, {0, 1, 3, 4, 5}), (0.97, ALL), (1.0, ALL),
])
def test_top_p_support_including_exact_boundary(top_p, kept):
    # Where the cumulative mass hits top_p exactly (0.4, 0.65, 0.8, 0.9, 0.96), no more.
    assert kept_set(LOGITS, P(top_p=top_p)) == kept


def test_top_p_distribution_at_boundary():
    expected = restricted(PROBS, {0, 1})
    wrong = [restricted(PROBS, {0, 1, 3}), PROBS]
    assert_samples_from(draw(LOGITS, P(top_p=0.65)), expected, wrong)


def test_top_p_after_temperature():
    # T = 0.5 squares the probabilities: 0.16, 0.0625, 0.0225, 0.01, ... (sum 0.2598);
    # 0.16 / 0.2598 = 0.616 < 0.7 <= (0.16 + 0.0625) / 0.2598 = 0.856.
    assert kept_set(LOGITS, P(top_p=0.7, temperature=0.5)) == {0, 1}
    assert kept_set(LOGITS, P(top_p=0.7)) == {0, 1, 3}


def test_top_p_is_measured_after_top_k():
    # After top_k=3 the mass is 0.5, 0.3125, 0.1875: top_p=0.8 keeps two (0.8125 >= 0.8),
    # where top_p on the full distribution would keep three.
    p = P(top_k=3, top_p=0.8)
    assert kept_set(LOGITS, p) == {0, 1}
    assert_samples_from(draw(LOGITS, p), restricted(PROBS, {0, 1}), [restricted(PROBS, {1})])


def test_top_p_with_top_k_sorts_only_top_k_and_spares_other_rows():
    v = 300
    logits = torch.randn(4, v)
    logits[0, :6] = torch.tensor(LOGITS) + 20  # the top six tokens carry PROBS' shape
    logits[1] = logits[0]
    truncated = build([P(top_k=3, top_p=0.8), P(top_k=3), P(), P(top_k=-1)], v)
    full = build([P(top_k=3, top_p=0.8), P(top_k=3), P(top_p=0.9), P()], v)
    assert truncated.sort_width == 3 and full.sort_width == v
    x, y = filter_logits(logits, truncated), filter_logits(logits, full)
    kept = torch.isfinite(x)
    assert set(kept[0].nonzero().flatten().tolist()) == {0, 1}
    assert set(kept[1].nonzero().flatten().tolist()) == {0, 1, 3}
    assert torch.equal(x[:2], y[:2])
    assert torch.equal(x[2:], logits[2:]) and torch.equal(y[3], logits[3])


def test_top_p_mass_after_top_k_ignores_ties_past_k_whatever_the_sort_width():
    # Found by hypothesis: logits (0, ..., 0, 0.5), top_k=2, top_p=0.5. top_k keeps 0.5 and
    # one zero (mass 0.62, 0.38), so top_p keeps 0.5 alone. A batch neighbour without top_k
    # widens the sort to the whole vocab; the mass must still be over two logits, not over
    # the nine tied zeros.
    v = 10
    row = [0.0] * (v - 1) + [0.5]
    p = P(top_k=2, top_p=0.5)
    logits = torch.tensor([row, row])
    truncated = build([p, P()], v)
    full = build([p, P(top_p=0.9)], v)
    assert truncated.sort_width == 2 and full.sort_width == v
    for batch in (truncated, full):
        kept = torch.isfinite(filter_logits(logits, batch)[0])
        assert kept.nonzero().flatten().tolist() == [v - 1]


@pytest.mark.parametrize("min_p, t, kept", [
    (0.3, 1.0, {0, 1, 3}),  # threshold 0.3 * 0.40 = 0.12
    (0.62, 1.0, {0, 1}),  # 0.25 / 0.40 = 0.625
    (1.0, 1.0, {1}),
    (0.45, 2.0, {0, 1, 3, 4}),  # T=2: ratios sqrt(p / 0.4) = .79, .61, .50, .39, .32
    (0.0, 1.0, ALL),
])
def test_min_p_support(min_p, t, kept):
    assert kept_set(LOGITS, P(min_p=min_p, temperature=t)) == kept


def test_min_p_distribution_with_temperature():
    expected = restricted(softmax64(np.array(LOGITS) / 2.0), {0, 1, 3, 4})
    wrong = [restricted(PROBS, {0, 1, 3, 4})]
    assert_samples_from(draw(LOGITS, P(min_p=0.45, temperature=2.0)), expected, wrong)


def test_rows_with_filters_disabled_are_unaffected():
    v = 50
    logits = torch.randn(6, v)
    params = [P(top_k=2, top_p=0.5, min_p=0.2), P(temperature=0.8), P(top_k=0, top_p=1.0),
              P(top_k=-1, min_p=0.0), P(top_k=v + 5), P(top_k=7)]
    x = filter_logits(logits, build(params, v))
    for row in (1, 2, 3, 4):
        assert torch.equal(x[row], logits[row] / params[row].temperature), row
    assert torch.isfinite(x[0]).sum() <= 2 and torch.isfinite(x[5]).sum() == 7
    # The top_k-only path (no sort) too.
    x = filter_logits(logits[:3], build([P(top_k=3), P(), P(top_k=v)], v))
    assert torch.isfinite(x[0]).sum() == 3 and torch.equal(x[1:], logits[1:3])


# -- penalties -----------------------------------------------------------------------------
PEN_ROW = [2.0, -1.0, 0.5, -0.5, 1.0, 0.0]
PROMPT, OUTPUT = [0, 1], [2, 2, 3]


@pytest.mark.parametrize("params, expected", [
    # repetition on tokens in prompt or output: positive / 2, negative * 2
    (P(repetition_penalty=2.0), [1.0, -2.0, 0.25, -1.0, 1.0, 0.0]),
    # frequency: counts in the output only (token 2 twice, token 3 once)
    (P(frequency_penalty=0.5), [2.0, -1.0, -0.5, -1.0, 1.0, 0.0]),
    # presence: once per distinct output token
    (P(presence_penalty=0.3), [2.0, -1.0, 0.2, -0.8, 1.0, 0.0]),
    # all three, in that order
    (P(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.3),
     [1.0, -2.0, -1.05, -1.8, 1.0, 0.0]),
    (P(frequency_penalty=-1.0), [2.0, -1.0, 2.5, 0.5, 1.0, 0.0]),
    (P(), PEN_ROW),
])
def test_penalties_hand_computed(params, expected):
    # Each case rides in a batch with an unpenalised row and a differently penalised row.
    params_list = [P(), params, P(repetition_penalty=3.0, presence_penalty=1.0)]
    logits = torch.tensor([PEN_ROW] * 3)
    batch = build(params_list, 6, [PROMPT] * 3, [[5], OUTPUT, [1, 4, 4]])
    out = apply_penalties(logits, batch)
    torch.testing.assert_close(out[1], torch.tensor(expected), rtol=0, atol=1e-6)
    assert torch.equal(out[0], logits[0])
    torch.testing.assert_close(
        out[2], torch.tensor([2 / 3, -4.0, 0.5, -0.5, 1 / 3 - 1.0, 0.0]), rtol=0, atol=1e-6
    )


def test_no_penalty_tensors_when_no_row_needs_them():
    batch = build([P(), P(temperature=0)], 6, [PROMPT] * 2, [OUTPUT] * 2)
    assert batch.output_counts is None and batch.prompt_mask is None
    batch = build([P(frequency_penalty=0.1), P()], 6, [PROMPT] * 2, [OUTPUT] * 2)
    assert batch.prompt_mask is None and batch.repetition_penalty is None
    assert batch.output_counts[1].sum() == 0  # rows without penalties scatter nothing


def test_greedy_takes_argmax_of_penalised_logits():
    logits = torch.tensor([PEN_ROW] * 2)
    batch = build([P(temperature=0, frequency_penalty=-1.0), P(temperature=0)], 6,
                  [PROMPT] * 2, [OUTPUT] * 2)
    assert sample(logits, batch).token_ids.tolist() == [2, 0]


# -- logprobs ------------------------------------------------------------------------------
def test_raw_logprobs_and_top_k_logprobs():
    v = 40
    logits = torch.randn(5, v) * 3
    before = logits.clone()
    params = [P(temperature=0.5, logprobs=4), P(temperature=0, repetition_penalty=1.7),
              P(top_k=3, logprobs=0), P(top_p=0.5, frequency_penalty=1.0, logprobs=2), P()]
    batch = build(params, v, [[1, 2, 3]] * 5, [[4, 5], [6], [], [7, 7], [8]],
                  banned=[[0], [], [1, 2], [], []])
    assert batch.num_logprobs == 4
    out = sample(logits, batch)
    assert torch.equal(logits, before), "sample must not modify its input"
    ref = torch.log_softmax(logits.double(), dim=-1)
    want = ref.gather(1, out.token_ids[:, None]).squeeze(1)
    torch.testing.assert_close(out.logprobs.double(), want, rtol=0, atol=1e-5)
    order = torch.argsort(ref, dim=-1, descending=True)[:, :4]
    assert torch.equal(out.top_logprob_ids, order)
    torch.testing.assert_close(out.top_logprobs.double(), ref.gather(1, order), rtol=0, atol=1e-5)
    assert (out.top_logprobs[:, :-1] >= out.top_logprobs[:, 1:]).all()


def test_logprobs_zero_returns_no_top_arrays():
    out = sample(torch.randn(2, 10), build([P(logprobs=0), P()], 10))
    assert out.top_logprob_ids is None and out.top_logprobs is None
    assert out.logprobs.shape == (2,)


def test_no_logprobs_asked_skips_them_and_keeps_the_tokens():
    logits = torch.randn(3, 50)
    params = [P(temperature=0), P(temperature=0.7, seed=5), P(top_k=4, seed=9)]
    without = sample(logits, build(params, 50))
    with_lp = sample(logits, build([dataclasses.replace(p, logprobs=0) for p in params], 50))
    assert without.logprobs is None
    assert torch.equal(without.token_ids, with_lp.token_ids)


# -- banned ids ----------------------------------------------------------------------------
def test_banned_ids_never_sampled():
    row = [5.0, 4.0, 0.0, 0.0, 3.0, -1.0]
    n = 5000
    logits = torch.tensor([row] * n)
    params = [P(seed=i, logprobs=0) if i % 2 else P(logprobs=0) for i in range(n)]
    out = sample(logits, build(params, 6, banned=[[0, 1]] * n))
    assert not torch.isin(out.token_ids, torch.tensor([0, 1])).any()
    expected = restricted(softmax64(row), {2, 3, 4, 5})
    assert_samples_from(np.bincount(out.token_ids.numpy(), minlength=6), expected)
    # raw logprobs ignore the ban
    torch.testing.assert_close(out.logprobs[:1], torch.log_softmax(logits[:1], -1)[0, 4:5])
    greedy = sample(logits[:2], build([P(temperature=0)] * 2, 6, banned=[[0], []]))
    assert greedy.token_ids.tolist() == [1, 0]
    mask = torch.zeros(2, 6, dtype=torch.bool)
    mask[0, :2] = True
    greedy = sample(logits[:2], build([P(temperature=0)] * 2, 6, banned=mask))
    assert greedy.token_ids.tolist() == [4, 0]


# -- seeds ---------------------------------------------------------------------------------
V_SEED = 256
TARGET_LOGITS = torch.randn(V_SEED, generator=torch.Generator().manual_seed(1)) * 0.3


def _target_token(seed, position, at, size, fill_seed):
    """Sample the target row (seed, position) at row `at` of a batch of `size` random rows."""
    gen = torch.Generator().manual_seed(fill_seed)
    logits = torch.randn(size, V_SEED, generator=gen)
    logits[at] = TARGET_LOGITS
    kinds = [P(), P(temperature=0), P(seed=99, top_k=20), P(top_p=0.7, presence_penalty=1.0)]
    params = [kinds[int(k)] for k in torch.randint(0, 4, (size,), generator=gen)]
    outputs = [torch.randint(0, V_SEED, (int(n),), generator=gen).tolist()
               for n in torch.randint(0, 30, (size,), generator=gen)]
    params[at] = P(seed=seed, temperature=0.9, top_p=0.95)
    outputs[at] = list(range(position))  # the token index is the output length
    return int(sample(logits, build(params, V_SEED, outputs=outputs)).token_ids[at])


def test_seeded_row_is_batch_invariant():
    places = [(0, 1), (3, 7), (9, 10), (31, 32), (0, 32)]
    for position in range(8):
        tokens = set()
        for fill, (at, size) in enumerate(places):
            torch.manual_seed(fill)  # the global generator must not matter either
            tokens.add(_target_token(1234, position, at, size, fill_seed=fill))
        assert len(tokens) == 1, (position, tokens)


def test_different_seeds_and_positions_differ():
    seq = {s: [_target_token(s, i, 0, 1, 0) for i in range(20)] for s in (1, 2)}
    assert seq[1] != seq[2]
    assert len(set(seq[1])) > 10  # positions draw fresh noise
    assert seq[1] == [_target_token(1, i, 2, 5, 7) for i in range(20)]


def test_positions_override_matches_output_length():
    logits = TARGET_LOGITS.repeat(2, 1)
    a = sample(logits, build([P(seed=5)] * 2, V_SEED, outputs=[[1, 2, 3], [4]]))
    b = sample(logits, build([P(seed=5)] * 2, V_SEED, positions=[3, 1]))
    assert torch.equal(a.token_ids, b.token_ids)


def test_seeded_rows_sample_the_right_distribution():
    n = 4000
    logits = torch.tensor([LOGITS] * n)
    p = [P(seed=s, top_p=0.9) for s in range(n)]
    counts = np.bincount(sample(logits, build(p, 6)).token_ids.numpy(), minlength=6)
    assert_samples_from(counts, restricted(PROBS, {0, 1, 3, 4}), [PROBS])


# -- mixed batches and properties ----------------------------------------------------------
def _row_params():
    temperature = st.sampled_from([0.0, 0.0, 0.5, 1.0, 1.7])
    return st.builds(
        P, temperature=temperature, top_k=st.sampled_from([-1, 0, 1, 2, 3, 100]),
        top_p=st.sampled_from([1.0, 1.0, 0.2, 0.5, 0.9]),
        min_p=st.sampled_from([0.0, 0.0, 0.1, 0.5, 1.0]),
        seed=st.one_of(st.none(), st.integers(-(2**40), 2**40)),
        repetition_penalty=st.sampled_from([1.0, 1.0, 0.7, 1.5]),
        frequency_penalty=st.sampled_from([0.0, 0.0, 0.5, -1.0]),
        presence_penalty=st.sampled_from([0.0, 0.0, 0.4]),
        logprobs=st.sampled_from([None, 0, 2]),
    )


@st.composite
def batches(draw_):
    v = draw_(st.integers(2, 12))
    b = draw_(st.integers(1, 6))
    params = [draw_(_row_params()) for _ in range(b)]
    # Small integers scaled: many ties, to exercise tie handling at every cut.
    ints = st.integers(-4, 4)
    logits = [[0.5 * draw_(ints) for _ in range(v)] for _ in range(b)]
    token_lists = st.lists(st.integers(0, v - 1), max_size=6)
    prompts = [draw_(token_lists) for _ in range(b)]
    outputs = [draw_(token_lists) for _ in range(b)]
    banned = [draw_(st.lists(st.integers(0, v - 1), max_size=v - 1, unique=True))
              for _ in range(b)]
    return v, params, torch.tensor(logits), prompts, outputs, banned


def _allowed(x, p):
    """Tokens the filters may keep (float64, tie-inclusive, a little lenient at the cuts)."""
    keep = np.isfinite(x)
    x = x / p.temperature
    if 0 < p.top_k < len(x):
        keep &= x >= np.sort(x)[::-1][p.top_k - 1] - 1e-5
    q = np.where(keep, np.exp(x - x.max()), 0.0)
    q /= q.sum()
    if p.top_p < 1:
        above = np.array([q[q > qi * (1 + 1e-5)].sum() for qi in q])
        keep &= above < p.top_p + 1e-4
    keep &= np.exp(x - x.max()) >= p.min_p - 1e-5
    return keep


def _penalised(batch, logits):
    x = logits
    if batch.banned is not None:
        x = x.masked_fill(batch.banned, float("-inf"))
    return apply_penalties(x, batch).double().numpy()


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches())
def test_sampled_token_always_allowed(case):
    v, params, logits, prompts, outputs, banned = case
    reps = 10
    batch = build(params * reps, v, prompts * reps, outputs * reps, banned=banned * reps)
    tokens = sample(logits.repeat(reps, 1), batch).token_ids.view(reps, -1)
    x = _penalised(build(params, v, prompts, outputs, banned=banned), logits)
    for i, p in enumerate(params):
        if p.greedy:
            assert (tokens[:, i] == int(np.argmax(x[i]))).all()
        else:
            allowed = _allowed(x[i], p)
            bad = [t for t in tokens[:, i].tolist() if not allowed[t]]
            assert not bad, (i, p, x[i], bad)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches(), st.randoms(use_true_random=False))
def test_mixed_batch_rows_equal_rows_alone(case, rnd):
    v, params, logits, prompts, outputs, banned = case
    full = sample(logits, build(params, v, prompts, outputs, banned=banned))
    order = list(range(len(params)))
    rnd.shuffle(order)
    shuffled = sample(logits[order], build([params[i] for i in order], v,
                                           [prompts[i] for i in order],
                                           [outputs[i] for i in order],
                                           banned=[banned[i] for i in order]))
    for i, p in enumerate(params):
        if not (p.greedy or p.seed is not None):
            continue
        alone = sample(logits[i:i + 1], build([p], v, [prompts[i]], [outputs[i]],
                                              banned=[banned[i]]))
        j = order.index(i)
        assert int(full.token_ids[i]) == int(alone.token_ids[0]), (i, p)
        assert int(shuffled.token_ids[j]) == int(alone.token_ids[0]), (i, p)
        if alone.logprobs is not None:  # computed only when some row asks
            assert full.logprobs[i] == alone.logprobs[0] == shuffled.logprobs[j]
        if alone.top_logprobs is not None:
            k = alone.top_logprobs.shape[1]
            assert torch.equal(full.top_logprobs[i, :k], alone.top_logprobs[0])
            assert torch.equal(full.top_logprob_ids[i, :k], alone.top_logprob_ids[0])


def test_mixed_batch_hand_picked():
    v = 64
    logits = torch.randn(7, v)
    prompts = [[1, 2, 3]] * 7
    outputs = [[4, 4, 9], [10], [11, 11], [], [3], [12, 13], [14]]
    params = [P(temperature=0, repetition_penalty=1.5), P(seed=7, top_k=5),
              P(seed=8, top_p=0.8, frequency_penalty=0.5, presence_penalty=0.2), P(),
              P(temperature=0), P(seed=9, min_p=0.1, temperature=0.7, logprobs=3),
              P(temperature=1.3, top_k=10, top_p=0.9)]
    banned = [[], [], [], [], [], [int(logits[5].argmax())], []]
    full = sample(logits, build(params, v, prompts, outputs, banned=banned))
    assert full.top_logprob_ids.shape == (7, 3)
    for i in (0, 1, 2, 4, 5):
        alone = sample(logits[i:i + 1],
                       build([params[i]], v, [prompts[i]], [outputs[i]], banned=[banned[i]]))
        assert int(full.token_ids[i]) == int(alone.token_ids[0]), i
    assert int(full.token_ids[5]) != banned[5][0]
