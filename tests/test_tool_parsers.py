"""Tool-call parsers on hand-written model outputs of each format, well-formed and not:
a malformed call is plain content, never an exception."""

from __future__ import annotations

import json

import pytest

from infer.server.tool_parsers import PARSERS, ToolCallStream, parse_hermes, parse_llama3_json


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


# -- streaming: the same calls as the whole-text parsers, however the text is cut --------
def _stream(parser: str, text: str, seed: int) -> tuple[str, list[tuple[str, str, str]], bool]:
    """(content, [(id, name, arguments)], called) assembled from random-sized pieces, as
    the openai client assembles deltas: by index, id and name once, arguments appended."""
    import random

    stream, rng = ToolCallStream(parser), random.Random(seed)
    content, calls, at = [], {}, 0
    while at < len(text):
        size = rng.randint(1, 7)
        piece, deltas = stream.feed(text[at:at + size])
        at += size
        content.append(piece)
        for d in deltas:
            call = calls.setdefault(d.index, ["", "", ""])
            if d.id is not None:
                assert call[0] == "", "a call's header goes out once"
                call[0], call[1] = d.id, d.name
            else:
                assert call[0], "arguments come after their call's header"
            call[2] += d.arguments
    piece, deltas = stream.finish()
    assert deltas == []
    content.append(piece)
    assert sorted(calls) == list(range(len(calls)))
    return "".join(content), [tuple(calls[i]) for i in sorted(calls)], stream.called


WELL_FORMED = [
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": '
               '{"city": "Paris", "unit": "celsius"}}\n</tool_call>'),
    ("hermes", '<tool_call>{"name": "a", "arguments": {"x": [1, {"y": "} ]"}], "z": "\\""}}'
               '</tool_call>\n<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call>\n'),
    ("hermes", '<tool_call>{"arguments": {"q": 1}, "name": "late_name"}</tool_call>'),
    ("hermes", '<tool_call>{"name": "s", "arguments": "{\\"y\\": 2}"}</tool_call>'),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}'),
    ("llama3_json", '<|python_tag|>{"name": "a", "parameters": {"x": {"k": [1]}}}; '
                    '{"name": "b", "parameters": {}}'),
]


@pytest.mark.parametrize(("parser", "text"), WELL_FORMED)
@pytest.mark.parametrize("seed", range(4))
def test_streamed_calls_assemble_to_the_parsed_ones(parser, text, seed):
    whole = PARSERS[parser](text)
    content, calls, called = _stream(parser, text, seed)
    assert called
    assert (content or None) == whole.content
    assert [(name, json.loads(arguments)) for _, name, arguments in calls] == _calls(whole)
    assert all(call_id.startswith("call_") for call_id, _, _ in calls)


def test_streamed_arguments_go_out_before_the_call_ends():
    stream = ToolCallStream("hermes")
    _, first = stream.feed('<tool_call>\n{"name": "f", "arguments": {"text": "hel')
    assert [(d.name, d.arguments) for d in first] == [("f", ""), (None, '{"text": "hel')]
    _, more = stream.feed('lo"}}\n</tool')
    assert [d.arguments for d in more] == ['lo"}']  # the call's own closing brace held back
    assert stream.feed("_call>") == ("", []) and stream.finish() == ("", [])


@pytest.mark.parametrize(("parser", "text"), [
    ("hermes", "Just an answer, no tools. <tool"),
    ("hermes", "a < b and <tool_cal is not a tag"),
    ("hermes", '<tool_call>{"arguments": {"x": 1}}</tool_call>'),  # no name: content
    ("hermes", '<tool_call>[1, 2]</tool_call>'),
    ("hermes", "<tool_call>not json"),  # cut short before any header
    ("hermes", '<tool_call>{"name": "bad\\q", "arguments": {}}</tool_call>'),  # bad escape
    ("hermes", '<tool_call>{"name": "", "arguments": {"x": 1}}</tool_call>'),  # empty name
    ("llama3_json", "The weather in Paris is mild."),
    ("llama3_json", "  {not json at all}"),
    ("llama3_json", "<|python"),
])
@pytest.mark.parametrize("seed", range(3))
def test_streamed_text_that_is_no_call_is_content(parser, text, seed):
    content, calls, called = _stream(parser, text, seed)
    assert (content, calls, called) == (text, [], False)


def test_a_call_cut_short_keeps_what_went_out():
    content, calls, called = _stream("hermes", '<tool_call>{"name": "f", "arguments": {"a": 1',
                                     0)
    assert called and content == "" and [(n, a) for _, n, a in calls] == [("f", '{"a": 1')]
