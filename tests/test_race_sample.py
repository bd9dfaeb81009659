"""The fused race sampler (in the Triton interpreter on the CPU, on the GPU with
INFER_TEST_DEVICE=cuda) against the sampler's arithmetic in torch with the Philox reference:
a seeded row races the very noise `seeded_noise` draws for it, an unseeded row the stream
of (step key, row), a greedy row takes its argmax; and the tokens of unseeded rows follow
softmax(x / temperature)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from test_sampler import assert_samples_from
from token_masks import allowed_by, random_token_masks

from infer.kernels import triton_available
from infer.kernels.reference import philox4x32_ref, seeded_noise_ref

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRETED else os.environ.get("INFER_TEST_DEVICE", "cpu")

if not triton_available():
    pytest.skip("triton is not installed", allow_module_level=True)
if DEVICE == "cpu" and not INTERPRETED:
    pytest.skip("Triton kernels run on a GPU or in the interpreter", allow_module_level=True)

from infer.kernels.race_sample import GREEDY, SEEDED, UNSEEDED, race_sample  # noqa: E402

U32 = 0xFFFFFFFF


def _unseeded_noise(step_key: int, rows: list[int], n_cols: int) -> torch.Tensor:
    """[len(rows), n_cols] Exp(1) draws of unseeded rows: key = the step's, counter =
    (column, row, 2, 0)."""
    cols = torch.arange(n_cols, dtype=torch.int64).expand(len(rows), n_cols)
    at = torch.tensor(rows, dtype=torch.int64)[:, None].expand(len(rows), n_cols)
    word, _, _, _ = philox4x32_ref(
        (cols, at, torch.full_like(cols, 2), torch.zeros_like(cols)),
        (torch.full_like(cols, step_key & U32), torch.full_like(cols, (step_key >> 32) & U32)))
    return -(((word >> 9).float() + 0.5) * (1.0 / 8388608.0)).log()


def _expected(x: torch.Tensor, modes: list[tuple[int, int, int]], step_key: int
              ) -> tuple[np.ndarray, np.ndarray]:
    """Each row's token by the torch arithmetic, and its margin over the runner-up."""
    n_cols = x.shape[1]
    scores = x.clone()
    for row, (mode, seed, position) in enumerate(modes):
        if mode == SEEDED.value:
            noise = torch.zeros(1, n_cols)
            seeded_noise_ref(noise, torch.tensor([0]), torch.tensor([seed]),
                             torch.tensor([position]))
            scores[row] = x[row] - noise[0].log()
        elif mode == UNSEEDED.value:
            scores[row] = x[row] - _unseeded_noise(step_key, [row], n_cols)[0].log()
    top = scores.topk(2, dim=-1)
    return top.indices[:, 0].numpy(), (top.values[:, 0] - top.values[:, 1]).numpy()


@pytest.mark.parametrize("in_kernel_temperature", [False, True])
def test_each_row_races_its_own_noise(in_kernel_temperature):
    gen = torch.Generator().manual_seed(0)
    n_cols = 9000  # three of the kernel's parts, the last one short
    logits = torch.randn(6, n_cols, generator=gen) * 3
    temperature = torch.tensor([0.7, 1.0, 1.3, 0.5, 1.0, 2.0])
    step_key = -(2**62) + 12345
    modes = [(SEEDED.value, 7, 3), (GREEDY.value, 0, 0), (UNSEEDED.value, step_key, 2),
             (SEEDED.value, -(2**63), 2**31 + 9), (UNSEEDED.value, step_key, 4),
             (SEEDED.value, 2**63 - 1, 0)]
    x = logits / temperature[:, None]
    want, margin = _expected(x, modes, step_key)
    table = torch.tensor([list(c) for c in zip(*modes)], dtype=torch.int64, device=DEVICE)
    if in_kernel_temperature:
        got = race_sample(logits.to(DEVICE), step_key, temperature.to(DEVICE), table)
    else:
        got = race_sample(x.to(DEVICE), step_key, None, table)
    got = got.cpu().numpy()
    assert got[1] == logits[1].argmax().item()  # the greedy row
    clear = margin > 1e-4  # float32 logs may round apart where two scores nearly tie
    assert clear.sum() >= 5
    assert (got[clear] == want[clear]).all(), (got, want, margin)


