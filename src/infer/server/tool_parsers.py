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


# -- streaming ------------------------------------------------------------------------
@dataclass
class ToolCallDelta:
    """A piece of a streamed call, as OpenAI streams it: the first piece of each call has
    its id and name (arguments ""), later ones append to its arguments."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"'
                     r'\s*:\s*(?=\S)')
_TOOL_CALL_OPEN, _TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"


def tag_start_at_end(text: str, tag: str) -> int:
    """Length of the longest end of `text` that could be the start of `tag` (what a
    stream holds back until the next piece tells)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


class _CallScanner:
    """One call's JSON object as it arrives: once `{"name": ..., "arguments": ` is read its
    header goes out, then the arguments object in fragments as far as it is read (braces
    counted outside strings, so the object's end is known exactly)."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.text = ""
        self.header_sent = False
        self.closed = False  # the whole call object has been read
        self._args_at: int | None = None  # where the arguments object starts in text
        self._sent_to = 0  # arguments sent up to here
        self._depth = 0
        self._in_string = self._escaped = False
        self._args_end: int | None = None

    def feed(self, text: str) -> tuple[list[ToolCallDelta], str]:
        """Deltas from `text`, and what follows the object once it closed."""
        start = len(self.text)
        self.text += text
        rest = ""
        for at in range(start, len(self.text)):
            char = self.text[at]
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == '"':
                    self._in_string = False
            elif char == '"':
                self._in_string = True
            elif char in "{[":
                self._depth += 1
            elif char in "}]":
                self._depth -= 1
                if self._depth == 1 and self._args_at is not None and self._args_end is None:
                    self._args_end = at + 1
                if self._depth <= 0:
                    self.closed = True
                    rest, self.text = self.text[at + 1:], self.text[:at + 1]
                    break
        deltas = []
        if not self.header_sent:
            match = _HEADER.match(self.text)
            name = _json_string(match.group(1)) if match else None
            if name and self.text[match.end()] == "{":
                self.header_sent = True
                self._args_at = self._sent_to = match.end()
                deltas.append(ToolCallDelta(self.index, f"call_{uuid.uuid4().hex[:24]}", name))
                if self._args_end is None:  # rescan: the arguments' end may be read already
                    self._args_end = _object_end(self.text, self._args_at)
        if self.header_sent:
            end = self._args_end if self._args_end is not None else len(self.text)
            if end > self._sent_to:
                deltas.append(ToolCallDelta(self.index, arguments=self.text[self._sent_to:end]))
                self._sent_to = end
        return deltas, rest

    def whole(self) -> ToolCall | None:
        """The call, parsed whole (for one whose header never matched)."""
        try:
            return _call(json.loads(self.text), "parameters")
        except json.JSONDecodeError:
            return None


def _json_string(body: str) -> str | None:
    """A JSON string's value from the text between its quotes; None if not valid JSON."""
    try:
        return json.loads(f'"{body}"')
    except json.JSONDecodeError:
        return None


def _object_end(text: str, at: int) -> int | None:
    """End of the JSON object starting at text[at] if it is complete in `text`."""
    try:
        _, end = json.JSONDecoder().raw_decode(text, at)
    except json.JSONDecodeError:
        return None
    return end


