"""One request's bad input or failure must not touch the others: inputs are checked against
the model before admission, and a failure inside a step is charged to the request that
caused it (the rest of the step goes on), whatever the random per-request inputs are."""

from __future__ import annotations

import pytest
from engine_fixtures import drain
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st
from tiny_model import tiny_model_dir

from infer import SamplingParams
from infer.engine.llm_engine import LLMEngine, RequestRejected

pytest.importorskip("transformers")  # the tiny checkpoint is written with it

HEALTHY = {"h1": [5, 6, 7, 8, 9, 10, 11], "h2": [40, 41, 42]}
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _engine(**config) -> LLMEngine:
    config = {"num_blocks": 64, "max_model_len": 128, "block_size": 8, **config}
    return LLMEngine(model=str(tiny_model_dir()), device="cpu", **config)


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return _engine()


@pytest.fixture(scope="module")
def alone(engine) -> dict[str, list[int]]:
    """Each healthy request's greedy tokens when it runs by itself."""
    result = {}
    for rid, prompt in HEALTHY.items():
        engine.add_request(rid, prompt, GREEDY)
        result[rid] = drain(engine)[rid].outputs[0].token_ids
    return result


def test_a_duplicate_request_id_is_refused_and_the_first_runs_on(engine):
    engine.add_request("dup", [5, 6], SamplingParams(max_tokens=3, ignore_eos=True))
    with pytest.raises(ValueError, match="duplicate request id 'dup'"):
        engine.add_request("dup", [7, 8], SamplingParams(max_tokens=3))
    out = drain(engine)["dup"]
    assert out.prompt_token_ids == [5, 6] and len(out.outputs[0].token_ids) == 3
    assert engine.stats()["kv_blocks_used"] == 0


def test_out_of_vocabulary_stop_token_ids_are_refused_by_name(engine):
    vocab = engine.model_config.vocab_size
    for extra in ({}, {"min_tokens": 1}):
        params = SamplingParams(max_tokens=3, stop_token_ids=[1, vocab], **extra)
        with pytest.raises(RequestRejected, match=rf"stop_token_ids out of range \[0, {vocab}\)"
                           ) as exc:
            engine.add_request("bad", [5, 6], params)
        assert exc.value.param == "stop_token_ids"
    assert not engine.has_unfinished_requests()
    engine.add_request("edge", [5, 6], SamplingParams(max_tokens=2, min_tokens=1,
                                                      stop_token_ids=[vocab - 1]))
    assert drain(engine)["edge"].finished


def _inject(monkeypatch, part: object, method: str, culprit: str, calls: list) -> None:
    """`part.<method>` raises whenever the sequence(s) it is given belong to `culprit`."""
    real = getattr(part, method)

    def seq_id(seq) -> str:
        return seq.request.request_id if hasattr(seq, "request") else seq.seq_id

    def faulty(seqs, *args):
        items = seqs if isinstance(seqs, list) else [seqs]
        if any(seq_id(s) == culprit for s in items):
            calls.append(method)
            raise RuntimeError(f"{method} failed")
        return real(seqs, *args)

    monkeypatch.setattr(part, method, faulty)


@pytest.mark.parametrize(("part", "method"), [("core", "_sampling_batch"),
                                              ("output_processor", "_apply")])
@pytest.mark.parametrize("async_scheduling", [True, False])
def test_a_failure_is_charged_to_its_request_alone(monkeypatch, alone, part, method,
                                                    async_scheduling):
    """core._sampling_batch: host-side preparation of the step (found by re-running it one
    request at a time); output_processor._apply: accounting after the step."""
    engine = _engine(async_scheduling=async_scheduling)
    calls: list[str] = []
    engine.add_request("h1", HEALTHY["h1"], GREEDY)
    engine.step()  # h1 is running when the culprit joins
    engine.add_request("culprit", [7, 8, 9], GREEDY)
    _inject(monkeypatch, getattr(engine, part), method, "culprit", calls)
    engine.add_request("h2", HEALTHY["h2"], GREEDY)
    outputs = drain(engine)
    assert calls
    failed = outputs["culprit"]
    assert failed.finished and method in failed.error
    assert [c.finish_reason for c in failed.outputs] == ["error"]
    for rid in HEALTHY:
        assert outputs[rid].error is None and outputs[rid].finished
        assert outputs[rid].outputs[0].token_ids == alone[rid]
    assert engine.num_requests_failed == 1
    assert engine.kv.pool.num_used == 0
    assert not engine.core.sequences and not engine.output_processor.groups


def test_a_failure_no_request_explains_still_fails_the_whole_step(monkeypatch):
    engine = _engine()
    engine.add_request("a", [5, 6, 7], GREEDY)
    engine.add_request("b", [8, 9], GREEDY)
    monkeypatch.setattr(engine.runner, "forward", _raise)
    with pytest.raises(RuntimeError, match="device lost"):
        engine.step()
    assert not engine.output_processor.groups and engine.kv.pool.num_used == 0


