"""Request fields the server does not declare: accepted and ignored (as vLLM does), logged
at WARNING once per request and named in the `X-Infer-Ignored-Fields` header; extra keys of
messages and content parts dropped silently; declared fields still strictly typed."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from server_fixtures import tiny_server

NAME = "tiny-llama"
CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
HEADER = "x-infer-ignored-fields"
LOGGER = "infer.server.ignored_fields"
USER = [{"role": "user", "content": "hi"}]
# OpenAI's fields that the server need not act on
OPENAI_CHAT_EXTRAS = {
    "service_tier": "auto", "prompt_cache_key": "k", "safety_identifier": "s",
    "modalities": ["text"], "prediction": {"type": "content", "content": "x"},
    "reasoning_effort": "low", "verbosity": "low", "web_search_options": {},
    "audio": {"voice": "alloy", "format": "wav"}, "function_call": "auto",
    "functions": [{"name": "f", "parameters": {}}]}


@pytest.fixture(scope="module")
def server():
    with tiny_server(NAME) as s:
        yield s


def _post(server, path, body, **kw) -> httpx.Response:
    if isinstance(body, bytes):
        return httpx.post(server.url + path, content=body,
                          headers={"content-type": "application/json"}, **kw)
    return httpx.post(server.url + path, json=body, **kw)


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == LOGGER and r.levelname == "WARNING"]


@pytest.mark.parametrize(("path", "body", "ignored"), [
    (CMPL, {"model": NAME, "prompt": "hi", "max_tokens": 2, "service_tier": "auto",
            "prompt_cache_key": "k", "safety_identifier": "s", "zzz_new": 1},
     ["service_tier", "prompt_cache_key", "safety_identifier", "zzz_new"]),
    (CHAT, {"model": NAME, "messages": USER, "max_tokens": 2, **OPENAI_CHAT_EXTRAS,
            "user": "u", "store": False, "metadata": {"a": "b"}},  # declared: not named
     list(OPENAI_CHAT_EXTRAS)),
    ("/tokenize", {"model": NAME, "prompt": "hi", "return_token_strs": True},
     ["return_token_strs"]),
    ("/detokenize", {"model": NAME, "tokens": [5], "x": None}, ["x"]),
], ids=["completions", "chat", "tokenize", "detokenize"])
def test_ignored_fields_are_answered_in_a_header_and_logged_once(server, caplog, path, body,
                                                                 ignored):
    with caplog.at_level("WARNING", logger=LOGGER):
        r = _post(server, path, body)
    assert r.status_code == 200, r.text
    assert r.headers[HEADER].split(",") == ignored
    [line] = _warnings(caplog)
    assert line == ("The following fields were present in the request but ignored: {"
                    + ", ".join(map(repr, ignored)) + "}")


def test_a_request_with_none_gets_no_header_and_no_warning(server, caplog):
    with caplog.at_level("WARNING", logger=LOGGER):
        r = _post(server, CMPL, {"model": NAME, "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 200 and HEADER not in r.headers
    assert _warnings(caplog) == []


def test_a_streamed_answer_and_stream_options_extras(server, caplog):
    body = {"model": NAME, "prompt": "hi", "max_tokens": 2, "stream": True, "foo": 1,
            "stream_options": {"include_usage": True, "include_obfuscation": False}}
    with caplog.at_level("WARNING", logger=LOGGER), \
            httpx.stream("POST", server.url + CMPL, json=body) as r:
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert r.status_code == 200
    assert r.headers[HEADER] == "foo,stream_options.include_obfuscation"
    assert events[-1] == "data: [DONE]" and json.loads(events[-2][6:])["usage"]
    assert len(_warnings(caplog)) == 1


def test_the_header_is_on_a_400_for_a_field_still_refused(server):
    r = _post(server, CMPL, {"model": NAME, "prompt": "hi", "suffix": "!", "foo": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "suffix"
    assert r.headers[HEADER] == "foo"
    r = _post(server, CMPL, {"model": NAME, "prompt": "hi", "max_tokens": "2", "foo": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def test_extra_keys_of_messages_and_parts_are_dropped_silently(server, caplog):
    messages = [
        {"role": "system", "content": "be brief", "cache_control": {"type": "ephemeral"}},
        {"role": "user", "content": [{"type": "text", "text": "hi",
                                      "cache_control": {"type": "ephemeral"}}]},
        {"role": "assistant", "content": "hello", "annotations": [], "audio": None,
         "function_call": None},
        {"role": "user", "content": "again"}]
    plain = [{"role": m["role"], "content": m["content"] if isinstance(m["content"], str)
              else "hi"} for m in messages]
    with caplog.at_level("WARNING", logger=LOGGER):
        r = _post(server, "/tokenize", {"model": NAME, "messages": messages})
    assert r.status_code == 200 and HEADER not in r.headers and _warnings(caplog) == []
    assert r.json()["tokens"] == server.engine.tokenizer.encode_chat(plain)
    r = _post(server, CHAT, {"model": NAME, "messages": messages, "max_tokens": 2})
    assert r.status_code == 200, r.text


def test_text_parts_are_joined_by_newlines_as_offline(server):
    from infer.inputs import text_messages

    messages = [{"role": "user", "content": [{"type": "text", "text": "first"},
                                             {"type": "text", "text": "second"}]}]
    r = _post(server, "/tokenize", {"model": NAME, "messages": messages})
    tok = server.engine.tokenizer
    assert r.json()["tokens"] == tok.encode_chat(
        [{"role": "user", "content": "first\nsecond"}]) == tok.encode_chat(
        text_messages(messages))


def test_reasoning_sent_back_reaches_the_template(server):
    template = ("{% for m in messages %}{{ m['role'] }}:{{ m.get('reasoning_content', '') }}"
                "|{{ m['content'] }};{% endfor %}")
    tok = server.engine.tokenizer
    saved = dict(tok.chat_templates)
    tok.chat_templates["default"] = template
    try:
        messages = [*USER, {"role": "assistant", "content": "4", "reasoning_content": "2+2"}]
        r = _post(server, "/tokenize", {"model": NAME, "messages": messages,
                                        "add_generation_prompt": False})
    finally:
        tok.chat_templates.clear()
        tok.chat_templates.update(saved)
    assert tok.decode(r.json()["tokens"], skip_special_tokens=False) == "user:|hi;assistant:2+2|4;"


def test_odd_names_stay_a_valid_bounded_header(server, caplog):
    names = ["a,b", "é", "x\ny", "\ud800", *(f"f{i:02d}" for i in range(20))]
    body = {"model": NAME, "prompt": "hi", "max_tokens": 1, **dict.fromkeys(names, 1)}
    raw = json.dumps(body).encode()  # \ud800 stays an escape: valid JSON
    with caplog.at_level("WARNING", logger=LOGGER):
        r = _post(server, CMPL, raw)
    assert r.status_code == 200, r.text
    shown = r.headers[HEADER].split(",")
    assert shown[:4] == ["a%2Cb", "%C3%A9", "x%0Ay", "%ED%A0%80"]
    assert len(shown) == 17 and shown[-1] == "..."
    [line] = _warnings(caplog)
    assert "\n" not in line and line.endswith("(and 8 more)")


def test_the_openai_client_sees_the_header(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    raw = client.chat.completions.with_raw_response.create(
        model=NAME, messages=USER, max_tokens=2, service_tier="auto",
        prompt_cache_key="k", extra_body={"my_option": 1})
    assert raw.parse().choices[0].message.role == "assistant"
    assert set(raw.headers[HEADER].split(",")) == {"service_tier", "prompt_cache_key",
                                                   "my_option"}