def test_without_modes_every_row_is_unseeded_and_the_key_decides():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4, 300, generator=gen)
    key = 987654321987
    want, margin = _expected(x, [(UNSEEDED.value, key, row) for row in range(4)], key)
    got = race_sample(x.to(DEVICE), key).cpu().numpy()
    assert (got[margin > 1e-4] == want[margin > 1e-4]).all()
    assert torch.equal(race_sample(x.to(DEVICE), key).cpu(), torch.from_numpy(got))
    others = [race_sample(x.to(DEVICE), key + k).cpu().numpy() for k in range(1, 6)]
    assert any((o != got).any() for o in others)  # another step, other draws


def test_unseeded_tokens_follow_softmax_of_the_tempered_logits():
    """The unseeded rows' stream, raced in torch over many rows, follows softmax(x / t);
    the kernel draws those very tokens (checked on the first rows: the interpreter runs a
    program at a time)."""
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, 0.5, 1.5])
    t, n, key = 0.5, 4000, 42
    scores = logits / t - _unseeded_noise(key, list(range(n)), 6).log()
    top = scores.topk(2, dim=-1).values
    clear = (top[:, 0] - top[:, 1] > 1e-4)[:64]
    want = scores.argmax(dim=-1)
    probs = torch.softmax(logits / t, dim=-1).numpy()
    assert_samples_from(np.bincount(want.numpy(), minlength=6), probs,
                        [torch.softmax(logits, dim=-1).numpy()])
    x = logits.expand(64, -1).contiguous().to(DEVICE)
    got = race_sample(x, key, torch.full((64,), t, device=DEVICE), block=16).cpu()
    assert clear.sum() >= 60 and torch.equal(got[clear], want[:64][clear])


def test_filtered_tokens_are_never_drawn():
    x = torch.full((64, 50), float("-inf"))
    x[:, [3, 17, 40]] = torch.tensor([0.5, 0.1, -0.2])
    tokens = race_sample(x.to(DEVICE), 5).cpu()
    assert set(tokens.tolist()) <= {3, 17, 40} and len(set(tokens.tolist())) == 3


def test_masked_tokens_are_out_of_the_race_and_the_rest_race_their_own_noise():
    """With grammar masks, each row races exactly as it would over logits where the
    tokens its mask refuses are -inf (a row allowing one token always takes it)."""
    gen = torch.Generator().manual_seed(4)
    n_cols = 9000
    logits = torch.randn(5, n_cols, generator=gen) * 3
    temperature = torch.tensor([0.7, 1.0, 1.3, 0.5, 1.0])
    step_key = 2**40 + 7
    modes = [(UNSEEDED.value, step_key, 0), (SEEDED.value, 11, 5), (GREEDY.value, 0, 0),
             (SEEDED.value, 3, 1), (UNSEEDED.value, step_key, 4)]
    masks = random_token_masks(5, n_cols, seed=5)
    x = logits.masked_fill(~allowed_by(masks, n_cols), float("-inf")) / temperature[:, None]
    want, margin = _expected(x, modes, step_key)
    table = torch.tensor([list(c) for c in zip(*modes)], dtype=torch.int64, device=DEVICE)
    got = race_sample(logits.to(DEVICE), step_key, temperature.to(DEVICE), table,
                      masks=masks.to(DEVICE)).cpu().numpy()
    assert got[1] == 40 and got[2] == x[2].argmax().item()
    assert allowed_by(masks, n_cols)[torch.arange(5), torch.from_numpy(got)].all()
    clear = margin > 1e-4
    assert clear.sum() >= 4 and (got[clear] == want[clear]).all(), (got, want, margin)


def test_the_samplers_fused_draw_keys_each_row_as_the_batch_says():
    """`_fused_race` (the sampler's CUDA path, here on the interpreter's CPU tensors): a
    seeded row's key is its seed's low 64 bits and its output position, a greedy row of a
    sampled batch takes its argmax."""
    from infer.engine.sampler import SamplingBatch, _fused_race
    from infer.sampling_params import SamplingParams as P

    v = 5000
    x = torch.randn(4, v, generator=torch.Generator().manual_seed(3)) * 2
    params = [P(temperature=1.0, seed=2**64 - 5), P(temperature=0.0),
              P(temperature=1.0), P(temperature=1.0, seed=77)]
    batch = SamplingBatch.build(params, [[]] * 4, [[1, 2], [], [], [9] * 6], v, "cpu")
    got = _fused_race(x.to(DEVICE), batch).cpu().numpy()
    want, margin = _expected(x, [(SEEDED.value, -5, 2), (GREEDY.value, 0, 0),
                                 (UNSEEDED.value, 0, 2), (SEEDED.value, 77, 6)], 0)
    assert got[1] == x[1].argmax().item()
    for row in (0, 3):
        assert margin[row] < 1e-4 or got[row] == want[row], (row, got, want)


