"""The official openai client against a server on a tiny random Llama (an HF directory
written by the fixture): completions and chat, streamed and not, checked against the same
checkpoint run offline."""

from __future__ import annotations

import openai
import pytest
from server_fixtures import tiny_server
from tiny_model import tiny_model_dir

from infer import LLM, SamplingParams

pytest.importorskip("transformers")

NAME = "tiny-llama"
PROMPTS = ["The quick brown fox", "Once upon a time", "What is 2+2?"]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]
IGNORE_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def server():
    with tiny_server(NAME) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def offline():
    return LLM(str(tiny_model_dir()), device="cpu", num_blocks=64, max_model_len=128,
               block_size=8)


def _offline_text(llm: LLM, prompt, max_tokens: int) -> str:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].text


def test_models_lists_the_served_name(client):
    models = client.models.list().data
    assert [m.id for m in models] == [NAME] and models[0].max_model_len == 128


def test_completions_match_offline_stream_and_not(server, client, offline):
    r = client.completions.create(model=NAME, prompt=PROMPTS, max_tokens=12, temperature=0,
                                  extra_body=IGNORE_EOS)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert all(c.finish_reason == "length" for c in r.choices)
    assert [c.text for c in r.choices] == [_offline_text(offline, p, 12) for p in PROMPTS]
    tok = server.engine.tokenizer
    assert r.usage.prompt_tokens == sum(len(tok.encode(p)) for p in PROMPTS)
    assert r.usage.completion_tokens == 36
    stream = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=12,
                                       temperature=0, stream=True, extra_body=IGNORE_EOS,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == 12 and not chunks[-1].choices
    server.wait_idle()


def test_chat_matches_offline_stream_and_not(server, client, offline):
    prompt_ids = server.engine.tokenizer.encode_chat(CHAT)
    r = client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=10,
                                       temperature=0, extra_body=IGNORE_EOS)
    message = r.choices[0].message
    assert message.role == "assistant" and r.choices[0].finish_reason == "length"
    assert message.content == _offline_text(offline, prompt_ids, 10)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(prompt_ids), 10)
    stream = client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=10,
                                            temperature=0, stream=True, extra_body=IGNORE_EOS,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
        message.content
    assert chunks[-1].usage.total_tokens == r.usage.total_tokens
    server.wait_idle()


def test_sampled_n_with_seed_is_reproducible(client):
    def sample():
        return client.completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=8, n=3,
                                         temperature=1.0, seed=11)

    a, b = sample(), sample()
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert len({c.text for c in a.choices}) > 1


def test_client_errors_are_openai_exceptions(client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.completions.create(model=NAME, prompt="hi", max_tokens=500)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=NAME, messages=CHAT, temperature=5.0)