def _raise(*args, **kwargs):
    raise RuntimeError("device lost")


# -- random per-request inputs beside healthy requests ---------------------------------
def _mostly(valid: st.SearchStrategy, invalid: st.SearchStrategy) -> st.SearchStrategy:
    """Valid about 11 times in 12: a request has several fields, and many should get in."""
    return st.sampled_from([True] * 11 + [False]).flatmap(
        lambda ok: valid if ok else invalid)


_BAD_NUMBER = st.sampled_from([float("nan"), float("inf"), -1.0, 1e9, "1", None, True])
FIELDS = {
    "n": _mostly(st.integers(1, 3), st.sampled_from([0, -1, 1.5])),
    "temperature": _mostly(st.floats(0, 2), _BAD_NUMBER),
    "top_p": _mostly(st.floats(0.01, 1), _BAD_NUMBER),
    "top_k": _mostly(st.integers(-1, 400), st.sampled_from([-2, 1.5])),
    "min_p": _mostly(st.floats(0, 1), _BAD_NUMBER),
    "repetition_penalty": _mostly(st.floats(0.5, 2), _BAD_NUMBER),
    "presence_penalty": _mostly(st.floats(-2, 2), _BAD_NUMBER),
    "frequency_penalty": _mostly(st.floats(-2, 2), _BAD_NUMBER),
    "seed": st.one_of(st.none(), st.integers(-(2**70), 2**70)),
    "max_tokens": _mostly(st.one_of(st.none(), st.integers(1, 200)), st.sampled_from([0, -1])),
    "min_tokens": _mostly(st.integers(0, 8), st.sampled_from([-1, 500])),
    "stop": _mostly(st.one_of(st.none(), st.text(min_size=1, max_size=4),
                              st.lists(st.text(min_size=1, max_size=5), max_size=8)),
                    st.sampled_from(["", [""], ["x"] * 33, ["y" * 129], [3]])),
    "stop_token_ids": st.one_of(st.none(), st.lists(  # the tiny vocabulary has 320 ids
        st.one_of(st.integers(0, 319), st.sampled_from([320, 10**6, -1])), max_size=4)),
    "ignore_eos": st.booleans(),
    "logprobs": _mostly(st.one_of(st.none(), st.integers(0, 20)), st.sampled_from([-1, 21])),
    "skip_special_tokens": st.booleans(),
    "include_stop_str_in_output": st.booleans(),
}
RANDOM_REQUEST = st.tuples(
    st.fixed_dictionaries({}, optional=FIELDS),
    _mostly(st.one_of(st.lists(st.integers(0, 319), min_size=1, max_size=60),
                      st.text(min_size=1)),
            st.sampled_from([[], "", [1] * 128, [5, 320], [-1], [[1]], None, {"prompt": "x"}])),
)


@settings(max_examples=100, deadline=None, database=None,
          suppress_health_check=list(HealthCheck))
@given(requests=st.lists(RANDOM_REQUEST, min_size=1, max_size=3))
@example(requests=[({"max_tokens": 3, "min_tokens": 1, "stop_token_ids": [320]}, "x")])
def test_random_requests_never_fail_healthy_ones_nor_leak(engine, alone, requests):
    try:
        _random_requests_beside_healthy_ones(engine, alone, requests)
    finally:  # a failed example must not leave requests behind for the next one
        for rid in list(engine.output_processor.groups):
            engine.abort_request(rid)


def _random_requests_beside_healthy_ones(engine, alone, requests) -> None:
    failed_before = engine.num_requests_failed
    admitted = []
    for i, (fields, prompt) in enumerate(requests):
        try:
            engine.add_request(f"r{i}", prompt, SamplingParams(**fields))
        except ValueError:
            continue  # refused by name, before admission
        admitted.append(f"r{i}")
    event(f"admitted {len(admitted)} of {len(requests)}")
    for rid, prompt in HEALTHY.items():
        engine.add_request(rid, prompt, GREEDY)
    outputs = drain(engine)  # a step that raised would fail the test here
    for rid in HEALTHY:
        assert outputs[rid].error is None
        assert outputs[rid].outputs[0].token_ids == alone[rid]
    for rid in admitted:
        assert outputs[rid].finished and outputs[rid].error is None
    assert engine.kv.pool.num_used == 0 and not engine.core.sequences
    assert engine.num_requests_failed == failed_before


def test_a_reused_request_id_gets_nothing_of_the_step_in_flight_for_the_old_one(alone):
    engine = _engine(async_scheduling=True)
    engine.add_request("h1", [7, 8, 9], GREEDY)
    engine.step()
    engine.step()
    assert engine.core._in_flight is not None  # launched ahead, holds a row of the old h1
    engine.abort_request("h1")
    engine.add_request("h1", HEALTHY["h1"], GREEDY)  # the id again, another prompt
    outputs = drain(engine)
    assert outputs["h1"].outputs[0].token_ids == alone["h1"]
    assert engine.kv.pool.num_used == 0
