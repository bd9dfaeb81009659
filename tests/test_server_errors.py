"""Malformed requests -> 4xx with an OpenAI error body, and the server keeps serving."""

from __future__ import annotations

import httpx
import pytest
from server_fixtures import MODEL, live_server, shared_engine

CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
OK_CHAT = [{"role": "user", "content": "hi"}]
LONG_PROMPT = "hello " * 600  # over max_model_len=512


def _c(**kw):
    return {"model": MODEL, "prompt": "hi", "max_tokens": 2, **kw}


def _m(**kw):
    return {"model": MODEL, "messages": OK_CHAT, "max_tokens": 2, **kw}


CASES = [
    ("invalid json", CMPL, b"{not json", 400, None),
    ("invalid utf-8", CMPL, b'{"model": "\xff\xfe", "prompt": "hi"}', 400, None),
    ("body not an object", CMPL, [1, 2], 400, None),
    ("missing prompt", CMPL, {"model": MODEL}, 400, "prompt"),
    ("unknown model", CMPL, _c(model="gpt-9"), 404, "model"),
    ("prompt wrong type", CMPL, _c(prompt=5), 400, None),
    ("empty prompt", CMPL, _c(prompt=""), 400, "prompt"),
    ("empty prompt list", CMPL, _c(prompt=[]), 400, "prompt"),
    ("token id out of range", CMPL, _c(prompt=[1, 10**9]), 400, "prompt"),
    ("negative max_tokens", CMPL, _c(max_tokens=-1), 400, "max_tokens"),
    ("zero max_tokens", CMPL, _c(max_tokens=0), 400, "max_tokens"),
    ("huge max_tokens", CMPL, _c(max_tokens=10**12), 400, "max_tokens"),
    ("max_tokens a string", CMPL, _c(max_tokens="5"), 400, "max_tokens"),
    ("max_tokens a float", CMPL, _c(max_tokens=2.5), 400, "max_tokens"),
    ("prompt too long", CMPL, _c(prompt=LONG_PROMPT), 400, "prompt"),
    ("n zero", CMPL, _c(n=0), 400, "n"),
    ("n too large", CMPL, _c(n=1000), 400, "n"),
    ("temperature negative", CMPL, _c(temperature=-0.5), 400, "temperature"),
    ("temperature too high", CMPL, _c(temperature=3.0), 400, "temperature"),
    ("temperature a string", CMPL, _c(temperature="hot"), 400, "temperature"),
    ("top_p zero", CMPL, _c(top_p=0), 400, "top_p"),
    ("presence_penalty out of range", CMPL, _c(presence_penalty=5), 400, "presence_penalty"),
    ("logprobs too many", CMPL, _c(logprobs=100), 400, "logprobs"),
    ("stop wrong type", CMPL, _c(stop=5), 400, "stop"),
    ("empty stop string", CMPL, _c(stop=[""]), 400, "stop"),
    ("stream_options without stream", CMPL, _c(stream_options={"include_usage": True}),
     400, "stream_options"),
    ("stream_options field wrong type", CMPL,
     _c(stream=True, stream_options={"include_usage": "yes"}), 400, "stream_options"),
    ("suffix unsupported", CMPL, _c(suffix="x"), 400, "suffix"),
    ("best_of other than n", CMPL, _c(best_of=3), 400, "best_of"),
    ("metadata wrong type", CHAT, _m(metadata={"a": 1}), 400, "metadata"),
    ("message field wrong type", CHAT, _m(messages=[{"role": "user", "content": "hi",
                                                     "name": 5}]), 400, "messages"),
    ("echo with logprobs, streamed", CMPL, _c(echo=True, logprobs=1, stream=True), 400,
     "echo"),
    ("zero max_tokens, streamed", CMPL, _c(echo=True, max_tokens=0, stream=True), 400,
     "max_tokens"),
    ("logit_bias key not a token id", CMPL, _c(logit_bias={"x": 1}), 400, "logit_bias"),
    ("logit_bias over 100", CMPL, _c(logit_bias={"5": 101}), 400, "logit_bias"),
    ("logit_bias token out of range", CMPL, _c(logit_bias={"999999": 1}), 400, "logit_bias"),
    ("prompt_logprobs streamed", CMPL, _c(prompt_logprobs=1, stream=True), 400,
     "prompt_logprobs"),
    ("empty messages", CHAT, _m(messages=[]), 400, "messages"),
    ("bad role", CHAT, _m(messages=[{"role": "wizard", "content": "hi"}]), 400, None),
    ("message without role", CHAT, _m(messages=[{"content": "hi"}]), 400, None),
    ("messages not a list", CHAT, _m(messages="hi"), 400, "messages"),
    ("content wrong type", CHAT, _m(messages=[{"role": "user", "content": 5}]), 400, None),
    ("image part", CHAT, _m(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]), 400, None),
    ("top_logprobs without logprobs", CHAT, _m(top_logprobs=2), 400, "top_logprobs"),
    ("tools unsupported", CHAT, _m(tools=[{"type": "function"}]), 400, "tools"),
    ("chat unknown model", CHAT, _m(model="nope"), 404, "model"),
    ("lone surrogate prompt", CMPL, b'{"model": "smollm2", "prompt": "a\\ud800"}', 400, "prompt"),
    ("lone surrogate in a prompt list", CMPL, b'{"model": "smollm2", "prompt": ["ok", "\\udfff"]}',
     400, "prompt"),
    ("lone surrogate content", CHAT,
     b'{"model": "smollm2", "messages": [{"role": "user", "content": "\\ud83d"}]}', 400,
     "messages"),
    ("lone surrogate stop", CMPL, b'{"model": "smollm2", "prompt": "hi", "stop": "\\ud800"}',
     400, "stop"),
    ("stop_token_ids negative", CMPL, _c(stop_token_ids=[-1]), 400, "stop_token_ids"),
]


