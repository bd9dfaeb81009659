"""Tool calls in a model's text, in the formats the chat templates teach their models.

- `hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks, as the
  Qwen2.5 / Qwen3 / Hermes templates ask; text before the first block is the content.
- `llama3_json`: the whole message is one JSON object `{"name": ..., "parameters": {...}}`
  (or several joined by `;`), optionally after `<|python_tag|>`, as Llama 3.1 / 3.2 answer
  when tools are offered.

A parser never raises on what a model wrote: text that is not a well-formed call (bad
JSON, a missing name, arguments that are not an object) is returned whole as content with
no calls.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object's text, as OpenAI sends it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


@dataclass(frozen=True)
class ParsedMessage:
    content: str | None
    tool_calls: list[ToolCall]


_HERMES_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_PYTHON_TAG = "<|python_tag|>"


def _call(obj: object, arguments_key: str) -> ToolCall | None:
    """A call from a decoded JSON object, or None if it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    arguments = obj.get(arguments_key, obj.get("arguments", {}))
    if isinstance(arguments, str):  # some models write the arguments as JSON text
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(obj["name"], json.dumps(arguments, ensure_ascii=False))


def parse_hermes(text: str) -> ParsedMessage:
    blocks = list(_HERMES_BLOCK.finditer(text))
    if not blocks:
        return ParsedMessage(text, [])
    calls = []
    for block in blocks:
        try:
            call = _call(json.loads(block.group(1)), "arguments")
        except json.JSONDecodeError:
            call = None
        if call is None:
            return ParsedMessage(text, [])
        calls.append(call)
    # Only whitespace may sit between and after the blocks; anything else is not a call.
    rest = _HERMES_BLOCK.sub("", text[blocks[0].start():])
    if rest.strip():
        return ParsedMessage(text, [])
    content = text[:blocks[0].start()].strip()
    return ParsedMessage(content or None, calls)


def parse_llama3_json(text: str) -> ParsedMessage:
    body = text.strip()
    if body.startswith(_PYTHON_TAG):
        body = body[len(_PYTHON_TAG):].strip()
    if not body.startswith("{"):
        return ParsedMessage(text, [])
    decoder, calls, at = json.JSONDecoder(), [], 0
    while at < len(body):
        try:
            obj, end = decoder.raw_decode(body, at)
        except json.JSONDecodeError:
            return ParsedMessage(text, [])
        call = _call(obj, "parameters")
        if call is None:
            return ParsedMessage(text, [])
        calls.append(call)
        at = end
        while at < len(body) and body[at] in " \t\r\n;":
            at += 1
    return ParsedMessage(None, calls)


PARSERS = {"hermes": parse_hermes, "llama3_json": parse_llama3_json}
