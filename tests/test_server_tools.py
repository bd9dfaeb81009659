"""Tool calling through the server with the official openai client on the real SmolLM2:
tool_choice required / named / auto / none, streamed calls assembled by the client, the
conversation history with calls and results, each template format (SmolLM2's own, which
shows no tools; a Hermes template; a Llama 3 JSON one), and bad tool requests refused by
field name. Also reasoning templates: chat_template_kwargs reach the template."""

from __future__ import annotations

import contextlib
import json

import httpx
import openai
import pytest
from server_fixtures import MODEL, live_server, shared_engine

from infer.server.chat import chat_setup
from infer.server.tools import ToolCalling, tool_calling, tool_format

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 30},
    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}
TIME = {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 30}},
        "required": ["timezone"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER,
                                      "description": "The current weather in a city"}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME,
                                      "description": "The current time in a timezone"}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]

# Templates written for these tests in each format the server reads.
HERMES_TEMPLATE = """{%- if tools %}<|im_start|>system
Functions you may call:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
Call one with <tool_call>{"name": ..., "arguments": ...}</tool_call>.<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}<|im_start|>assistant
{%- for call in message.tool_calls %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
LLAMA3_TEMPLATE = """{%- for message in messages %}<|im_start|>{{ message.role }}
{%- if message.role == "ipython" or message.role == "tool" %} (tool output){% endif %}
{{ message.content }}<|im_end|>
{% endfor %}
{%- if tools %}<|im_start|>system
Answer a call as {"name": function name, "parameters": arguments}, after <|python_tag|>.
{%- for tool in tools %} {{ tool | tojson }}{% endfor %}<|im_end|>
{% endif %}<|im_start|>assistant
"""
THINKING_TEMPLATE = """{%- for message in messages %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endfor %}<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think>

</think>

{% endif %}"""


@pytest.fixture(scope="module")
def server():
    with live_server(shared_engine()) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@contextlib.contextmanager
def chat_template(server, template: str):
    """The served model's chat template replaced for the block."""
    templates = server.engine.tokenizer.chat_templates
    saved = dict(templates)
    templates["default"] = template
    try:
        yield
    finally:
        templates.clear()
        templates.update(saved)


def _check_calls(calls, names=None) -> list[tuple[str, dict]]:
    assert calls, "no tool calls"
    out = []
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in (names or SCHEMAS)
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, SCHEMAS[call.function.name])
        out.append((call.function.name, arguments))
    assert len({c.id for c in calls}) == len(calls)
    return out


@pytest.mark.parametrize("template", [None, HERMES_TEMPLATE, LLAMA3_TEMPLATE],
                         ids=["no-tools-template", "hermes", "llama3-json"])
def test_required_returns_valid_calls_streamed_or_not(server, client, template):
    context = chat_template(server, template) if template else contextlib.nullcontext()
    with context:
        kwargs = {"model": MODEL, "messages": ASK, "tools": TOOLS, "tool_choice": "required",
                  "max_tokens": 120, "temperature": 0}
        whole = client.chat.completions.create(**kwargs)
        [choice] = whole.choices
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content is None
        calls = _check_calls(choice.message.tool_calls)
        assert len(calls) <= len(TOOLS)  # at most one call per function offered
        with client.beta.chat.completions.stream(**kwargs) as stream:
            final = stream.get_final_completion()
        [streamed] = final.choices
        assert streamed.finish_reason == "tool_calls"
        assert _check_calls(streamed.message.tool_calls) == calls  # greedy: the same calls


def test_streamed_call_deltas_are_shaped_as_openai_sends_them(client):
    stream = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, max_tokens=120, temperature=0, stream=True,
        tool_choice={"type": "function", "function": {"name": "get_time"}})
    deltas, finish = [], None
    for chunk in stream:
        for choice in chunk.choices:
            deltas += choice.delta.tool_calls or []
            finish = choice.finish_reason or finish
    assert finish == "tool_calls"
    first, rest = deltas[0], deltas[1:]
    assert first.index == 0 and first.id.startswith("call_") and first.type == "function"
    assert first.function.name == "get_time"
    assert rest and all(d.index == 0 and d.id is None and d.function.name is None
                        for d in rest), "after the header, argument fragments only"
    arguments = first.function.arguments + "".join(d.function.arguments for d in rest)
    jsonschema.validate(json.loads(arguments), TIME)


def test_named_function_is_called_once(client):
    out = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, max_tokens=120, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_time"}})
    [call] = _check_calls(out.choices[0].message.tool_calls, ["get_time"])
    assert call[0] == "get_time"


