"""Constrained decoding through a grammar library (xgrammar; docs/architecture.md says why).

A constraint (JSON schema, any JSON object, regex, choice, EBNF grammar) is compiled once
per distinct constraint (the library caches compiled grammars), each constrained sequence
gets a `GrammarMatcher`, and every step fills one next-token bitmask row per constrained
sequence and applies them to the logits in one batched operation. Nothing else of the
engine touches the library: four calls (compile, matcher, fill, apply) and the matcher's
`accept`, so another library could take its place here.

A bad constraint (invalid schema, a schema feature the library cannot handle, an invalid
regex, an unparsable grammar, an empty choice, two constraints at once) is a ValueError
naming the field and the library's reason.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

import torch

from infer.loader.tokenizer import Tokenizer


@dataclass(frozen=True)
class StructuredOutputsParams:
    """One constraint on a request's output, as vLLM spells it: exactly one field set.

    json: a JSON schema (dict or its JSON text); json_object: any JSON object;
    regex: the whole output matches it; choice: the output is one of the strings;
    grammar: an EBNF grammar (xgrammar's dialect, GBNF-like, start rule `root`).
    """

    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        given = [f.name for f in fields(self) if getattr(self, f.name) not in (None, False)]
        if len(given) != 1:
            raise ValueError("structured_outputs takes exactly one of json, json_object, "
                             f"regex, choice, grammar; got {', '.join(given) or 'none'}")
        if self.choice is not None:
            if isinstance(self.choice, str) or not self.choice or not all(
                    isinstance(c, str) and c for c in self.choice):
                raise ValueError("structured_outputs.choice must be a non-empty list of "
                                 "non-empty strings")
            object.__setattr__(self, "choice", tuple(self.choice))
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ValueError("structured_outputs.json must be a JSON schema: an object or "
                             "its JSON text")

    @property
    def kind(self) -> str:
        return next(f.name for f in fields(self) if getattr(self, f.name) not in (None, False))

    def key(self) -> tuple[str, str]:
        """(kind, canonical text): equal constraints share one compiled grammar."""
        if self.json is not None:
            schema = _parse_schema(self.json)
            return "json", json.dumps(schema, sort_keys=True, separators=(",", ":"))
        if self.choice is not None:
            return "choice", json.dumps(list(self.choice))
        if self.json_object:
            return "json_object", ""
        return self.kind, self.regex if self.regex is not None else str(self.grammar)


def _parse_schema(schema: dict[str, Any] | str) -> dict[str, Any]:
    if isinstance(schema, dict):
        return schema
    try:
        parsed = json.loads(schema)
    except json.JSONDecodeError as exc:
        raise ValueError(f"structured_outputs.json is not valid JSON: {exc}") from None
    if not isinstance(parsed, dict):
        raise ValueError("structured_outputs.json must be a JSON schema object")
    return parsed


class GrammarMatcher:
    """Where one sequence stands in its grammar."""

    def __init__(self, matcher: Any) -> None:
        self._matcher = matcher

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token; False if the grammar does not allow it."""
        return self._matcher.accept_token(token_id)

    @property
    def terminated(self) -> bool:
        """The grammar has accepted a stop token: nothing more may follow."""
        return self._matcher.is_terminated()


class StructuredOutputs:
    """The grammar library bound to one tokenizer and one logits width (`vocab_size`, the
    model's, which may exceed the tokenizer's: ids past the tokenizer's are never allowed)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        import xgrammar
        from transformers import PreTrainedTokenizerFast

        self._xg = xgrammar
        # The library reads the vocabulary (and how its tokens decode to bytes) through
        # transformers' wrapper around our `tokenizers` backend.
        hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend,
                                     eos_token=tokenizer.eos_token)
        self.info = xgrammar.TokenizerInfo.from_huggingface(
            hf, vocab_size=vocab_size, stop_token_ids=list(tokenizer.eos_token_ids))
        self.vocab_size = vocab_size
        self._compiler = xgrammar.GrammarCompiler(self.info)

    def compile(self, params: StructuredOutputsParams) -> Any:
        """The compiled grammar of a constraint (cached); ValueError if it is not one."""
        kind, text = params.key()
        compiler = self._compiler
        try:
            if kind == "json":
                return compiler.compile_json_schema(text, any_whitespace=False)
            if kind == "json_object":  # an object, as OpenAI's json_object promises
                return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if kind == "regex":
                return compiler.compile_regex(text)
            if kind == "choice":
                alternatives = " | ".join(json.dumps(c) for c in json.loads(text))
                return compiler.compile_grammar(f"root ::= {alternatives}")
            return compiler.compile_grammar(text)
        except Exception as exc:
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)
            raise ValueError(f"structured_outputs.{kind}: {reason}") from None

    def matcher(self, compiled: Any) -> GrammarMatcher:
        return GrammarMatcher(self._xg.GrammarMatcher(compiled))

    def allocate_masks(self, rows: int) -> torch.Tensor:
        """[rows, ceil(vocab / 32)] int32 bitmasks (bit set: token allowed), on the CPU."""
        return self._xg.allocate_token_bitmask(rows, self.vocab_size)

    def fill_masks(self, matchers: list[GrammarMatcher], masks: torch.Tensor) -> None:
        """Row i of `masks` := the tokens `matchers[i]` allows next."""
        for row, matcher in enumerate(matchers):
            matcher._matcher.fill_next_token_bitmask(masks, row)

    def apply_masks(self, logits: torch.Tensor, masks: torch.Tensor,
                    rows: list[int] | None = None) -> None:
        """Disallowed tokens -> -inf, in place: mask row i on logits row i, for the rows
        in `rows` (default: every row; unconstrained rows are left out of `rows`), on
        whatever device the logits live."""
        masks = masks.to(logits.device, non_blocking=True)
        self._xg.apply_token_bitmask_inplace(logits, masks, vocab_size=self.vocab_size,
                                             indices=rows)
