"""The OpenAPI schema as the server answers: the OpenAI error body on every status a route
can return, 400 (never FastAPI's 422) for invalid requests, and the non-JSON bodies."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict

from infer.server.protocol import ChatCompletionResponse, CompletionResponse

PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"


class ErrorDetail(BaseModel):
    model_config = ConfigDict(extra="forbid")
    message: str
    type: str
    param: str | None
    code: str | int | None


class ErrorResponse(BaseModel):
    model_config = ConfigDict(extra="forbid")
    error: ErrorDetail


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str


def _header(description: str, type: str = "string", required: bool = True
            ) -> dict[str, Any]:
    return {"description": description, "required": required, "schema": {"type": type}}


# On any answer to a request body with fields the server ignored (ignored_fields.py).
IGNORED_FIELDS = {"X-Infer-Ignored-Fields": _header(
    "the request's fields that were accepted but ignored, percent-encoded, comma-separated "
    "(absent when none)", required=False)}


def _error(description: str, headers: dict[str, Any] | None = None) -> dict[str, Any]:
    response: dict[str, Any] = {"model": ErrorResponse, "description": description}
    if headers:
        response["headers"] = headers
    return response


HEALTH = {200: {"description": "serving (empty body)"}, 503: _error("not ready")}
API = {
    401: _error("missing or wrong API key (when the server has one)",
                {"WWW-Authenticate": _header("Bearer")}),
    503: _error("the model is still loading, or the queue is full",
                {"Retry-After": _header("seconds to wait before retrying", "integer")}),
}
METRICS = {200: {"description": "Prometheus text exposition",
                 "content": {PROMETHEUS_TEXT: {"schema": {"type": "string"}}}},
           **API}
TOKENS = {**API, 400: _error("invalid request"), 404: _error("unknown model"),
          413: _error("body over the size limit")}
MODEL = {**API, 404: _error("a model this server does not serve")}
VERSION = {200: {"model": VersionResponse}}
_GENERATION = {**TOKENS, 500: _error("the engine failed"),
               504: _error("the request timed out (--request-timeout)")}


def _streamed(chunk: type[BaseModel]) -> dict[str, Any]:
    """The 200 is JSON, or with `stream: true` server-sent events: `data:` a chunk (or,
    after a failure, an error body), then `data: [DONE]`."""
    ref = "#/components/schemas/{}".format
    data = {"type": "string", "anyOf": [{"const": "[DONE]"}, {
        "contentMediaType": "application/json",
        "contentSchema": {"anyOf": [{"$ref": ref(chunk.__name__)},
                                    {"$ref": ref(ErrorResponse.__name__)}]}}]}
    event = {"type": "object", "required": ["data"], "properties": {"data": data}}
    return {200: {"model": chunk, "headers": IGNORED_FIELDS,
                  "content": {"text/event-stream": {"itemSchema": event}}}}


COMPLETION = {**_streamed(CompletionResponse), **_GENERATION}
CHAT_COMPLETION = {**_streamed(ChatCompletionResponse), **_GENERATION}


def without_422(app: FastAPI) -> None:
    """FastAPI documents a 422 on every route with a body; this server answers those 400."""
    default = app.openapi

    def openapi() -> dict[str, Any]:
        schema = default()
        for item in schema["paths"].values():
            for operation in item.values():
                responses = operation["responses"]
                responses.pop("422", None)
                operation["responses"] = dict(sorted(responses.items()))
        for name in ("HTTPValidationError", "ValidationError"):
            schema.get("components", {}).get("schemas", {}).pop(name, None)
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
