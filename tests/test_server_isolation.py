"""A hostile request must not harm anyone else's (issue 9): out-of-vocabulary token ids,
stop lists and prompt lists past their caps, huge prompts, a client that leaves while its
prompts are tokenized, and a request whose processing fails inside a step."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
import pytest
from server_fixtures import MODEL, live_server, shared_engine

from infer.sampling_params import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS

HEALTHY = {"model": MODEL, "max_tokens": 24, "temperature": 0, "ignore_eos": True,
           "stream": True, "stream_options": {"include_usage": True}}
PROMPTS = ["The capital of France is", "Once upon a time", "1, 2, 3,", "The sky is"]


@pytest.fixture(scope="module")
def server():
    with live_server(shared_engine(), max_seqs_per_request=8) as s:
        yield s


async def _stream(client: httpx.AsyncClient, body: dict, started: asyncio.Event | None = None
                  ) -> list[str]:
    events = []
    async with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if started is not None:
                    started.set()
    return events


def _assert_complete(events: list[str], tokens: int) -> None:
    assert events[-1] == "[DONE]", events[-3:]
    usage = json.loads(events[-2])["usage"]
    assert usage["completion_tokens"] == tokens


def test_a_poisoned_request_is_refused_while_other_streams_finish(server):
    vocab = server.engine.engine.model_config.vocab_size
    errors_before = server.engine.step_errors

    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            started = [asyncio.Event() for _ in PROMPTS]
            streams = [asyncio.ensure_future(_stream(client, {**HEALTHY, "prompt": p}, s))
                       for p, s in zip(PROMPTS, started)]
            for event in started:
                await asyncio.wait_for(event.wait(), 30)
            answers = []
            for extra in ({"min_tokens": 1}, {}):
                answers.append(await client.post("/v1/completions", json={
                    "model": MODEL, "prompt": "x", "max_tokens": 3, "stop_token_ids": [vocab],
                    **extra}))
            return answers, await asyncio.gather(*streams)

    answers, streams = asyncio.run(run())
    for r in answers:
        assert r.status_code == 400
        error = r.json()["error"]
        assert error["param"] == "stop_token_ids" and str(vocab) in error["message"]
    for events in streams:
        _assert_complete(events, HEALTHY["max_tokens"])
    assert server.engine.step_errors == errors_before
    server.wait_idle()


@pytest.mark.parametrize(("field", "value", "message"), [
    ("stop", ["s"] * (MAX_STOP_STRINGS + 1), f"at most {MAX_STOP_STRINGS}"),
    ("stop", ["x" * (MAX_STOP_STRING_CHARS + 1)], f"at most {MAX_STOP_STRING_CHARS} characters"),
    ("stop_token_ids", [1] * (MAX_STOP_TOKEN_IDS + 1), f"at most {MAX_STOP_TOKEN_IDS}"),
])
def test_stop_lists_past_their_caps_are_refused(server, field, value, message):
    r = httpx.post(server.url + "/v1/completions", json={
        "model": MODEL, "prompt": "Hi", "max_tokens": 2, field: value})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == field and message in r.json()["error"]["message"]


def test_prompts_times_n_past_the_cap_are_refused(server):
    url = server.url + "/v1/completions"
    r = httpx.post(url, json={"model": MODEL, "prompt": ["a"] * 9, "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert "9 sequences" in r.json()["error"]["message"]
    r = httpx.post(url, json={"model": MODEL, "prompt": ["a"] * 3, "n": 3, "max_tokens": 1})
    assert r.status_code == 400 and "9 sequences" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 9,
        "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"
    r = httpx.post(url, json={"model": MODEL, "prompt": ["a", "b"], "n": 4, "max_tokens": 1})
    assert r.status_code == 200 and len(r.json()["choices"]) == 8


def test_a_batch_with_one_bad_prompt_runs_none(server):
    steps = server.engine.engine.stats()["num_steps"]
    r = httpx.post(server.url + "/v1/completions", json={
        "model": MODEL, "prompt": [[1, 2], [3, 10**6]], "max_tokens": 1})
    assert r.status_code == 400 and "out of range" in r.json()["error"]["message"]
    server.wait_idle()
    assert server.engine.engine.stats()["num_steps"] == steps


def test_a_client_that_leaves_during_tokenization_queues_nothing(server, monkeypatch):
    ctx = server.app.state.serving
    real, finished = ctx.encode_prompt, threading.Event()

    def slow_encode(text, add_special_tokens=True):
        time.sleep(1.0)
        try:
            return real(text, add_special_tokens)
        finally:
            finished.set()

    monkeypatch.setattr(ctx, "encode_prompt", slow_encode)
    before = server.engine.engine.output_processor.prompt_tokens_total
    body = json.dumps({"model": MODEL, "prompt": ["a", "b"], "max_tokens": 50}).encode()
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        time.sleep(0.2)
    assert finished.wait(10)
    time.sleep(0.3)  # past the point where the prompts would have been queued
    assert server.engine.engine.output_processor.prompt_tokens_total == before
    assert not server.engine.engine.has_unfinished_requests()


def test_health_answers_while_a_huge_prompt_is_tokenized(server):
    done = threading.Event()
    result: dict = {}

    def tokenize():
        r = httpx.post(server.url + "/tokenize", timeout=120,
                       json={"model": MODEL, "prompt": "hello world " * 600_000})
        result["count"] = r.json()["count"]
        done.set()

    thread = threading.Thread(target=tokenize)
    thread.start()
    time.sleep(0.3)
    latencies = []
    while not done.is_set() and len(latencies) < 5:
        start = time.monotonic()
        assert httpx.get(server.url + "/health", timeout=10).status_code == 200
        latencies.append(time.monotonic() - start)
    answered_during = not done.is_set()
    thread.join()
    assert result["count"] >= 1_200_000  # two tokens per "hello world "
    assert answered_during and max(latencies) < 1.0, latencies


def test_a_prompt_far_over_the_context_is_refused_without_tokenizing(server, monkeypatch):
    tok = server.engine.tokenizer
    calls = []
    monkeypatch.setattr(tok, "encode", lambda *a, **k: calls.append(1))
    for path, body in (("/v1/completions", {"prompt": "word " * 400_000}),
                       ("/v1/chat/completions",
                        {"messages": [{"role": "user", "content": "word " * 400_000}]})):
        r = httpx.post(server.url + path, json={"model": MODEL, "max_tokens": 1, **body})
        assert r.status_code == 400
        error = r.json()["error"]
        assert error["code"] == "context_length_exceeded" and "at least" in error["message"]
    assert not calls


def test_stats_show_a_step_while_it_runs(server, monkeypatch):
    model = server.engine.engine.runner.model
    real, entered, release = model.forward, threading.Event(), threading.Event()

    def blocking_forward(*args, **kwargs):
        entered.set()
        assert release.wait(30)
        return real(*args, **kwargs)

    monkeypatch.setattr(model, "forward", blocking_forward)
    thread = threading.Thread(target=httpx.post, args=(server.url + "/v1/completions",), kwargs={
        "json": {"model": MODEL, "prompt": "The sky is", "max_tokens": 2}, "timeout": 60})
    thread.start()
    try:
        assert entered.wait(30)
        stats = httpx.get(server.url + "/stats").json()
        metrics = httpx.get(server.url + "/metrics").text
    finally:
        release.set()
        thread.join()
    assert stats["num_requests_running"] == 1 and stats["kv_blocks_used"] >= 1
    assert "infer:num_requests_running 1.0" in metrics
    server.wait_idle()


def test_a_request_failing_alone_gets_an_error_event_and_the_rest_finish(server, monkeypatch):
    processor = server.engine.engine.output_processor
    real = processor._apply

    def apply(seq, *args):
        if seq.params.seed == 4242:
            raise RuntimeError("detokenizer exploded")
        return real(seq, *args)

    monkeypatch.setattr(processor, "_apply", apply)

    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            healthy = [asyncio.ensure_future(_stream(client, {**HEALTHY, "prompt": p}))
                       for p in PROMPTS[:2]]
            bad = await _stream(client, {**HEALTHY, "prompt": "Hi", "seed": 4242})
            plain = await client.post("/v1/completions", json={
                "model": MODEL, "prompt": "Hi", "max_tokens": 4, "seed": 4242})
            return bad, plain, await asyncio.gather(*healthy)

    bad, plain, healthy = asyncio.run(run())
    assert "[DONE]" not in bad
    error = json.loads(bad[-1])["error"]
    assert error["code"] == 500 and "detokenizer exploded" in error["message"]
    assert plain.status_code == 500 and "detokenizer exploded" in plain.json()["error"]["message"]
    for events in healthy:
        _assert_complete(events, HEALTHY["max_tokens"])
    server.wait_idle()
    assert httpx.get(server.url + "/stats").json()["num_requests_failed"] >= 2
