"""StructuredOutputsParams: one constraint on a request's output (vLLM's spelling), and
the JSON-schema canonicalization that decides which constraints are the same. Plain data
and checks only; `engine/structured_output.py` turns it into masks."""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from typing import Any


@dataclass(frozen=True)
class StructuredOutputsParams:
    """One constraint on a request's output, as vLLM spells it: exactly one field set.

    json: a JSON schema (dict or its JSON text; objects take only the properties they
    name unless they say `additionalProperties`); json_object: any JSON object;
    regex: the whole output matches it; choice: the output is one of the strings;
    grammar: a Lark grammar, or a GBNF-style EBNF one (rules with `::=`, start `root`).

    reasoning_tags: (start, end), e.g. ("<think>", "</think>"): the output may open with a
    reasoning part between them, free text, and the constraint applies after it; an
    empty start: the output starts inside the reasoning part (its prompt opened it). A
    server sets this for a reasoning model; it is not a constraint of its own.
    """

    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    grammar: str | None = None
    reasoning_tags: tuple[str, str] | None = None

    def __post_init__(self) -> None:
        given = [name for name in KINDS if getattr(self, name) not in (None, False)]
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
        if self.reasoning_tags is not None:
            tags = tuple(self.reasoning_tags)
            if len(tags) != 2 or not all(isinstance(t, str) for t in tags) or not tags[1]:
                raise ValueError("structured_outputs.reasoning_tags must be two strings "
                                 "(start, end), end not empty")
            object.__setattr__(self, "reasoning_tags", tags)
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ValueError("structured_outputs.json must be a JSON schema: an object or "
                             "its JSON text")

    @property
    def kind(self) -> str:
        return next(name for name in KINDS if getattr(self, name) not in (None, False))

    @cached_property
    def key(self) -> tuple[str, str]:
        """(kind, canonical text) of the constraint itself: equal constraints share one
        compiled grammar (`reasoning_tags` wrap it and are keyed beside it). Computed once
        (the schema walk), however many sequences and sides look it up."""
        if self.json is not None:
            schema = closed_objects(_parse_schema(self.json))
            # key order kept: properties are generated in the order the schema lists them
            return "json", json.dumps(schema, separators=(",", ":"))
        if self.choice is not None:
            return "choice", json.dumps(list(self.choice))
        if self.json_object:
            return "json_object", ""
        return self.kind, self.regex if self.regex is not None else str(self.grammar)


# The constraint kinds: exactly one is set on a StructuredOutputsParams.
KINDS = ("json", "json_object", "regex", "choice", "grammar")


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


def closed_objects(schema: Any) -> Any:
    """The schema with `additionalProperties: false` on every object schema that does not
    say otherwise: an object holds the properties it names and no others (what OpenAI's
    strict schemas mean, and what a model needs to finish an object). Literal values
    (enum, const, default) are left alone."""
    if isinstance(schema, list):
        return [closed_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: closed_objects(s) for name, s in value.items()}
        elif key in _SCHEMA_LISTS or key in _SCHEMA_VALUES:
            out[key] = closed_objects(value)
        else:
            out[key] = value
    if (out.get("type") == "object" or "properties" in out) \
            and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out