@pytest.fixture(scope="module")
def server():
    with live_server(shared_engine(), max_body_bytes=64 * 1024) as s:
        yield s


@pytest.mark.parametrize(("name", "path", "body", "status", "param"), CASES,
                         ids=[c[0] for c in CASES])
def test_malformed_request(server, name, path, body, status, param):
    if isinstance(body, bytes):
        r = httpx.post(server.url + path, content=body,
                       headers={"content-type": "application/json"})
    else:
        r = httpx.post(server.url + path, json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] is not None and error["param"].startswith(param), error
    assert httpx.get(server.url + "/health").status_code == 200


@pytest.mark.parametrize(("path", "body"), [
    (CMPL, {"prompt": "hi", "max_tokens": 2}), (CHAT, {"messages": OK_CHAT, "max_tokens": 2}),
    (CMPL, {"model": None, "prompt": "hi", "max_tokens": 2})])
def test_a_request_without_a_model_gets_the_servers(server, path, body):
    """No `model` (or null): the first served model answers, and says so (vLLM's rule;
    OpenAI's API requires the field, so its clients always send one)."""
    r = httpx.post(server.url + path, json=body)
    assert r.status_code == 200, r.text
    assert r.json()["model"] == MODEL
    assert r.json()["usage"]["completion_tokens"] == 2


def test_oversized_body_and_unknown_route(server):
    r = httpx.post(server.url + CMPL, json=_c(prompt="x" * 100_000))
    assert r.status_code == 413 and "error" in r.json()
    r = httpx.get(server.url + "/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()
    assert httpx.get(server.url + "/health").status_code == 200
    server.wait_idle()


def test_api_key():
    with live_server(shared_engine(), api_key="sekret") as server:
        url = server.url + "/v1/models"
        assert httpx.get(url).status_code == 401
        r = httpx.get(url, headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401 and r.json()["error"]["code"] == 401
        assert httpx.get(url, headers={"Authorization": "Bearer sekret"}).status_code == 200
        assert httpx.get(server.url + "/health").status_code == 200


def test_health_is_503_while_loading():
    import asyncio

    from infer.server import build_app

    async def run():
        transport = httpx.ASGITransport(app=build_app(None, MODEL))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            health = await c.get("/health")
            completion = await c.post(CMPL, json=_c())
        return health, completion

    health, completion = asyncio.run(run())
    assert health.status_code == 503
    assert completion.status_code == 503 and completion.json()["error"]["code"] == "loading"


@pytest.mark.parametrize(("path", "body", "ignored"), [
    (CMPL, _c(foo=1), "foo"), (CHAT, _m(functions_x=1), "functions_x")])
def test_unknown_field_is_accepted_named_in_a_header_and_logged(server, caplog, path, body,
                                                                 ignored):
    """Once a 400 (extra="forbid"); now ignored, as vLLM does (test_server_ignored_fields)."""
    with caplog.at_level("WARNING", logger="infer.server.ignored_fields"):
        r = httpx.post(server.url + path, json=body)
    assert r.status_code == 200, r.text
    assert r.headers["x-infer-ignored-fields"] == ignored
    assert [m for m in caplog.messages if "ignored" in m] == [
        f"The following fields were present in the request but ignored: {{'{ignored}'}}"]
