"""The text-only fast path of streaming chunks writes what the response models write."""

from __future__ import annotations

import json

import pytest

from infer.engine.outputs import CompletionOutput
from infer.server.protocol import (
    ChatChoice,
    ChatCompletionResponse,
    ChatMessageOut,
    CompletionChoice,
    CompletionResponse,
)
from infer.server.text_chunks import _MARKER, with_text_fast_path

TEXTS = ["", " fox", 'say "hi"\\n', "tab\tnew\nline\r", "\x00\x01\x1f\x7f",
         "é 日本 😀 \u2028\u2029", "\ufffd", "</s>",
         _MARKER, json.dumps(_MARKER), "{\"a\": [1, 2]}"]


def _chat_render(model: str):
    def render(i: int, c: CompletionOutput) -> str:
        return ChatCompletionResponse(
            id="chatcmpl-1", model=model, object="chat.completion.chunk", created=7,
            choices=[ChatChoice(index=i, delta=ChatMessageOut(content=c.text),
                                finish_reason=c.finish_reason, stop_reason=c.stop_reason)],
        ).model_dump_json(exclude={"choices": {"__all__": {"message"}}})
    return render


def _completion_render(model: str):
    def render(i: int, c: CompletionOutput) -> str:
        return CompletionResponse(id="cmpl-1", model=model, created=7, choices=[
            CompletionChoice(index=i, text=c.text, finish_reason=c.finish_reason,
                             stop_reason=c.stop_reason)]).model_dump_json()
    return render


# A served model name holding the marker must not move the text's place.
@pytest.mark.parametrize("model", ["m", f"weird-{_MARKER}", json.dumps(_MARKER)])
@pytest.mark.parametrize("make", [_chat_render, _completion_render])
def test_fast_chunks_equal_the_models_json(make, model):
    render = make(model)
    fast = with_text_fast_path(render)
    for index in (0, 3):
        for text in TEXTS:
            delta = CompletionOutput(index, text, [1, 2])
            assert fast(index, delta) == render(index, delta), text


def test_the_last_chunk_and_logprobs_go_through_the_model():
    calls = []

    def render(i: int, c: CompletionOutput) -> str:
        calls.append(c)
        return _chat_render("m")(i, c)

    fast = with_text_fast_path(render)
    fast(0, CompletionOutput(0, "a", [1]))
    fast(0, CompletionOutput(0, "b", [2]))
    assert len(calls) == 1  # the template, once
    last = CompletionOutput(0, "c", [3], finish_reason="stop", stop_reason=None)
    assert json.loads(fast(0, last))["choices"][0]["finish_reason"] == "stop"
    fast(0, CompletionOutput(0, "d", [4], logprobs=[{}]))
    assert calls[1:] == [last, CompletionOutput(0, "d", [4], logprobs=[{}])]
