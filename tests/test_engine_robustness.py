"""LLMEngine under failure: a step that raises, requests that can never fit, timings."""

from __future__ import annotations

import dataclasses

import pytest
from engine_fixtures import make_llm

from infer import RequestOutputKind, SamplingParams
from infer.engine.llm_engine import RequestRejected

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def _run(engine, rid: str, prompt: str, params: SamplingParams = GREEDY):
    engine.add_request(rid, prompt, params)
    last = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == rid:
                last = out
    return last


def _fail_forward(monkeypatch, engine, on_call: int, times: int = 1) -> list[int]:
    """The model's forward raises on its `on_call`-th call (1-based) and the `times` - 1
    calls after it."""
    model = engine.runner.model
    real = model.forward
    calls: list[int] = []

    def forward(*args, **kwargs):
        calls.append(1)
        if on_call <= len(calls) < on_call + times:
            raise RuntimeError("forward failed")
        return real(*args, **kwargs)

    monkeypatch.setattr(model, "forward", forward)
    return calls


def test_a_failing_forward_aborts_the_step_and_frees_its_blocks(monkeypatch):
    engine = make_llm(num_blocks=64, max_model_len=512).engine
    expected = _run(engine, "ref", "The capital of France is").outputs[0].token_ids
    _fail_forward(monkeypatch, engine, on_call=1)
    engine.add_request("a", "The capital of France is", GREEDY)
    engine.add_request("b", "Once upon a time", GREEDY)
    with pytest.raises(RuntimeError, match="forward failed"):
        engine.step()
    assert engine.stats()["kv_blocks_used"] == 0
    assert not engine.has_unfinished_requests() and not engine.core.sequences
    assert not engine.scheduler.running and not engine.scheduler.waiting
    # the pool and the prefix cache are sound: the same prompt gives the same tokens
    again = _run(engine, "after", "The capital of France is")
    assert again.finished and again.outputs[0].token_ids == expected
    assert engine.stats()["kv_blocks_used"] == 0


def test_requests_outside_the_failing_step_keep_going(monkeypatch):
    engine = make_llm(num_blocks=64, max_model_len=512, max_num_seqs=1).engine
    expected = _run(engine, "ref", "Once upon a time").outputs[0].token_ids
    engine.add_request("a", "The capital of France is", GREEDY)
    engine.add_request("b", "Once upon a time", GREEDY)  # waits: one sequence at a time
    engine.step()  # a's prefill; a's first decode is launched ahead behind it
    # a's second decode fails when launched ahead (dropped, to be planned again after the
    # step in flight) and again when run the ordinary way: then it fails the step
    _fail_forward(monkeypatch, engine, on_call=1, times=2)
    engine.step()  # a's first decode accounted
    with pytest.raises(RuntimeError):
        engine.step()
    assert "a" not in engine.output_processor.groups and "b" in engine.output_processor.groups
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert outputs[-1].request_id == "b" and outputs[-1].outputs[0].token_ids == expected
    assert engine.stats()["kv_blocks_used"] == 0


def test_output_metrics_are_filled_in_order():
    engine = make_llm(num_blocks=64, max_model_len=512).engine
    engine.add_request("m", "Hello", GREEDY)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert len(outputs) == GREEDY.max_tokens
    first = outputs[0].metrics
    assert first.arrival_time <= first.first_token_time == first.last_token_time
    assert first.finished_time is None
    last = outputs[-1].metrics
    assert last.first_token_time == first.first_token_time
    assert last.finished_time == last.last_token_time > first.first_token_time
    assert [o.metrics.last_token_time for o in outputs] == sorted(
        o.metrics.last_token_time for o in outputs)


def test_final_only_requests_report_once_with_the_same_result():
    engine = make_llm(num_blocks=64, max_model_len=512).engine
    params = SamplingParams(temperature=0.8, max_tokens=9, ignore_eos=True, n=2, seed=3,
                            logprobs=1)
    engine.add_request("every-step", "Hello there", params)
    engine.add_request("final", "Hello there",
                       dataclasses.replace(params, output_kind=RequestOutputKind.FINAL_ONLY))
    seen: dict[str, list] = {"every-step": [], "final": []}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen[out.request_id].append(out)
    assert len(seen["every-step"]) >= params.max_tokens  # the 2nd sibling trails by a step
    [final] = seen["final"]
    full = seen["every-step"][-1]
    assert final.finished and full.finished
    assert [(c.token_ids, c.text, c.finish_reason) for c in final.outputs] == [
        (c.token_ids, c.text, c.finish_reason) for c in full.outputs]
    for a, b in zip(final.outputs, full.outputs):  # rows of other batches: float noise only
        assert [sorted(e) for e in a.logprobs] == [sorted(e) for e in b.logprobs]
        assert a.cumulative_logprob == pytest.approx(b.cumulative_logprob, abs=1e-4)
    assert final.metrics.first_token_time < final.metrics.finished_time


def test_prompt_too_long_and_pool_too_small_are_distinct_errors():
    engine = make_llm(num_blocks=4, block_size=4, max_model_len=64).engine
    with pytest.raises(RequestRejected, match="maximum context length is 64 tokens") as long:
        engine.add_request(None, list(range(1, 100)), GREEDY)
    with pytest.raises(RequestRejected, match="KV cache pool holds 16 tokens") as pool:
        engine.add_request(None, list(range(1, 20)), GREEDY)
    with pytest.raises(RequestRejected, match="lower max_tokens to at most 6") as blocks:
        engine.add_request(None, list(range(1, 11)), SamplingParams(max_tokens=20))
    assert (long.value.param, pool.value.param, blocks.value.param) == (
        "prompt", "prompt", "max_tokens")
    assert not engine.has_unfinished_requests()
    # without max_tokens a request generates as many tokens as its blocks can hold
    out = _run(engine, "fits", list(range(1, 11)), SamplingParams(max_tokens=None, ignore_eos=True))
    assert len(out.outputs[0].token_ids) == 6 and out.outputs[0].finish_reason == "length"


def test_contiguous_cache_is_sized_from_the_memory_budget(monkeypatch):
    """It used to ask for max_num_seqs x max_model_len tokens (64 x 8192 for SmolLM2:
    24 GB) and was OOM-killed; now it holds as many full-length sequences as the budget
    allows, and the rest wait for a slot."""
    from infer.engine import memory

    monkeypatch.setattr(memory, "_available_host_memory", lambda: 4 << 30)
    llm = make_llm(kv_cache="contiguous", prefix_caching=False)
    engine = llm.engine
    mc = engine.model_config
    per_sequence = 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * 4 * 8192  # float32
    assert engine.max_model_len == 8192 and engine.kv.block_size == 8192
    assert engine.kv.pool.num_blocks == (1 << 30) // per_sequence == 2
    outs = llm.generate(["Hello", "The sky is", "1, 2, 3,"],
                        SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                        use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 3, 3]
    assert engine.kv.pool.num_used == 0