class ToolCallStream:
    """One choice's text, streamed, split into content and tool-call deltas in the format of
    `parser` ("hermes" or "llama3_json"). A call goes out as its header (id, name) as soon as
    both are read, then its arguments in fragments; a call that is not well formed (its
    header never read) goes out as content, or as a whole call if it parses at its end.
    `called`: some call went out (finish_reason "tool_calls")."""

    def __init__(self, parser: str) -> None:
        if parser not in PARSERS:
            raise ValueError(f"unknown tool call parser {parser!r}")
        self.parser = parser
        self.called = False
        self._pending = ""  # text not yet placed
        self._call: _CallScanner | None = None
        self._block = ""  # hermes: the open block's text so far
        self._fed = 0  # hermes: how much of _block the scanner has read
        self._count = 0
        self._mode = "start"  # llama3_json: start | calls | content
        self._lead = ""  # llama3_json: what came before the first call's brace

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        content: list[str] = []
        deltas: list[ToolCallDelta] = []
        if self.parser == "hermes":
            self._hermes(text, content, deltas)
        else:
            self._llama3(text, content, deltas)
        self.called = self.called or bool(deltas)
        return "".join(content), deltas

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """What is left when the text ends. A call cut short keeps what went out; one whose
        header never went out is content."""
        call, pending = self._call, self._pending
        self._call, self._pending = None, ""
        if call is None:
            return ("" if self.called and not pending.strip() else pending), []
        if call.header_sent:
            return "", []
        if self.parser == "hermes":
            return _TOOL_CALL_OPEN + self._block, []
        return self._lead + call.text, []

    def _end_call(self, call: _CallScanner, raw: str, content: list[str],
                  deltas: list[ToolCallDelta]) -> None:
        """A call whose text is complete: counted if its header went out, else parsed
        whole (a call it is, or `raw` is content)."""
        self._call = None
        if not call.header_sent:
            whole = call.whole()
            if whole is None:
                content.append(raw)
                return
            deltas += [ToolCallDelta(call.index, whole.id, whole.name),
                       ToolCallDelta(call.index, arguments=whole.arguments)]
        self._count += 1

    def _hermes(self, text: str, content: list[str], deltas: list[ToolCallDelta]) -> None:
        if self._call is None:
            text = self._pending + text
            self._pending = ""
        while text:
            if self._call is None:
                at = text.find(_TOOL_CALL_OPEN)
                if at < 0:
                    # held back: a tag's possible start, and whitespace that goes if a
                    # call follows (as parse_hermes strips it)
                    cut = len(text) - tag_start_at_end(text, _TOOL_CALL_OPEN)
                    cut = len(text[:cut].rstrip())
                    content.append(text[:cut])
                    self._pending = text[cut:]
                    return
                content.append(text[:at].rstrip())
                text = text[at + len(_TOOL_CALL_OPEN):]
                self._call, self._block, self._fed = _CallScanner(self._count), "", 0
                continue
            self._block += text
            close = self._block.find(_TOOL_CALL_CLOSE)
            safe = close if close >= 0 else \
                len(self._block) - tag_start_at_end(self._block, _TOOL_CALL_CLOSE)
            if safe > self._fed and not self._call.closed:
                deltas += self._call.feed(self._block[self._fed:safe])[0]
            self._fed = max(self._fed, safe)
            if close < 0:
                return
            text = self._block[close + len(_TOOL_CALL_CLOSE):]
            raw = _TOOL_CALL_OPEN + self._block[:close] + _TOOL_CALL_CLOSE
            self._end_call(self._call, raw, content, deltas)

    def _llama3(self, text: str, content: list[str], deltas: list[ToolCallDelta]) -> None:
        if self._mode == "content":
            content.append(text)
            return
        text = self._pending + text
        self._pending = ""
        while text:
            if self._call is not None:
                new, text = self._call.feed(text)
                deltas += new
                if not self._call.closed:
                    return
                self._end_call(self._call, self._lead + self._call.text, content, deltas)
                self._lead = ""
                continue
            if self._mode == "start":
                body = text.lstrip()
                if _PYTHON_TAG.startswith(body):
                    self._pending = text  # may still become the tag
                    return
                if body.startswith(_PYTHON_TAG):
                    body = body[len(_PYTHON_TAG):].lstrip()
                if body and body[0] != "{":  # not a call: the whole message is content
                    self._mode = "content"
                    content.append(text)
                    return
            else:  # between calls: separators, or text that ends the calls
                body = text.lstrip(" \t\r\n;")
                if body and body[0] != "{":
                    self._mode = "content"
                    content.append(body)
                    return
            if not body:
                self._pending = text if self._mode == "start" else ""
                return
            if self._mode == "start":
                self._lead = text[:len(text) - len(body)]
            self._mode = "calls"
            self._call = _CallScanner(self._count)
            text = body