def test_auto_and_none_answer_in_text_or_calls(client):
    auto = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                          max_tokens=40, temperature=0)
    message = auto.choices[0].message
    if message.tool_calls:  # the model chose to call: then the calls parse
        _check_calls(message.tool_calls)
        assert auto.choices[0].finish_reason == "tool_calls"
    else:
        assert message.content and "<tool_call>" not in message.content
    none = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                          tool_choice="none", max_tokens=20, temperature=0)
    plain = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=20,
                                           temperature=0)
    assert none.choices[0].message.tool_calls is None
    assert none.choices[0].message.content == plain.choices[0].message.content


def test_history_with_calls_and_results_round_trips(server, client):
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"}]
    for template in (None, HERMES_TEMPLATE):
        context = chat_template(server, template) if template else contextlib.nullcontext()
        with context:
            out = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS,
                                                 max_tokens=20, temperature=0)
            assert out.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # what the templates see: the arguments as an object, the result in Hermes text
    tokenizer = server.engine.tokenizer
    messages = [{k: v for k, v in m.items()} for m in history]
    for template, shows in ((HERMES_TEMPLATE, True), (tokenizer.chat_template, False)):
        plan = tool_calling(TOOLS, "auto", None, template)
        setup = chat_setup(messages, plan, None, template)
        with chat_template(server, template):
            text = setup.render(tokenizer, True, False)
        assert '"arguments": {"city": "Paris"}' in text, text
        assert "18 degrees, sunny" in text and '"get_time"' in text
        assert ("<tool_response>" in text) and ((plan.system_prompt is None) == shows)


def test_template_formats_are_read_from_the_template(server):
    assert tool_format(HERMES_TEMPLATE) == "hermes"
    assert tool_format(LLAMA3_TEMPLATE) == "llama3_json"
    assert tool_format(server.engine.tokenizer.chat_template) is None
    assert tool_calling(TOOLS, "none", None, HERMES_TEMPLATE) == ToolCalling()
    assert tool_calling(TOOLS, None, None, LLAMA3_TEMPLATE).parser == "llama3_json"


@pytest.mark.parametrize(("fields", "param", "match"), [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "'nope', which is not among the tools"),
    ({"tool_choice": "sometimes"}, "tool_choice", "none, auto, required"),
    ({"tools": [{"type": "retrieval"}]}, "tools", "only tools of type 'function'"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools",
     "letters, digits"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools", "a second function named 'get_weather'"),
    ({"tools": None, "tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "cannot be combined with response_format"),
    ({"tool_choice": "required", "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {
            "x": {"type": "string", "pattern": "(unclosed"}}}}}]}, "tools",
     "failed to compile JSON schema: regex parse error: unclosed group"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs", "messages"),
])
def test_bad_tool_requests_are_refused_by_field(server, fields, param, match):
    body = {"model": MODEL, "messages": ASK, "tools": TOOLS, "max_tokens": 5, **fields}
    body = {k: v for k, v in body.items() if v is not None}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and match in error["message"], error
    server.wait_idle()


def test_chat_template_kwargs_reach_the_template(server, client):
    with chat_template(server, THINKING_TEMPLATE):
        ask = {"model": MODEL, "messages": ASK, "max_tokens": 12, "temperature": 0}
        off = client.chat.completions.create(
            **ask, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        on = client.chat.completions.create(**ask)
    # the closed reasoning part is in the prompt: the same answer, as content, no reasoning
    assert off.usage.prompt_tokens > on.usage.prompt_tokens
    assert off.choices[0].message.content
    assert getattr(off.choices[0].message, "reasoning_content", None) is None


def test_reasoning_content_streamed_or_not(server, client):
    """A prompt that ends inside an open <think> (here the assistant turn is continued from
    it): the output is reasoning until </think>, in reasoning_content, the same whether
    streamed or not."""
    messages = [*ASK, {"role": "assistant", "content": "<think>"}]
    ask = {"model": MODEL, "messages": messages, "max_tokens": 16, "temperature": 0,
           "extra_body": {"continue_final_message": True, "add_generation_prompt": False}}
    with chat_template(server, THINKING_TEMPLATE):
        whole = client.chat.completions.create(**ask).choices[0]
        chunks = list(client.chat.completions.create(**ask, stream=True))
    # the same prompt from a template that does not reason: the text unsplit
    with chat_template(server, THINKING_TEMPLATE[:THINKING_TEMPLATE.index("{% if")]):
        plain = client.chat.completions.create(**ask).choices[0]
    reasoning = whole.message.model_extra["reasoning_content"]
    assert reasoning and whole.finish_reason == "length"
    text = plain.message.content
    if "</think>" in text:  # the reasoning ended: the rest is the answer
        assert reasoning == text[:text.index("</think>")]
    else:
        assert reasoning == text and whole.message.content in (None, "")
    streamed = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.model_extra.get("reasoning_content") or "" for d in streamed) == reasoning
    assert "".join(d.content or "" for d in streamed) == (whole.message.content or "")
