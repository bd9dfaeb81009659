"""Constrained decoding through a grammar library (llguidance; docs/architecture.md says why).

A constraint (JSON schema, any JSON object, regex, choice, grammar) becomes the library's
grammar once per distinct constraint (cached here), each constrained sequence gets a
`GrammarMatcher`, and every step fills one next-token bitmask row per constrained sequence
(in the library's threads) and applies them to the logits in one batched operation.
Nothing else of the engine touches the library: four calls (compile, matcher, fill,
apply) and the matcher's `accept`, so another library could take its place here.

A bad constraint (invalid schema, a schema feature the library cannot handle, an invalid
regex, an unparsable grammar, an empty choice, two constraints at once) is a ValueError
naming the field and the library's reason.
"""

from __future__ import annotations

import copy
import json
import re
from collections import OrderedDict
from dataclasses import dataclass, fields
from typing import Any

import torch

from infer.loader.tokenizer import Tokenizer

GRAMMAR_CACHE_SIZE = 256


@dataclass(frozen=True)
class StructuredOutputsParams:
    """One constraint on a request's output, as vLLM spells it: exactly one field set.

    json: a JSON schema (dict or its JSON text; objects take only the properties they
    name unless they say `additionalProperties`); json_object: any JSON object;
    regex: the whole output matches it; choice: the output is one of the strings;
    grammar: a Lark grammar, or a GBNF-style EBNF one (rules with `::=`, start `root`).
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
            schema = _closed_objects(_parse_schema(self.json))
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


_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_VALUES = ("items", "additionalItems", "contains", "not", "if", "then", "else",
                  "propertyNames", "additionalProperties", "unevaluatedItems")


def _closed_objects(schema: Any) -> Any:
    """The schema with `additionalProperties: false` on every object schema that does not
    say otherwise: an object holds the properties it names and no others (what OpenAI's
    strict schemas mean, and what a model needs to finish an object). Literal values
    (enum, const, default) are left alone."""
    if isinstance(schema, list):
        return [_closed_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: _closed_objects(s) for name, s in value.items()}
        elif key in _SCHEMA_LISTS or key in _SCHEMA_VALUES:
            out[key] = _closed_objects(value)
        else:
            out[key] = value
    if (out.get("type") == "object" or "properties" in out) \
            and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


class GrammarMatcher:
    """Where one sequence stands in its grammar."""

    def __init__(self, matcher: Any) -> None:
        self._matcher = matcher

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token; False if the grammar does not allow it."""
        return self._matcher.consume_token(token_id)

    @property
    def terminated(self) -> bool:
        """The grammar is finished: it took the stop token, or allows nothing but it."""
        return self._matcher.is_stopped()


class StructuredOutputs:
    """The grammar library bound to one tokenizer and one logits width (`vocab_size`, the
    model's, which may exceed the tokenizer's: ids past the tokenizer's are never allowed).
    Masks are filled in the library's own threads, without the GIL."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        import llguidance
        import llguidance.gbnf_to_lark
        import llguidance.torch

        self._llg, self._llg_torch = llguidance, llguidance.torch
        backend = copy.copy(tokenizer.backend)  # the library reads its JSON, unpadded
        backend.no_padding()
        backend.no_truncation()
        self._tokenizer = llguidance.LLTokenizer(backend.to_str(), n_vocab=vocab_size,
                                                 eos_token=list(tokenizer.eos_token_ids))
        self._executor = llguidance.LLExecutor()
        self.vocab_size = vocab_size
        self._grammars: OrderedDict[tuple[str, str], str] = OrderedDict()

    def compile(self, params: StructuredOutputsParams) -> str:
        """The library's grammar for a constraint, checked against the vocabulary (the
        last GRAMMAR_CACHE_SIZE are kept); ValueError naming the field if it is not one."""
        key = params.key()
        grammar = self._grammars.get(key)
        if grammar is not None:
            self._grammars.move_to_end(key)
            return grammar
        kind, text = key
        matcher = self._llg.LLMatcher
        any_to_lark = self._llg.gbnf_to_lark.any_to_lark
        try:
            if kind in ("json", "json_object"):
                # No free whitespace between tokens: a small model can loop on it forever.
                grammar = matcher.grammar_from_json_schema(
                    text or '{"type": "object"}', defaults={"whitespace_flexible": False})
            elif kind == "regex":
                grammar = matcher.grammar_from_regex(text)
            elif kind == "choice":
                grammar = matcher.grammar_from_regex(
                    "|".join(re.escape(c) for c in json.loads(text)))
            else:  # Lark, or GBNF-style EBNF converted to Lark
                grammar = matcher.grammar_from_lark(any_to_lark(text))
            error = matcher.validate_grammar(grammar, self._tokenizer)
        except Exception as exc:
            error = str(exc).strip() or repr(exc)
        if error:
            raise ValueError(f"structured_outputs.{kind}: {error.splitlines()[0]}")
        self._grammars[key] = grammar
        if len(self._grammars) > GRAMMAR_CACHE_SIZE:
            self._grammars.popitem(last=False)
        return grammar

    def matcher(self, grammar: str) -> GrammarMatcher:
        matcher = self._llg.LLMatcher(self._tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"structured_outputs: {matcher.get_error()}")
        return GrammarMatcher(matcher)

    def allocate_masks(self, rows: int) -> torch.Tensor:
        """[rows, ceil(vocab / 32)] int32 bitmasks on the CPU: bit j of word i set means
        token 32 i + j is allowed."""
        return torch.zeros((rows, (self.vocab_size + 31) // 32), dtype=torch.int32)

    def fill_masks(self, matchers: list[GrammarMatcher], masks: torch.Tensor) -> None:
        """Row i of `masks` := the tokens `matchers[i]` allows next (in parallel)."""
        self._llg_torch.fill_next_token_bitmask_par(
            self._executor, [(m._matcher, row) for row, m in enumerate(matchers)], masks)

    def apply_masks(self, logits: torch.Tensor, masks: torch.Tensor,
                    rows: list[int] | None = None) -> None:
        """Disallowed tokens -> -inf, in place: mask row i on logits row i, for the rows
        in `rows` (default: every row; unconstrained rows are left out of `rows`), in one
        batched operation on whatever device the logits live."""
        index = torch.arange(len(masks)) if rows is None else torch.tensor(rows)
        index = index.to(logits.device)
        words = masks.to(logits.device, non_blocking=True)[index]
        bits = (words.unsqueeze(-1) >> _BIT_SHIFTS.to(logits.device)) & 1
        allowed = bits.reshape(len(index), -1)[:, :logits.shape[-1]].bool()
        logits[index] = logits[index].masked_fill(~allowed, float("-inf"))


_BIT_SHIFTS = torch.arange(32, dtype=torch.int32)