def test_a_seeded_rows_position_is_its_entry_plus_the_shift():
    gen = torch.Generator().manual_seed(6)
    x = (torch.randn(3, 700, generator=gen) * 2).to(DEVICE)
    key = 31337

    def table(positions: list[int], unseeded_seed: int) -> torch.Tensor:
        modes = [(SEEDED.value, 7, positions[0]), (UNSEEDED.value, unseeded_seed, 1),
                 (SEEDED.value, 11, positions[2])]
        return torch.tensor([list(c) for c in zip(*modes)], dtype=torch.int64, device=DEVICE)

    shifted = race_sample(x, key, None, table([3, 1, 0], 0), position_shift=5).cpu()
    direct = race_sample(x, key, None, table([8, 1, 5], 123), position_shift=0).cpu()
    assert torch.equal(shifted, direct)  # and an unseeded row's seed entry is not read
    want, margin = _expected(x.cpu(), [(SEEDED.value, 7, 8), (UNSEEDED.value, key, 1),
                                       (SEEDED.value, 11, 5)], key)
    clear = margin > 1e-4
    assert clear.sum() >= 2 and (shifted.numpy()[clear] == want[clear]).all()
    unshifted = race_sample(x, key, None, table([3, 1, 0], 0)).cpu()
    assert not torch.equal(unshifted[[0, 2]], shifted[[0, 2]])


def test_a_reused_batch_draws_what_a_new_one_would():
    """The engine's next step takes the same rows' batch again (`at_seeded_positions`, the
    seeded rows 0 and 2 given their positions): its modes stay on the device, shifted; the
    tokens are those of a batch built afresh there."""
    from infer.engine.sampler import SamplingBatch, _fused_race
    from infer.sampling_params import SamplingParams as P

    v = 3000
    x = (torch.randn(3, v, generator=torch.Generator().manual_seed(8)) * 2).to(DEVICE)
    params = [P(temperature=1.0, seed=5), P(temperature=0.0), P(temperature=0.8, seed=9)]
    first = SamplingBatch.build(params, [[]] * 3, [[1] * 4, [], [2] * 7], v, DEVICE)
    _fused_race(x, first)
    for step in (1, 2, 9):
        reused = first.at_seeded_positions([4 + step, 7 + step])
        assert reused.modes is first.modes and reused.position_shift == step
        fresh = SamplingBatch.build(params, [[]] * 3, [[1] * (4 + step), [], [2] * (7 + step)],
                                    v, DEVICE)
        torch.manual_seed(step)
        got = _fused_race(x, reused).cpu()
        torch.manual_seed(step)
        assert torch.equal(got, _fused_race(x, fresh).cpu()), step
    assert first.at_seeded_positions([6, 8]).modes is None  # rows that moved apart: made again


@pytest.mark.skipif(DEVICE != "cuda", reason="kernels compile on a GPU only")
def test_sampling_compiles_no_kernel_after_the_warm_up(monkeypatch):
    """The engine warms the sampler at start (`warm_up_sampler`): a step's sampling, of any
    kind and any number of rows, with grammar masks or without, then compiles nothing (a
    compile on a machine without Triton's disk cache held the first such step 0.4-0.6 s)."""
    from triton.runtime.jit import JITFunction

    from infer.engine.sampler import SamplingBatch, SamplingParams, sample, warm_up_sampler

    if not hasattr(JITFunction, "_do_compile"):
        pytest.skip("this Triton compiles elsewhere")
    vocab, rows = 1000, 32
    warm_up_sampler(vocab, torch.device(DEVICE))
    compiled = []
    real = JITFunction._do_compile

    def spy(self, *args, **kwargs):
        compiled.append(self.fn.__name__)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(JITFunction, "_do_compile", spy)
    logits = torch.randn(rows, vocab, device=DEVICE)
    masks = random_token_masks(rows, vocab).to(DEVICE)
    hot, cold = SamplingParams(temperature=0.6), SamplingParams(temperature=0.0)
    seeded, top_p = SamplingParams(temperature=0.9, seed=7), SamplingParams(top_p=0.8)
    for kinds in ([hot], [cold], [cold, hot], [top_p], [seeded, top_p], [seeded, hot]):
        params = [kinds[i % len(kinds)] for i in range(rows)]
        batch = SamplingBatch.build(params, [[0]] * rows, [[]] * rows, vocab, DEVICE)
        assert sample(logits, batch).token_ids.cpu().shape == (rows,)
        assert sample(logits.clone(), batch, masks).token_ids.cpu().shape == (rows,)
    assert compiled == []
