"""A chat request's way in and out beyond plain text: the template's inputs (messages,
tools, `chat_template_kwargs`), and the answer read back into OpenAI's message fields
(`reasoning_content`, `content`, `tool_calls`), whole or as a stream of deltas."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from infer.loader.tokenizer import Tokenizer
from infer.server.reasoning import (
    ReasoningStream,
    output_reasoning,
    reasoning_tags,
    split_reasoning,
)
from infer.server.tool_parsers import PARSERS, ToolCall, ToolCallDelta, ToolCallStream
from infer.server.tools import ToolCalling, template_messages, tool_format
from infer.structured_outputs import StructuredOutputsParams

# Template variables a request's chat_template_kwargs may not set: the server sets them.
_RESERVED = {"messages", "tools", "documents", "add_generation_prompt",
             "continue_final_message", "chat_template"}


@dataclass(frozen=True)
class ChatSetup:
    """How one chat request is rendered and its answer read."""

    messages: list[dict[str, Any]]
    tools: ToolCalling
    template_kwargs: dict[str, Any]
    reasoning_tags: tuple[str, str] | None
    template: str  # the one the rest was read from

    def render(self, tokenizer: Tokenizer, add_generation_prompt: bool,
               continue_final_message: bool) -> str:
        """The prompt text (in the tokenizer pool; ChatTemplateError on a bad chat)."""
        return tokenizer.apply_chat_template(
            self.messages, add_generation_prompt, chat_template=self.template,
            tools=self.tools.template_tools, continue_final_message=continue_final_message,
            **self.template_kwargs)

    def reasoning(self, prompt: str) -> str | None:
        """How the answer to `prompt` may reason (reasoning.output_reasoning), or None."""
        if self.reasoning_tags is None:
            return None
        return output_reasoning(prompt, self.reasoning_tags)

    def constraint_after_reasoning(self, constraint: StructuredOutputsParams,
                                   reasoning: str | None) -> StructuredOutputsParams:
        """The constraint, applied after the reasoning part where the answer has one."""
        if reasoning is None or self.reasoning_tags is None:
            return constraint
        start, end = self.reasoning_tags
        return dataclasses.replace(
            constraint, reasoning_tags=(start if reasoning == "optional" else "", end))


def chat_setup(messages: list[dict[str, Any]], tools: ToolCalling,
               template_kwargs: dict[str, Any] | None, template: str) -> ChatSetup:
    """ValueError (naming chat_template_kwargs) for a template variable the server owns."""
    kwargs = dict(template_kwargs or {})
    reserved = sorted(_RESERVED & set(kwargs))
    if reserved:
        raise ValueError(f"chat_template_kwargs cannot set {', '.join(reserved)}")
    shows_tools = tool_format(template) is not None
    return ChatSetup(template_messages(messages, tools, shows_tools), tools, kwargs,
                     reasoning_tags(template), template)


@dataclass
class MessageParts:
    reasoning: str | None
    content: str | None
    tool_calls: list[ToolCall]


def read_message(text: str, setup: ChatSetup, reasoning: str | None) -> MessageParts:
    """A whole answer's parts."""
    thought = None
    if reasoning is not None and setup.reasoning_tags is not None:
        thought, text = split_reasoning(text, setup.reasoning_tags, reasoning)
    if setup.tools.parser is None:
        return MessageParts(thought, text, [])
    parsed = PARSERS[setup.tools.parser](text)
    return MessageParts(thought, parsed.content, parsed.tool_calls)


class MessageStream:
    """One choice's answer as it streams, read into message deltas."""

    def __init__(self, setup: ChatSetup, reasoning: str | None) -> None:
        self._reasoning = None
        if reasoning is not None and setup.reasoning_tags is not None:
            self._reasoning = ReasoningStream(setup.reasoning_tags, reasoning)
        self._tools = ToolCallStream(setup.tools.parser) if setup.tools.parser else None

    @property
    def called(self) -> bool:
        return self._tools is not None and self._tools.called

    def feed(self, text: str, last: bool) -> tuple[str, str, list[ToolCallDelta]]:
        """(reasoning, content, tool-call deltas) from the next text; `last`: it ends."""
        thought = ""
        if self._reasoning is not None:
            thought, text = self._reasoning.feed(text)
            if last:
                more_thought, more_text = self._reasoning.finish()
                thought, text = thought + more_thought, text + more_text
        if self._tools is None:
            return thought, text, []
        content, deltas = self._tools.feed(text)
        if last:
            more_content, more_deltas = self._tools.finish()
            content, deltas = content + more_content, deltas + more_deltas
        return thought, content, _merged(deltas)


def _merged(deltas: list[ToolCallDelta]) -> list[ToolCallDelta]:
    """Deltas of one call in one chunk made one (its header with its first arguments)."""
    out: list[ToolCallDelta] = []
    for delta in deltas:
        if out and out[-1].index == delta.index and delta.id is None:
            out[-1] = dataclasses.replace(out[-1], arguments=out[-1].arguments + delta.arguments)
        else:
            out.append(delta)
    return out
