"""Scoring and biasing through the server, as lm-eval-harness and OpenAI clients call it:
`echo` + `logprobs` + `max_tokens=0` gives a continuation's log-likelihood (checked
against transformers' float64 log-softmax of the same weights), echo with generation,
streamed echo, `logit_bias`, and vLLM's `prompt_logprobs` extra."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch
from engine_fixtures import hf_model
from real_models import smollm2_gguf
from server_fixtures import MODEL, live_server, shared_engine

CONTEXT = "Question: What is the capital of France?\nAnswer:"
CONTINUATION = " Paris"


@pytest.fixture(scope="module")
def server():
    with live_server(shared_engine()) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def hf_log_softmax(ids: list[int]) -> torch.Tensor:
    """transformers' float64 log-softmax at each position (row j: the token after j)."""
    with torch.no_grad():
        logits = hf_model(str(smollm2_gguf()))(torch.tensor([ids])).logits[0]
    return torch.log_softmax(logits.double(), dim=-1)


def hf_token_logprobs(ids: list[int]) -> list[float]:
    """transformers' logprob of each token given the ones before it (ids[1:])."""
    ref = hf_log_softmax(ids)
    return [ref[j - 1, ids[j]].item() for j in range(1, len(ids))]


def test_lm_eval_loglikelihood_of_a_continuation(server, client):
    """lm-eval's local-completions request: the context + continuation echoed with
    logprobs, nothing generated; the continuation's tokens are the last ones."""
    tok = server.engine.tokenizer
    ids = tok.encode(CONTEXT + CONTINUATION)
    num_continuation = len(ids) - len(tok.encode(CONTEXT))
    r = client.completions.create(model=MODEL, prompt=CONTEXT + CONTINUATION, echo=True,
                                  max_tokens=0, logprobs=1, temperature=0)
    [choice] = r.choices
    assert choice.text == CONTEXT + CONTINUATION
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 0
    lps = choice.logprobs
    assert len(lps.token_logprobs) == len(ids) and lps.token_logprobs[0] is None
    assert "".join(lps.tokens) == CONTEXT + CONTINUATION
    assert lps.text_offset == [sum(len(t) for t in lps.tokens[:i]) for i in range(len(ids))]
    want = hf_token_logprobs(ids)
    assert lps.token_logprobs[1:] == pytest.approx(want, abs=1e-4)
    score = sum(lps.token_logprobs[-num_continuation:])
    assert score == pytest.approx(sum(want[-num_continuation:]), abs=1e-3)
    # lm-eval's is_greedy reads the most likely token at each place: transformers' argmax
    argmax = hf_log_softmax(ids).argmax(dim=-1).tolist()
    for j in range(1, len(ids)):
        top = lps.top_logprobs[j]
        assert max(top, key=top.get) == tok.decode([argmax[j - 1]], False)


def test_echo_with_generation_and_streamed(server, client):
    prompt = "The capital of France is"
    n_prompt = len(server.engine.tokenizer.encode(prompt))
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5,
                                      temperature=0)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0,
                                  echo=True, logprobs=2)
    [choice] = r.choices
    assert choice.text == prompt + plain.choices[0].text
    assert len(choice.logprobs.tokens) == n_prompt + r.usage.completion_tokens
    assert choice.logprobs.token_logprobs[0] is None
    assert all(lp is not None for lp in choice.logprobs.token_logprobs[1:])
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=5,
                                            temperature=0, echo=True, stream=True))
    assert chunks[0].choices[0].text.startswith(prompt)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text


def test_logit_bias_forces_a_token(client):
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0,
                                  logit_bias={"28": 100}, extra_body={"ignore_eos": True})
    assert r.choices[0].text == ",,,,"  # token 28 is ","


def test_prompt_logprobs_extra_on_completions_and_chat(server, client):
    prompt = "The capital of France is"
    ids = server.engine.tokenizer.encode(prompt)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2,
                                  extra_body={"prompt_logprobs": 2})
    entries = r.choices[0].model_extra["prompt_logprobs"]
    assert len(entries) == len(ids) and entries[0] is None
    want = hf_token_logprobs(ids)
    for j in range(1, len(ids)):
        entry = entries[j]
        assert entry[str(ids[j])]["logprob"] == pytest.approx(want[j - 1], abs=1e-4)
        assert {e["rank"] for e in entry.values()} >= {1, 2}
    chat = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "model": MODEL, "max_tokens": 2, "prompt_logprobs": 0,
        "messages": [{"role": "user", "content": "hi"}]}).json()
    assert len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]
    plain = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
    assert "prompt_logprobs" not in plain.json()
