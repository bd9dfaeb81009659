"""Tool-call parsers on hand-written model outputs of each format, well-formed and not:
a malformed call is plain content, never an exception."""

from __future__ import annotations

import json

import pytest

from infer.server.tool_parsers import parse_hermes, parse_llama3_json


def _calls(parsed) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls]


def test_hermes_one_call_with_content_before():
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Paris", "unit": "celsius"}}\n</tool_call>')
    parsed = parse_hermes(text)
    assert parsed.content == "Let me check."
    assert _calls(parsed) == [("get_weather", {"city": "Paris", "unit": "celsius"})]
    [call] = parsed.tool_calls
    assert call.id.startswith("call_") and len(call.id) > 10


def test_hermes_parallel_calls_and_string_arguments():
    text = ('<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call>\n'
            '<tool_call>{"name": "b", "arguments": "{\\"y\\": [1, 2]}"}</tool_call>\n')
    parsed = parse_hermes(text)
    assert parsed.content is None
    assert _calls(parsed) == [("a", {"x": 1}), ("b", {"y": [1, 2]})]
    assert len({c.id for c in parsed.tool_calls}) == 2


def test_hermes_keeps_unicode_and_braces_in_strings():
    text = '<tool_call>{"name": "say", "arguments": {"text": "h\\u00e9 } {"}}</tool_call>'
    parsed = parse_hermes(text)
    assert _calls(parsed) == [("say", {"text": "hé } {"})]
    assert "hé" in parsed.tool_calls[0].arguments


@pytest.mark.parametrize("text", [
    "Just an answer, no tools.",
    '<tool_call>{"name": "a", "arguments": {"x": 1}</tool_call>',  # bad JSON
    '<tool_call>{"arguments": {"x": 1}}</tool_call>',  # no name
    '<tool_call>{"name": "", "arguments": {}}</tool_call>',  # empty name
    '<tool_call>{"name": "a", "arguments": [1, 2]}</tool_call>',  # arguments not an object
    '<tool_call>{"name": "a", "arguments": "not json"}</tool_call>',
    '<tool_call>{"name": "a", "arguments": {}}</tool_call> and then more words',
    '<tool_call>{"name": "a", "arguments": {}}',  # never closed (cut by max_tokens)
    "<tool_call>[]</tool_call>",
])
def test_hermes_malformed_is_plain_content(text):
    parsed = parse_hermes(text)
    assert parsed.content == text and parsed.tool_calls == []


def test_llama3_json_call_with_and_without_python_tag():
    text = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    assert _calls(parse_llama3_json(text)) == [("get_weather", {"city": "Paris"})]
    parsed = parse_llama3_json('<|python_tag|>{"name": "f", "arguments": {"a": true}}')
    assert parsed.content is None and _calls(parsed) == [("f", {"a": True})]


def test_llama3_json_several_calls():
    text = '{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}'
    assert _calls(parse_llama3_json(text)) == [("a", {"x": 1}), ("b", {})]


@pytest.mark.parametrize("text", [
    "The weather in Paris is mild.",
    '{"name": "a", "parameters": {"x": 1}',  # cut short
    '{"parameters": {"x": 1}}',  # no name
    '{"name": "a", "parameters": 3}',
    '{"name": "a", "parameters": {}} and some words',
    '[{"name": "a", "parameters": {}}]',
    "{not json at all}",
])
def test_llama3_json_malformed_is_plain_content(text):
    parsed = parse_llama3_json(text)
    assert parsed.content == text and parsed.tool_calls == []
