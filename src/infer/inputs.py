"""Prompt forms the offline API accepts, as vLLM spells them: a string, a list of token
ids, `{"prompt": str}` (TextPrompt) or `{"prompt_token_ids": [int, ...]}` (TokensPrompt,
which may carry the `"prompt"` text it was made from); and chat messages' content, a
string or a list of OpenAI content parts."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypedDict


class TextPrompt(TypedDict):
    prompt: str


class _TokenIds(TypedDict):
    prompt_token_ids: list[int]


class TokensPrompt(_TokenIds, total=False):
    prompt: str  # the text the ids were made from (RequestOutput.prompt)


PromptType = str | list[int] | TextPrompt | TokensPrompt


def parse_prompt(prompt: object) -> tuple[str | None, list[int] | None]:
    """(text, None), (None, token ids) or, for token ids with their text, (text, ids);
    anything else is refused naming its form."""
    if isinstance(prompt, str):
        return prompt, None
    if isinstance(prompt, dict):
        keys = set(prompt)
        if keys == {"prompt"} and isinstance(prompt["prompt"], str):
            return prompt["prompt"], None
        if keys in ({"prompt_token_ids"}, {"prompt_token_ids", "prompt"}) \
                and _token_ids(prompt["prompt_token_ids"]) \
                and isinstance(prompt.get("prompt", ""), str):
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        raise ValueError(
            f"a prompt dict must be {{'prompt': str}} or {{'prompt_token_ids': [int, ...]}}; "
            f"got one with keys {sorted(map(str, keys))}")
    if isinstance(prompt, (list, tuple)) and _token_ids(prompt):
        return None, list(prompt)
    raise ValueError(
        "a prompt must be a string, a list of token ids, {'prompt': str} or "
        f"{{'prompt_token_ids': [int, ...]}}; got {type(prompt).__name__}")


def is_single_prompt(prompts: object) -> bool:
    """Whether a list or tuple `prompts` is one prompt (token ids) rather than a list."""
    return bool(prompts) and _token_ids(prompts)


def _token_ids(value: object) -> bool:
    return isinstance(value, (list, tuple)) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value)


def text_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Chat messages with content given as OpenAI content parts made plain text (the
    parts' texts joined by newlines, as vLLM's "string" content format does). The models
    here read text only: any other part (image_url, input_audio, ...) is refused by name."""
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ValueError(f"messages[{i}] must be a dict with a role and content, got "
                             f"{type(message).__name__}")
        content = message.get("content")
        if isinstance(content, (list, tuple)):
            message = {**message, "content": "\n".join(
                _part_text(part, f"messages[{i}].content[{j}]")
                for j, part in enumerate(content))}
        out.append(dict(message))
    return out


def _part_text(part: object, where: str) -> str:
    if not isinstance(part, Mapping) or not isinstance(part.get("type"), str):
        raise ValueError(f"{where} must be a content part like {{'type': 'text', "
                         f"'text': '...'}}, got {part!r}")
    if part["type"] != "text":
        raise ValueError(f"{where}: content parts of type {part['type']!r} are not "
                         "supported (the models served here read text only)")
    if not isinstance(part.get("text"), str):
        raise ValueError(f"{where}: a text part needs a string 'text'")
    return part["text"]
