"""The output constraint a request asks for, in any of the spellings clients send.

OpenAI: `response_format` `{"type": "json_object"}` or `{"type": "json_schema",
"json_schema": {"name", "schema", "strict"}}`. vLLM: `structured_outputs: {json | regex |
choice | grammar | json_object}`, and the older `guided_json`, `guided_regex`,
`guided_choice`, `guided_grammar`. At most one may be set; each becomes one
`StructuredOutputsParams`, and a mistake is a 400 naming the field that carried it.
"""

from __future__ import annotations

from typing import Any

from infer.structured_outputs import KINDS, StructuredOutputsParams

GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
          "guided_grammar": "grammar"}


class ConstraintError(ValueError):
    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def output_constraint(fields: dict[str, Any]) -> tuple[StructuredOutputsParams, str] | None:
    """From a request's fields (those named above; None = not set): the constraint and the
    field that set it, or None."""
    found: list[tuple[StructuredOutputsParams, str]] = []
    if fields.get("response_format") is not None:
        params = _response_format(fields["response_format"])
        if params is not None:
            found.append((params, "response_format"))
    if fields.get("structured_outputs") is not None:
        found.append((_structured_outputs(fields["structured_outputs"]), "structured_outputs"))
    for name, kind in GUIDED.items():
        if fields.get(name) is not None:
            found.append((_params(name, **{kind: fields[name]}), name))
    if len(found) > 1:
        raise ConstraintError("only one output constraint may be set; got "
                              + ", ".join(name for _, name in found), found[1][1])
    return found[0] if found else None


def _params(field: str, **kwargs: Any) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**kwargs)
    except ValueError as exc:
        raise ConstraintError(f"{field}: {exc}", field) from None


def _response_format(spec: Any) -> StructuredOutputsParams | None:
    field = "response_format"
    kind = spec.get("type") if isinstance(spec, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return _params(field, json_object=True)
    if kind != "json_schema":
        raise ConstraintError("response_format.type must be text, json_object or json_schema; "
                              f"got {kind!r}", field)
    schema = spec.get("json_schema")
    if not isinstance(schema, dict) or not isinstance(schema.get("schema"), dict):
        raise ConstraintError("response_format json_schema needs json_schema.schema, a JSON "
                              "schema object", field)
    return _params(field, json=schema["schema"])


def _structured_outputs(spec: Any) -> StructuredOutputsParams:
    field = "structured_outputs"
    if not isinstance(spec, dict):
        raise ConstraintError("structured_outputs must be an object with one of "
                              + ", ".join(KINDS), field)
    unknown = sorted(set(spec) - set(KINDS))
    if unknown:
        raise ConstraintError(f"structured_outputs: unsupported key(s) {', '.join(unknown)}; "
                              f"this server takes {', '.join(KINDS)}", field)
    return _params(field, **{k: v for k, v in spec.items() if v is not None})
