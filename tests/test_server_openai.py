"""The official openai client (sync and async, stream and not) against a live server."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
from server_fixtures import MODEL, live_server, shared_engine

PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "What is 2+2?"}]


@pytest.fixture(scope="module")
def server():
    with live_server(shared_engine()) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_completion_usage_and_greedy_text(server, client):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    prompt_ids = server.engine.tokenizer.encode(PROMPT)
    assert r.usage.prompt_tokens == len(prompt_ids)
    assert r.usage.completion_tokens == 8
    assert r.usage.total_tokens == len(prompt_ids) + 8
    assert r.choices[0].finish_reason == "length"
    assert "Paris" in r.choices[0].text
    streamed = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8,
                                         temperature=0, stream=True,
                                         stream_options={"include_usage": True})
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text
    assert chunks[-1].usage.completion_tokens == 8 and not chunks[-1].choices


def test_completion_stop_seed_n_and_batch_prompts(client):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0,
                                  stop=["."])
    assert r.choices[0].finish_reason == "stop" and "." not in r.choices[0].text
    a, b = (client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8,
                                      temperature=1.0, seed=7, n=2) for _ in range(2))
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    r = client.completions.create(model=MODEL, prompt=[PROMPT, "1, 2, 3,"], max_tokens=4,
                                  temperature=0, n=2)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.choices[0].text == r.choices[1].text != r.choices[2].text
    assert r.usage.completion_tokens == 16


def test_completion_logprobs(client):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0,
                                  logprobs=3)
    lp = r.choices[0].logprobs
    assert "".join(lp.tokens) == r.choices[0].text
    assert len(lp.token_logprobs) == 5 and all(x <= 0 for x in lp.token_logprobs)
    for token, chosen, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 3 and top[token] == pytest.approx(chosen)  # greedy: the top-1
        assert max(top.values()) == pytest.approx(chosen)


def test_chat_stream_matches_non_stream(server, client):
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=16,
                                       temperature=0)
    assert r.choices[0].message.role == "assistant"
    assert "4" in r.choices[0].message.content
    prompt = server.engine.tokenizer.encode_chat(CHAT)
    assert r.usage.prompt_tokens == len(prompt)
    bos = server.engine.tokenizer.bos_token_id
    assert prompt[:2] != [bos, bos]  # the template writes the BOS; none is added
    stream = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=16,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == r.choices[0].message.content
    assert chunks[-1].usage.total_tokens == r.usage.total_tokens


def test_chat_logprobs_and_max_completion_tokens(client):
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=4,
                                       temperature=0, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 4
    assert "".join(t.token for t in content) == r.choices[0].message.content
    assert all(len(t.top_logprobs) == 2 and t.top_logprobs[0].token == t.token
               for t in content)


def test_async_client_stream_and_not(server):
    async def run():
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        whole = await client.chat.completions.create(model=MODEL, messages=CHAT,
                                                     max_tokens=16, temperature=0)
        stream = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8,
                                                 temperature=0, stream=True)
        text = "".join([c.choices[0].text async for c in stream])
        await client.close()
        return whole.choices[0].message.content, text

    chat_text, completion_text = asyncio.run(run())
    assert "4" in chat_text and "Paris" in completion_text


def test_models_tokenize_metrics_stats(server, client):
    client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)  # tokens to count
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.list().data[0].model_extra["quantization"] == "none"
    ids = httpx.post(server.url + "/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    assert ids == server.engine.tokenizer.encode(PROMPT)
    text = httpx.post(server.url + "/detokenize", json={"tokens": ids}).json()["prompt"]
    assert text.endswith(PROMPT)
    metrics = httpx.get(server.url + "/metrics").text
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage",
                 "prefix_cache_queries_total", "prefix_cache_hits_total",
                 "num_preemptions_total", "prompt_tokens_total", "generation_tokens_total",
                 "time_to_first_token_seconds_bucket", "inter_token_latency_seconds_bucket",
                 "e2e_request_latency_seconds_bucket"):
        assert f"infer:{name}" in metrics, name
    stats = httpx.get(server.url + "/stats").json()
    assert stats["generation_tokens_total"] > 0 and stats["kv_blocks_total"] == 256
