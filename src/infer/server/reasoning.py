"""Reasoning content: the `<think>...</think>` part a reasoning model (Qwen3, DeepSeek-R1
style) writes before its answer, sent apart as `reasoning_content`.

A template that writes `</think>` marks a reasoning model. Where the output starts is read
from the rendered prompt: a prompt that ends inside an open `<think>` (the template opened
it) starts the output in reasoning; one that ends with `</think>` (Qwen3 with
`enable_thinking: false`) has none; otherwise the output reasons only if it opens with
`<think>`. An output cut short inside its reasoning is all reasoning.
"""

from __future__ import annotations

from infer.server.tool_parsers import tag_start_at_end

THINK_TAGS = ("<think>", "</think>")


def reasoning_tags(template: str) -> tuple[str, str] | None:
    """The tags of the template's reasoning part, or None for a model that does not reason."""
    return THINK_TAGS if THINK_TAGS[1] in template else None


def output_reasoning(prompt: str, tags: tuple[str, str]) -> str | None:
    """How the output to `prompt` may reason: "open" (it starts in reasoning), "optional"
    (it may open with the start tag), or None (the prompt closed it: no reasoning)."""
    start, end = tags
    tail = prompt.rstrip()
    if tail.endswith(end):
        return None
    return "open" if tail.endswith(start) else "optional"


class ReasoningStream:
    """One choice's text, as it streams, split into (reasoning, content) pieces."""

    def __init__(self, tags: tuple[str, str], mode: str) -> None:
        self.start, self.end = tags
        # undecided -> reasoning -> after (whitespace after the end tag) -> content
        self._state = "reasoning" if mode == "open" else "undecided"
        self._held = ""
        self.reasoned = mode == "open"  # the output has a reasoning part

    def feed(self, text: str) -> tuple[str, str]:
        reasoning: list[str] = []
        content: list[str] = []
        text = self._held + text
        self._held = ""
        while text:
            if self._state == "undecided":
                opening = text.lstrip()
                if self.start.startswith(opening):  # may still become the start tag
                    self._held = text
                    break
                if opening.startswith(self.start):
                    self._state, text = "reasoning", opening[len(self.start):]
                    self.reasoned = True
                else:
                    self._state = "content"
            elif self._state == "reasoning":
                at = text.find(self.end)
                if at >= 0:
                    reasoning.append(text[:at])
                    self._state, text = "after", text[at + len(self.end):]
                    continue
                cut = len(text) - tag_start_at_end(text, self.end)
                reasoning.append(text[:cut])
                self._held = text[cut:]
                break
            elif self._state == "after":
                text = text.lstrip()
                if text:
                    self._state = "content"
            else:
                content.append(text)
                break
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        held, self._held = self._held, ""
        if self._state == "reasoning":
            return held, ""
        return "", held


def split_reasoning(text: str, tags: tuple[str, str], mode: str) -> tuple[str | None, str]:
    """A whole output's (reasoning or None, content)."""
    stream = ReasoningStream(tags, mode)
    reasoning, content = stream.feed(text)
    more_reasoning, more_content = stream.finish()
    return (reasoning + more_reasoning if stream.reasoned else None), content + more_content
