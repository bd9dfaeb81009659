"""Many concurrent streaming clients, clients that drop mid-stream, and backpressure."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time

import httpx
import pytest
from server_fixtures import MODEL, live_server, make_engine, shared_engine

pytestmark = pytest.mark.slow  # `pytest -m 'not slow'`: the quick inner loop skips it

PROMPTS = ["The capital of France is", "1, 2, 3, 4,", "Once upon a time", "def add(a, b):",
           "The sky is", "My favourite food is", "Water boils at", "Hello, my name is"]


@pytest.fixture(scope="module")
def server():
    with live_server(shared_engine()) as s:
        yield s


async def _stream_text(client: httpx.AsyncClient, prompt: str, max_tokens: int) -> str:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True}
    text, done = "", False
    async with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                text += json.loads(line[6:])["choices"][0]["text"]
    assert done
    return text


def test_64_concurrent_streams_match_alone(server):
    alone = {p: httpx.post(server.url + "/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": p, "max_tokens": 6, "temperature": 0}).json()
        ["choices"][0]["text"] for p in PROMPTS}

    async def run():
        limits = httpx.Limits(max_connections=100)
        async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as c:
            prompts = [PROMPTS[i % len(PROMPTS)] for i in range(64)]
            texts = await asyncio.gather(*(_stream_text(c, p, 6) for p in prompts))
        return prompts, texts

    prompts, texts = asyncio.run(run())
    assert texts == [alone[p] for p in prompts]
    server.wait_idle()


def test_clients_dropping_mid_stream_free_their_blocks(server, caplog):
    async def drop_after_two_chunks(c: httpx.AsyncClient, prompt: str) -> None:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 400, "stream": True,
                "ignore_eos": True}
        async with c.stream("POST", "/v1/completions", json=body) as r:
            seen = 0
            async for line in r.aiter_lines():
                seen += line.startswith("data: ")
                if seen == 2:
                    return  # closes the connection mid-stream

    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as c:
            await asyncio.gather(*(drop_after_two_chunks(c, p) for p in PROMPTS))

    asyncio.run(run())
    # a non-streaming client that gives up: its request is aborted as well
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", timeout=0.5, json={
            "model": MODEL, "prompt": PROMPTS[0], "max_tokens": 400, "ignore_eos": True})
    server.wait_idle()
    r = httpx.post(server.url + "/v1/completions", json={
        "model": MODEL, "prompt": PROMPTS[0], "max_tokens": 2})
    assert r.status_code == 200
    assert httpx.get(server.url + "/health").status_code == 200
    assert not [rec for rec in caplog.records if rec.levelno >= logging.ERROR]


def _post_quietly(url: str, body: dict) -> None:
    with contextlib.suppress(httpx.HTTPError):  # gives up on purpose: that aborts it
        httpx.post(url, json=body, timeout=6)


def _until(condition, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting for the engine"
        time.sleep(0.02)


def test_full_waiting_queue_answers_503_with_retry_after():
    engine = make_engine(max_waiting_requests=1, max_num_seqs=1, num_blocks=64)
    try:
        with live_server(engine) as server:
            long = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 200,
                    "ignore_eos": True}
            threads = [threading.Thread(target=_post_quietly, daemon=True, args=(
                server.url + "/v1/completions", long)) for _ in range(2)]
            # one after the other: added in the same engine turn, the second would find
            # the first still waiting and be refused
            threads[0].start()
            _until(lambda: engine.stats["num_requests_running"] >= 1)
            threads[1].start()
            _until(lambda: engine.stats["num_requests_waiting"] >= 1)  # one runs, one waits
            r = httpx.post(server.url + "/v1/completions", json=long)
            assert r.status_code == 503 and r.headers["retry-after"] == "1"
            assert r.json()["error"]["code"] == "server_busy"
            for t in threads:
                t.join()
            server.wait_idle()
            assert httpx.get(server.url + "/health").status_code == 200
    finally:
        engine.shutdown()
