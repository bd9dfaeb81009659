"""A step whose sampling rows are the step before's takes that step's sampling batch again
(the rows' params decide it) with only the seeded rows' positions moved on; batches with
bans or penalties are built every step. Checked against the same requests with every
batch built afresh."""

from __future__ import annotations

import pytest
from engine_fixtures import make_llm

from infer import SamplingParams
from infer.engine import engine_core

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llm():
    return make_llm(num_blocks=128)


def _run(llm, prompts, params, monkeypatch, fresh: bool):
    """Token ids per request, and the sampling batches the steps used."""
    core = llm.engine.core
    batches = []
    real_sample = engine_core.sample

    def sample(logits, batch, masks=None):
        batches.append(batch)
        return real_sample(logits, batch, masks)

    def no_reuse(seqs, *args, **kwargs):
        core._last_batch = None
        return build(seqs, *args, **kwargs)

    monkeypatch.setattr(engine_core, "sample", sample)
    build = core._sampling_batch
    if fresh:
        monkeypatch.setattr(core, "_sampling_batch", no_reuse)
    outs = llm.generate(prompts, params, use_tqdm=False)
    monkeypatch.undo()
    return [o.outputs[0].token_ids for o in outs], batches


def test_the_same_rows_reuse_their_batch_with_positions_moved_on(llm, monkeypatch):
    prompts = ["Tell me a joke.", "List three colors:", "Hello"]
    params = [SamplingParams(temperature=0.9, seed=7, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0.7, max_tokens=12, ignore_eos=True, seed=8),
              SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)]
    reused, batches = _run(llm, prompts, params, monkeypatch, fresh=False)
    fresh, fresh_batches = _run(llm, prompts, params, monkeypatch, fresh=True)
    assert reused == fresh and all(len(t) == 12 for t in reused)
    decode = [b for b in batches if len(b.seeded_rows) == 2]
    assert len(decode) >= 10
    # one build for the decode steps (their device tensors are the same objects) ...
    assert all(b.temperature is decode[1].temperature for b in decode[1:])
    assert len({id(b.temperature) for b in fresh_batches}) == len(fresh_batches)
    # ... and each step's seeded rows at the position it generates (both rows decode in
    # step: one more token each step)
    positions = [[p for _, _, p in b.seeded_rows] for b in decode]
    assert positions == [[positions[0][0] + i] * 2 for i in range(len(decode))]


def test_batches_with_penalties_or_bans_are_built_every_step(llm, monkeypatch):
    params = [SamplingParams(temperature=0.8, seed=3, max_tokens=6, ignore_eos=True,
                             repetition_penalty=1.3),
              SamplingParams(temperature=0.8, seed=4, max_tokens=6, min_tokens=4)]
    reused, batches = _run(llm, ["Hello", "World"], params, monkeypatch, fresh=False)
    fresh, _ = _run(llm, ["Hello", "World"], params, monkeypatch, fresh=True)
    assert reused == fresh
    assert not any(b.reusable for b in batches)
    assert len({id(b) for b in batches}) == len(batches)
