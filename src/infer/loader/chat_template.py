"""Chat templates: Jinja2 rendered the way transformers renders them.

Templates come from model files and are untrusted code: they run in jinja2's immutable
sandbox, see only plain JSON-like data (`_plain`), and get a `dict` and `namespace` that
cannot reach Python internals. The environment (trim_blocks, lstrip_blocks, loop controls,
the `{% generation %}` tag, `raise_exception`, `strftime_now`, a non-escaping `tojson`) is
transformers', so a template renders to the same text.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import numpy as np
from jinja2.sandbox import ImmutableSandboxedEnvironment

Message = Mapping[str, Any]

# Names a message's reasoning may come under; templates read the first (gpt-oss: `thinking`).
_REASONING = ("reasoning_content", "thinking", "reasoning")
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
_TEMPLATE_RUNTIME_ERRORS = (TypeError, ValueError, KeyError, IndexError, AttributeError,
                            ZeroDivisionError, OverflowError)


class ChatTemplateError(ValueError):
    """A chat template that fails to compile or render (including its `raise_exception`)."""


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks;
    rendering only needs the body."""

    tags = frozenset({"generation"})

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_body")
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # jinja2's own filter HTML-escapes and cannot take these options
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _Dict:
    """`dict(...)` for templates, without exposing the `dict` type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """jinja2's namespace, refusing underscore names (a path to CPython internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # jinja2's trick: `self` may be a key
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot set underscore attributes on a namespace ({name!r})"
            )


@lru_cache(maxsize=1)
def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _Dict()
    env.globals["namespace"] = _Namespace
    return env


@lru_cache(maxsize=32)
def compile_template(template: str) -> jinja2.Template:
    """The compiled template (cached: each distinct template text compiles once)."""
    try:
        return _environment().from_string(template)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"chat template has a syntax error (line {exc.lineno}): "
                                f"{exc.message}") from None


def _plain(value: Any) -> Any:
    """A copy of `value` built from JSON-like types only; anything else becomes an inert
    "<TypeName>" placeholder, so no rich object's methods are reachable from a template."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):  # pydantic models
        return _plain(value.model_dump())
    if isinstance(value, np.generic):  # np.bool_(False) must not become a truthy string
        return _plain(value.item())
    return f"<{type(value).__name__}>"


def _prepare_messages(messages: Sequence[Any]) -> list[dict[str, Any]]:
    """Plain copies of the messages, keys whose value is None dropped (APIs send
    `content: null`; templates handle a missing key, not a None), reasoning aliased."""
    out = []
    for message in messages:
        message = _plain(message)
        if not isinstance(message, dict):
            raise ChatTemplateError(f"a chat message must be a mapping, got {message!r}")
        message = {k: v for k, v in message.items() if v is not None}
        reasoning = next((message[k] for k in _REASONING if k in message), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def render_chat_template(
    template: str,
    messages: Sequence[Message],
    *,
    add_generation_prompt: bool = False,
    continue_final_message: bool = False,
    special_tokens: Mapping[str, str] | None = None,
    tools: list[dict[str, Any]] | None = None,
    documents: list[dict[str, Any]] | None = None,
    **kwargs: Any,
) -> str:
    """Render `messages` with `template`, as transformers' `apply_chat_template(...,
    tokenize=False)` does: `special_tokens` (bos_token, eos_token, ...) and `kwargs` are
    template variables (kwargs win), as are `messages`, `tools`, `documents` and
    `add_generation_prompt`. `continue_final_message` leaves the last message open so the
    model continues it."""
    if not messages:
        raise ChatTemplateError("cannot apply a chat template to an empty conversation")
    if continue_final_message and add_generation_prompt:
        raise ChatTemplateError(
            "continue_final_message and add_generation_prompt cannot both be set"
        )
    compiled = compile_template(template)
    chat = _prepare_messages(messages)
    final = None
    if continue_final_message:
        final = chat[-1].get("content")
        if not isinstance(final, str):
            raise ChatTemplateError(
                "continue_final_message needs a final message with text content"
            )
        chat[-1]["content"] = final + _CONTINUE_TAG
    variables = {**_plain(dict(special_tokens or {})), **_plain(kwargs)}
    try:
        text = compiled.render(
            messages=chat,
            tools=_plain(tools),
            documents=_plain(documents),
            add_generation_prompt=add_generation_prompt,
            **variables,
        )
    except jinja2.exceptions.TemplateError as exc:
        raise ChatTemplateError(f"chat template error: {exc.message or exc}") from None
    except _TEMPLATE_RUNTIME_ERRORS as exc:  # Python errors raised by template expressions
        raise ChatTemplateError(f"chat template failed: {type(exc).__name__}: {exc}") from None
    if final is not None:
        tag = _CONTINUE_TAG.strip()
        if final.strip() not in text or tag not in text:
            raise ChatTemplateError(
                "continue_final_message: the template does not render the final message as given"
            )
        at = text.rindex(tag)
        # a template that keeps spacing renders the tag whole; one that trims it does not
        whole = text[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG
        text = text[:at] if whole else text[:at].rstrip()
    return text
