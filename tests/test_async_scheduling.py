"""Async scheduling on the real SmolLM2 model: launching the next step (decodes, prefill
chunks, admissions) before the current one's tokens are read back changes no output,
stops exactly where the synchronous engine stops, and leaks no KV block, whatever happens
to a request while a step is in flight."""

from __future__ import annotations

import pytest
from engine_fixtures import make_llm

from infer import SamplingParams

pytestmark = pytest.mark.slow  # `pytest -m 'not slow'`: the quick inner loop skips it

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)

MIXED = [
    ("The capital of France is", SamplingParams(temperature=0, max_tokens=24)),
    ("Once upon a time", SamplingParams(temperature=0, max_tokens=30, stop=[","])),
    ("1, 2, 3, 4,", SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[28])),
    ("def add(a, b):", SamplingParams(temperature=0.8, top_k=40, top_p=0.9, seed=7,
                                      max_tokens=16, logprobs=2)),
    ("Tell me a story", SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=9)),
    ("Hello", SamplingParams(temperature=0, max_tokens=1)),
    ("The weather today", SamplingParams(temperature=0, min_tokens=5, max_tokens=8)),
]


def _generate(prompts_and_params, **config):
    llm = make_llm(num_blocks=128, block_size=4, **config)
    prompts, params = zip(*prompts_and_params)
    outs = llm.generate(list(prompts), list(params), use_tqdm=False)
    return outs, llm.engine.stats()


def _assert_same(outs, refs) -> None:
    for out, ref in zip(outs, refs):
        for got, want in zip(out.outputs, ref.outputs, strict=True):
            assert got.token_ids == want.token_ids
            assert got.text == want.text
            assert (got.finish_reason, got.stop_reason) == (want.finish_reason, want.stop_reason)
            if want.logprobs is not None:
                for lp, ref_lp, token in zip(got.logprobs, want.logprobs, want.token_ids):
                    assert lp.keys() == ref_lp.keys()
                    assert lp[token].logprob == pytest.approx(ref_lp[token].logprob, abs=1e-4)


@pytest.fixture(scope="module")
def synchronous():
    return _generate(MIXED, async_scheduling=False)


def test_outputs_equal_the_synchronous_engine(synchronous):
    refs, ref_stats = synchronous
    outs, stats = _generate(MIXED)
    _assert_same(outs, refs)
    assert ref_stats["num_steps_launched_ahead"] == 0
    assert stats["num_steps_launched_ahead"] > 0
    # The stop-string and stop-token requests end before their max_tokens: the step
    # launched ahead computed a token for them that was dropped, never emitted.
    assert stats["num_discarded_tokens"] > 0
    assert stats["generation_tokens_total"] == ref_stats["generation_tokens_total"]
    assert stats["kv_blocks_used"] == ref_stats["kv_blocks_used"] == 0


def test_most_decode_steps_are_launched_ahead():
    outs, stats = _generate([("The capital of France is", GREEDY)] * 3)
    assert [len(o.outputs[0].token_ids) for o in outs] == [10] * 3
    # 1 prefill step, then 9 decode steps, every one launched before the host has read
    # the token it consumes (the first one right behind the prefill).
    assert stats["num_steps"] == 10
    assert stats["num_steps_launched_ahead"] == 9
    assert stats["num_discarded_tokens"] == 0  # max_tokens is known ahead: no wasted row


def test_penalties_fall_back_to_synchronous_steps(synchronous):
    params = SamplingParams(temperature=0, max_tokens=10, repetition_penalty=1.3)
    outs, stats = _generate([("1, 2, 3, 4,", params)])
    refs, _ = _generate([("1, 2, 3, 4,", params)], async_scheduling=False)
    _assert_same(outs, refs)
    assert stats["num_steps_launched_ahead"] == 0


def test_abort_while_a_step_is_in_flight_frees_blocks_and_spares_the_rest():
    alone = make_llm(num_blocks=64, block_size=4).generate(
        "Once upon a time", GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    engine = make_llm(num_blocks=64, block_size=4).engine
    engine.add_request("a", "The capital of France is", GREEDY)
    engine.add_request("b", "Once upon a time", GREEDY)
    for _ in range(3):
        engine.step()
    assert engine.core._in_flight is not None
    before = engine.stats()["kv_blocks_used"]
    engine.abort_request("a")
    assert engine.stats()["kv_blocks_used"] < before  # freed at once, not after the step
    tokens = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id == "b"
            tokens = out.outputs[0].token_ids
    assert tokens == alone
    assert engine.stats()["kv_blocks_used"] == 0


def test_request_added_while_a_step_is_in_flight_is_served():
    prompts = ["The capital of France is", "1, 2, 3, 4,"]
    alone = [make_llm(num_blocks=64).generate(p, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
             for p in prompts]
    engine = make_llm(num_blocks=64).engine
    engine.add_request("a", prompts[0], GREEDY)
    for _ in range(3):
        engine.step()
    assert engine.core._in_flight is not None
    engine.add_request("b", prompts[1], GREEDY)
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out.outputs[0].token_ids
    assert [final["a"], final["b"]] == alone
    assert engine.stats()["kv_blocks_used"] == 0


def _run_with_arrivals(**config):
    """One sequence decodes; a long prompt arrives and goes in 8-token chunks beside it;
    a third arrives while those chunks run. Final tokens per request, and the stats."""
    engine = make_llm(num_blocks=128, block_size=4, prefill_chunk_size=8, **config).engine
    arrivals = {2: ("b", "Once upon a time, in a land far away, there lived a king who"),
                4: ("c", "1, 2, 3, 4,")}
    engine.add_request("a", "The capital of France is", GREEDY)
    final, steps = {}, 0
    while engine.has_unfinished_requests() or arrivals:
        if steps in arrivals:
            engine.add_request(*arrivals.pop(steps), GREEDY)
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out.outputs[0].token_ids
        steps += 1
    return final, engine.stats()


def test_prefill_chunks_and_admissions_are_launched_ahead():
    refs, ref_stats = _run_with_arrivals(async_scheduling=False)
    final, stats = _run_with_arrivals()
    assert final == refs
    assert ref_stats["num_steps_launched_ahead"] == 0
    # Every step but the first was planned and launched while the one before it ran:
    # the chunks of "b" and the admissions of "b" and "c" included.
    assert stats["num_steps_launched_ahead"] == stats["num_steps"] - 1
    assert stats["kv_blocks_used"] == 0
