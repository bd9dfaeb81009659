"""Requests that fail after admission: `request_timeout` (504, or an error event once a
stream has started) and an engine step that raises (500, or an error event). Either way the
request is aborted, its KV blocks freed, and the server keeps serving."""

from __future__ import annotations

import json

import httpx
import pytest
from server_fixtures import MODEL, live_server, make_tiny_engine, shared_engine
from tiny_model import tiny_model_dir

LONG = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True}
ERROR_KEYS = {"message", "type", "param", "code"}


@pytest.fixture(scope="module")
def server():
    with live_server(shared_engine(), request_timeout=0.05) as s:
        yield s


def _after_timeout(server) -> None:
    server.wait_idle(timeout=5)
    assert server.blocks_used() == 0
    assert httpx.get(server.url + "/health").status_code == 200


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_slow_request_answers_504(server, path):
    body = dict(LONG)
    if path.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": body.pop("prompt")}]
    r = httpx.post(server.url + path, json=body, timeout=30)
    assert r.status_code == 504, r.text
    error = r.json()["error"]
    assert set(error) == ERROR_KEYS and error["code"] == "timeout"
    assert "timed out" in error["message"]
    _after_timeout(server)


def test_slow_stream_ends_with_an_error_event(server):
    events = []
    with httpx.stream("POST", server.url + "/v1/completions", json={**LONG, "stream": True},
                      timeout=30) as r:
        assert r.status_code == 200  # the status is sent before the first token
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events and "[DONE]" not in events
    error = json.loads(events[-1])["error"]
    assert set(error) == ERROR_KEYS and error["code"] == "timeout"
    assert all("choices" in json.loads(e) for e in events[:-1])
    _after_timeout(server)


def test_a_request_within_the_timeout_succeeds():
    with live_server(shared_engine(), request_timeout=30) as server:
        r = httpx.post(server.url + "/v1/completions", json={**LONG, "max_tokens": 2})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


@pytest.fixture
def failing_server(monkeypatch):
    """A tiny-model server whose model forward raises once `arm()` has been called."""
    pytest.importorskip("transformers")
    engine = make_tiny_engine(tiny_model_dir())
    model = engine.engine.runner.model
    real, state = model.forward, {"armed": False}

    def forward(*args, **kwargs):
        if state.pop("armed", False):
            raise RuntimeError("forward failed")
        return real(*args, **kwargs)

    monkeypatch.setattr(model, "forward", forward)
    try:
        with live_server(engine, "tiny") as server:
            server.arm = lambda: state.update(armed=True)
            yield server
    finally:
        engine.shutdown()


def test_a_failing_step_answers_500_then_serves(failing_server):
    url, body = failing_server.url, {"model": "tiny", "prompt": "hello", "max_tokens": 4}
    failing_server.arm()
    r = httpx.post(url + "/v1/completions", json=body)
    assert r.status_code == 500
    error = r.json()["error"]
    assert set(error) == ERROR_KEYS and "forward failed" in error["message"]
    failing_server.arm()
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    error = json.loads(events[-1])["error"]
    assert set(error) == ERROR_KEYS and "forward failed" in error["message"]
    assert "[DONE]" not in events
    failing_server.wait_idle(timeout=5)
    r = httpx.post(url + "/v1/completions", json=body)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    assert httpx.get(url + "/health").status_code == 200
    assert failing_server.engine.step_errors == 2
