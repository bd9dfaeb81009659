"""Reasoning content: `<think>...</think>` split from the answer, whole and streamed (cut
at every place), where the prompt leaves the output to start; and an output constraint that
applies after the reasoning part, checked token by token against the grammar library on
the real SmolLM2 vocabulary."""

from __future__ import annotations

import pytest

from infer.server.reasoning import (
    THINK_TAGS,
    ReasoningStream,
    output_reasoning,
    reasoning_tags,
    split_reasoning,
)

CASES = [  # (output, mode, reasoning, content)
    ("<think>\nLet me see.\n</think>\n\nParis.", "optional", "\nLet me see.\n", "Paris."),
    ("  <think>a</think>b", "optional", "a", "b"),
    ("Paris, no thinking.", "optional", None, "Paris, no thinking."),
    ("A <think> later is content", "optional", None, "A <think> later is content"),
    ("<think>cut short by max_tok", "optional", "cut short by max_tok", ""),
    ("still thinking</think>\nAnswer", "open", "still thinking", "Answer"),
    ("no end tag at all", "open", "no end tag at all", ""),
    ("<thin", "optional", None, "<thin"),
    ("<think>x</think>", "optional", "x", ""),
]


@pytest.mark.parametrize(("text", "mode", "reasoning", "content"), CASES)
def test_whole_output_split(text, mode, reasoning, content):
    assert split_reasoning(text, THINK_TAGS, mode) == (reasoning, content)


@pytest.mark.parametrize(("text", "mode", "reasoning", "content"), CASES)
def test_streamed_output_split_at_every_cut(text, mode, reasoning, content):
    for cut in range(len(text) + 1):
        stream = ReasoningStream(THINK_TAGS, mode)
        pieces = [stream.feed(text[:cut]), stream.feed(text[cut:]), stream.finish()]
        assert "".join(p[0] for p in pieces) == (reasoning or "")
        assert "".join(p[1] for p in pieces) == content
        assert stream.reasoned == (reasoning is not None)


def test_where_the_prompt_leaves_the_output():
    assert reasoning_tags("{{ '<think>' }}...{{ '</think>' }}") == THINK_TAGS
    assert reasoning_tags("{% for m in messages %}{{ m.content }}{% endfor %}") is None
    assert output_reasoning("<|im_start|>assistant\n", THINK_TAGS) == "optional"
    assert output_reasoning("<|im_start|>assistant\n<think>\n", THINK_TAGS) == "open"
    assert output_reasoning("assistant\n<think>\n\n</think>\n\n", THINK_TAGS) is None


def _accepts(params, text: str) -> tuple[bool, bool]:
    """(every token of `text` allowed, the grammar may end there)."""
    from reference_tokenizers import ours
    from test_structured_output import _so

    so = _so()
    matcher = so.matcher(so.compile(params))
    ids = ours("smollm2").encode(text, add_special_tokens=False)
    allowed = all(matcher.accept(i) for i in ids)
    return allowed, allowed and matcher._matcher.is_accepting()


def test_a_constraint_applies_after_the_reasoning_part():
    pytest.importorskip("llguidance")
    from infer.structured_outputs import StructuredOutputsParams

    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    optional = StructuredOutputsParams(json=schema, reasoning_tags=THINK_TAGS)
    # free text inside the reasoning part, even what the constraint forbids
    assert _accepts(optional, '<think>not JSON {"n": "x"} at all</think>\n\n{"n":3}') \
        == (True, True)
    assert _accepts(optional, '{"n":3}') == (True, True)  # no reasoning part
    assert _accepts(optional, '{"n":"x"}')[0] is False  # the constraint after it holds
    assert _accepts(optional, '<think>a</think>{"m":1}')[0] is False
    assert _accepts(optional, "<think>unfinished") == (True, False)
    opened = StructuredOutputsParams(json=schema, reasoning_tags=("", "</think>"))
    assert _accepts(opened, 'thinking on</think>{"n":1}') == (True, True)
    assert _accepts(opened, '{"n":1}') == (True, False)  # still inside the reasoning
    choice = StructuredOutputsParams(choice=["yes", "no"], reasoning_tags=THINK_TAGS)
    assert _accepts(choice, "<think>maybe?</think> no") == (True, True)
    assert _accepts(choice, "maybe")[0] is False
