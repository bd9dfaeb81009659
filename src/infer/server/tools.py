"""Tool calling in a chat request: the tools checked, how the model is shown them, how its
answer is read, and the grammar that makes `tool_choice` "required" or a named function a
valid call.

The chat template decides the format. One that writes `<tool_call>` (Qwen2.5, Qwen3,
Hermes) is answered in Hermes blocks; one that writes `<|python_tag|>` or Llama 3's
`"parameters"` in JSON calls. A template that does not show tools at all (SmolLM2's,
Gemma's) gets them in a system message of ours, with Hermes-style instructions, and its
calls and tool results in the history are written as text in that format, so any chat
model can be offered tools.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from infer.structured_outputs import StructuredOutputsParams, closed_objects

_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for a function's name
_NO_PARAMETERS = {"type": "object", "properties": {}}


class ToolError(ValueError):
    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ToolCalling:
    """What a chat request's tools come to.

    template_tools: the tools for the chat template (None: it shows none);
    system_prompt: our own tool instructions to put first (a template that shows no tools);
    parser: how the answer is read ("hermes", "llama3_json"; None: not at all);
    constraint: the grammar for "required" or a named function (None: the model chooses).
    """

    template_tools: list[dict[str, Any]] | None = None
    system_prompt: str | None = None
    parser: str | None = None
    constraint: StructuredOutputsParams | None = None


def tool_format(template: str) -> str | None:
    """The tool-call format a chat template teaches, or None if it shows no tools."""
    if "<tool_call>" in template:
        return "hermes"
    if "<|python_tag|>" in template or ('"parameters"' in template and "ipython" in template):
        return "llama3_json"
    return None


def tool_calling(tools: list[dict[str, Any]] | None, tool_choice: str | dict[str, Any] | None,
                 parallel_tool_calls: bool | None, template: str) -> ToolCalling:
    """The request's `tools`, `tool_choice` and `parallel_tool_calls` checked against each
    other (a ToolError names the field at fault) and planned for `template`."""
    functions = _functions(tools)
    choice = _choice(tool_choice, functions)
    if choice == "none":
        return ToolCalling()
    native = tool_format(template)
    parser = native or "hermes"
    constraint = None
    if choice != "auto":
        chosen = functions if choice == "required" else {choice: functions[choice]}
        several = choice == "required" and parallel_tool_calls is not False
        constraint = StructuredOutputsParams(grammar=_call_grammar(chosen, parser, several))
    plain = [{"type": "function", "function": f} for f in functions.values()]
    if native:
        return ToolCalling(template_tools=plain, parser=parser, constraint=constraint)
    return ToolCalling(system_prompt=_system_prompt(plain), parser=parser,
                       constraint=constraint)


def _functions(tools: list[dict[str, Any]] | None) -> dict[str, dict[str, Any]]:
    functions: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools or []):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise ToolError(f"{where}: only tools of type 'function' are supported", "tools")
        function = tool.get("function")
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ToolError(f"{where}.function needs a name", "tools")
        name = function["name"]
        if not _NAME.fullmatch(name):
            raise ToolError(f"{where}.function.name must be 1-64 letters, digits, _ or -; "
                            f"got {name!r}", "tools")
        if name in functions:
            raise ToolError(f"{where}: a second function named {name!r}", "tools")
        parameters = function.get("parameters", _NO_PARAMETERS)
        if not isinstance(parameters, dict):
            raise ToolError(f"{where}.function.parameters must be a JSON schema object",
                            "tools")
        functions[name] = {**function, "parameters": parameters}
    return functions


def _choice(tool_choice: str | dict[str, Any] | None,
            functions: dict[str, dict[str, Any]]) -> str:
    """"none", "auto", "required" or the name of the function that must be called."""
    if tool_choice is None:
        return "auto" if functions else "none"
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise ToolError("tool_choice must be none, auto, required or "
                            '{"type": "function", "function": {"name": ...}}', "tool_choice")
        if tool_choice == "auto" and not functions:
            return "none"
        name = tool_choice
    else:
        function = tool_choice.get("function")
        if tool_choice.get("type") != "function" or not isinstance(function, dict) \
                or not isinstance(function.get("name"), str):
            raise ToolError('a named tool_choice is {"type": "function", "function": '
                            '{"name": ...}}', "tool_choice")
        name = function["name"]
        if functions and name not in functions:
            raise ToolError(f"tool_choice names {name!r}, which is not among the tools "
                            f"({', '.join(functions)})", "tool_choice")
    if name != "none" and not functions:
        raise ToolError(f"tool_choice {name!r} needs tools", "tool_choice")
    return name


def _call_grammar(functions: dict[str, dict[str, Any]], parser: str, several: bool) -> str:
    """A Lark grammar (the grammar library's, with JSON schemas inline) whose every
    sentence is one call, or several, of `functions` in the parser's format."""
    key = "arguments" if parser == "hermes" else "parameters"
    calls = [{"type": "object",
              "properties": {"name": {"const": name}, key: f["parameters"]},
              "required": ["name", key]} for name, f in functions.items()]
    schema = {"anyOf": calls, "x-guidance": {"whitespace_flexible": False}}
    if parser == "hermes":
        call = 'call: "<tool_call>\\n" body "\\n</tool_call>"'
        separator = '"\\n"'
    else:
        call = "call: body"
        separator = '"; "'
    # At most one call per function offered: a model too weak to stop would otherwise
    # repeat calls until max_tokens.
    most = len(functions) if several else 1
    start = "start: call" + "".join(f" ({separator} call" for _ in range(most - 1)) \
        + ")?" * (most - 1)
    return "\n".join(["%llguidance {}", start, call,
                      f"body: %json {json.dumps(closed_objects(schema))}", ""])


def _system_prompt(tools: list[dict[str, Any]]) -> str:
    listed = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools)
    return ("You can call functions. Their signatures, as JSON schemas, are within "
            f"<tools></tools>:\n<tools>\n{listed}\n</tools>\n"
            "To call functions, answer with one block per call and nothing else:\n"
            '<tool_call>\n{"name": <function name>, "arguments": <arguments object>}\n'
            "</tool_call>\nOtherwise answer in plain text.")


