"""Prompt forms the offline API accepts, as vLLM spells them: a string, a list of token
ids, `{"prompt": str}` (TextPrompt) or `{"prompt_token_ids": [int, ...]}` (TokensPrompt)."""

from __future__ import annotations

from typing import TypedDict


class TextPrompt(TypedDict):
    prompt: str


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]


PromptType = str | list[int] | TextPrompt | TokensPrompt


def parse_prompt(prompt: object) -> tuple[str | None, list[int] | None]:
    """(text, None) or (None, token ids); anything else is refused naming its form."""
    if isinstance(prompt, str):
        return prompt, None
    if isinstance(prompt, dict):
        keys = set(prompt)
        if keys == {"prompt"} and isinstance(prompt["prompt"], str):
            return prompt["prompt"], None
        if keys == {"prompt_token_ids"} and _token_ids(prompt["prompt_token_ids"]):
            return None, list(prompt["prompt_token_ids"])
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