def template_messages(messages: list[dict[str, Any]], plan: ToolCalling,
                      shows_tools: bool) -> list[dict[str, Any]]:
    """The chat as the template takes it: assistant calls' arguments as objects (templates
    write them with `tojson`); for a template that shows no tools (`shows_tools` False),
    our instructions first and past calls and results as Hermes text."""
    out = []
    for message in messages:
        message = dict(message)
        calls = message.get("tool_calls")
        if calls:
            message["tool_calls"] = [_with_object_arguments(c) for c in calls]
        if not shows_tools:
            message = _as_text(message)
        out.append(message)
    if plan.system_prompt is not None:
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{plan.system_prompt}"}
        else:
            out.insert(0, {"role": "system", "content": plan.system_prompt})
    return out


def _with_object_arguments(call: Any) -> Any:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except json.JSONDecodeError:
        return call  # left as the client wrote it
    return {**call, "function": {**function, "arguments": arguments}}


def _as_text(message: dict[str, Any]) -> dict[str, Any]:
    """A tool-call or tool-result message in Hermes text, for a template that shows no
    tools."""
    if message.get("role") == "tool":
        return {"role": "user",
                "content": f"<tool_response>\n{message.get('content', '')}\n</tool_response>"}
    calls = message.pop("tool_calls", None)
    if not calls:
        return message
    blocks = []
    for call in calls:
        function = call.get("function", {}) if isinstance(call, dict) else {}
        blocks.append("<tool_call>\n" + json.dumps(
            {"name": function.get("name"), "arguments": function.get("arguments", {})},
            ensure_ascii=False) + "\n</tool_call>")
    text = message.get("content") or ""
    return {**message, "content": "\n".join(([text] if text else []) + blocks)}
