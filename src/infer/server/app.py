"""The FastAPI app: OpenAI-compatible endpoints, health, metrics, auth and limits."""

from __future__ import annotations

import hmac
import itertools
import json
import logging
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from infer.loader.chat_template import compile_template
from infer.server.async_engine import AsyncEngine, EngineDeadError
from infer.server.ignored_fields import IGNORED_FIELDS_HEADER, IgnoredFieldsHeader, note_ignored
from infer.server.metrics import ServerMetrics
from infer.server.openapi import (
    API,
    CHAT_COMPLETION,
    COMPLETION,
    HEALTH,
    IGNORED_FIELDS,
    METRICS,
    MODEL,
    PROMETHEUS_TEXT,
    TOKENS,
    VERSION,
    DetokenizeResponse,
    TokenizeResponse,
    VersionResponse,
    without_422,
)
from infer.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ModelCard,
    ModelList,
    RequestError,
    TokenizeRequest,
    error_body,
)
from infer.server.serving import (
    MAX_SEQS_PER_REQUEST,
    ServingContext,
    create_chat_completion,
    create_completion,
    serve_detokenize,
    serve_tokenize,
)
from infer.server.web import PAGE_PATHS, add_chat_page
from infer.version import version

log = logging.getLogger(__name__)
MAX_BODY_BYTES = 8 * 1024 * 1024
RETRY_AFTER_S = 1
_OPEN_PATHS = ("/health", "/version", "/metrics", "/docs", "/openapi.json", "/redoc",
               *PAGE_PATHS)


def error_response(status: int, message: str, type: str = "invalid_request_error",
                   param: str | None = None, code: str | int | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    body = error_body(message, type, code if code is not None else status, param)
    return JSONResponse(body, status_code=status, headers=headers)


def build_app(async_engine: AsyncEngine | None, served_model_name: str | list[str] | None = None,
              api_key: str | None = None, request_timeout: float | None = None,
              max_body_bytes: int = MAX_BODY_BYTES,
              max_seqs_per_request: int = MAX_SEQS_PER_REQUEST,
              chat_template: str | None = None,
              allowed_origins: Sequence[str] = ("*",), allowed_methods: Sequence[str] = ("*",),
              allowed_headers: Sequence[str] = ("*",), allow_credentials: bool = False
              ) -> FastAPI:
    """`async_engine` may be None while the model loads (then /health is 503); set it
    later with `attach_engine`. `chat_template` (a template's text) replaces the model's
    for chats; one that does not compile is a ChatTemplateError here. The `allowed_*` and
    `allow_credentials` are CORS's (Starlette's CORSMiddleware)."""
    if max_seqs_per_request < 1:
        raise ValueError(f"max_seqs_per_request must be at least 1, got {max_seqs_per_request}")
    if chat_template is not None:
        compile_template(chat_template)
    app = FastAPI(title="infer", version=version())
    app.state.engine = None
    app.state.names = served_model_name
    app.state.request_timeout = request_timeout
    app.state.max_seqs_per_request = max_seqs_per_request
    app.state.chat_template = chat_template
    if async_engine is not None:
        attach_engine(app, async_engine)
    _add_error_handlers(app)
    _add_routes(app)
    # The last added runs first: CORS answers preflights before auth and puts its headers
    # on every answer, a 401 or 413 included (a browser shows no body without them).
    app.add_middleware(IgnoredFieldsHeader)
    app.add_middleware(_BodyLimit, max_bytes=max_body_bytes)
    if api_key:
        app.add_middleware(_BearerAuth, api_key=api_key)
    app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins),
                       allow_methods=list(allowed_methods),
                       allow_headers=list(allowed_headers),
                       allow_credentials=allow_credentials,
                       expose_headers=[IGNORED_FIELDS_HEADER])
    return app


def attach_engine(app: FastAPI, async_engine: AsyncEngine) -> None:
    names = app.state.names or async_engine.model_name
    names = [names] if isinstance(names, str) else list(names)
    app.state.metrics = ServerMetrics(lambda: _stats(async_engine),
                                      async_engine.other_sides_histograms)
    async_engine.observer = app.state.metrics
    app.state.serving = ServingContext(async_engine, names, app.state.request_timeout,
                                       app.state.max_seqs_per_request,
                                       app.state.chat_template)
    app.state.engine = async_engine


def _stats(engine: AsyncEngine) -> dict[str, float]:
    return {**engine.stats, "step_errors": engine.step_errors}


def _serving(request: Request) -> ServingContext:
    if request.app.state.engine is None:
        raise RequestError("the model is still loading", None, 503, "loading",
                           "ServiceUnavailable")
    return request.app.state.serving


def _add_routes(app: FastAPI) -> None:
    without_422(app)
    add_chat_page(app)

    # GET is registered first: a 405 from /health then answers `Allow: GET`, not `HEAD`.
    @app.head("/health", response_class=Response, responses=HEALTH)
    @app.get("/health", response_class=Response, responses=HEALTH)
    async def health(request: Request) -> Response:
        engine = request.app.state.engine
        if engine is None or not engine.alive:
            return error_response(503, "not ready", "ServiceUnavailable")
        return Response(status_code=200)

    @app.get("/version", responses=VERSION)
    async def get_version() -> VersionResponse:
        return VersionResponse(version=version())

    @app.get("/v1/models", responses=API)
    async def models(request: Request) -> ModelList:
        ctx = _serving(request)
        return ModelList(data=[_model_card(ctx, name) for name in ctx.model_names])

    @app.get("/v1/models/{model_id:path}", responses=MODEL)
    async def model(model_id: str, request: Request) -> ModelCard:
        ctx = _serving(request)
        if model_id not in ctx.model_names:
            raise RequestError(f"The model `{model_id}` does not exist; this server serves "
                               f"{', '.join(ctx.model_names)}", "model", 404, 404,
                               "NotFoundError")
        return _model_card(ctx, model_id)

    @app.post("/v1/completions", responses=COMPLETION)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        note_ignored(body.ignored_fields(), request)
        return await create_completion(body, _serving(request), request)

    @app.post("/v1/chat/completions", responses=CHAT_COMPLETION)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        note_ignored(body.ignored_fields(), request)
        return await create_chat_completion(body, _serving(request), request)

    @app.get("/metrics", response_class=Response, responses=METRICS)
    async def metrics(request: Request) -> Response:
        _serving(request)
        return Response(request.app.state.metrics.render(), media_type=PROMETHEUS_TEXT)

    @app.get("/stats", responses=API)
    async def stats(request: Request) -> dict[str, float]:
        return _stats(_serving(request).engine)

    @app.post("/tokenize", response_model=None,
              responses={200: {"model": TokenizeResponse, "headers": IGNORED_FIELDS},
                         **TOKENS})
    async def tokenize(body: TokenizeRequest, request: Request) -> Response:
        note_ignored(body.ignored_fields(), request)
        return await serve_tokenize(body, _serving(request), request)

    @app.post("/detokenize", response_model=None,
              responses={200: {"model": DetokenizeResponse, "headers": IGNORED_FIELDS},
                         **TOKENS})
    async def detokenize(body: DetokenizeRequest, request: Request) -> Response:
        note_ignored(body.ignored_fields(), request)
        return await serve_detokenize(body, _serving(request), request)


def _model_card(ctx: ServingContext, name: str) -> ModelCard:
    return ModelCard(id=name, max_model_len=ctx.engine.max_model_len,
                     quantization=ctx.engine.info.quantization,
                     kv_cache_dtype=ctx.engine.info.kv_cache_dtype or None)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestError)
    async def request_error(request: Request, exc: RequestError) -> JSONResponse:
        headers = {"Retry-After": str(RETRY_AFTER_S)} if exc.status == 503 else None
        return error_response(exc.status, exc.message, exc.type, exc.param, exc.code, headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {}
        if first.get("type") == "json_invalid":
            return error_response(400, "the request body is not valid JSON", param=None)
        param = ".".join(_error_param(errors)) or None
        message = "; ".join(
            f"{'.'.join(str(p) for p in e.get('loc', ()) if p != 'body') or 'body'}: "
            f"{e.get('msg')}" for e in errors[:5])
        return error_response(400, message, param=param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "NotFoundError" if exc.status_code == 404 else "invalid_request_error"
        return error_response(exc.status_code, str(exc.detail), kind,
                              headers=getattr(exc, "headers", None))

    @app.exception_handler(EngineDeadError)
    async def engine_error(request: Request, exc: EngineDeadError) -> JSONResponse:
        return error_response(500, str(exc), "InternalError")

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        log.exception("internal error")
        return error_response(500, f"internal error: {type(exc).__name__}", "InternalError")


def _error_param(errors: list[dict[str, Any]]) -> list[str]:
    """The field of the first error. A value that fits no member of a union gets one
    error per member, each with the member's name appended to the location: the field is
    where the locations of that field's errors part."""
    loc = [str(p) for p in errors[0].get("loc", ()) if p != "body"]
    for error in errors[1:]:
        other = [str(p) for p in error.get("loc", ()) if p != "body"]
        if other[:1] == loc[:1]:
            loc = [a for a, _ in itertools.takewhile(lambda ab: ab[0] == ab[1],
                                                      zip(loc, other))]
    return loc


class _BodyLimit:
    """Refuses bodies over `max_bytes` (413) before any handler parses them."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await _send_error(send, 413, f"body over {self.max_bytes} bytes")
        received = 0

        async def limited() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise HTTPException(413, f"body over {self.max_bytes} bytes")
            return message

        await self.app(scope, limited, send)


class _BearerAuth:
    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in _OPEN_PATHS \
                or scope["method"] == "OPTIONS":
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(b"authorization", b"")
        if not hmac.compare_digest(given, self.expected):
            return await _send_error(send, 401, "invalid or missing API key "
                                     "(Authorization: Bearer KEY)", "AuthenticationError",
                                     {"WWW-Authenticate": "Bearer"})
        await self.app(scope, receive, send)


async def _send_error(send: Send, status: int, message: str,
                      type: str = "invalid_request_error",
                      headers: dict[str, str] | None = None) -> None:
    body = json.dumps(error_body(message, type, status)).encode()
    extra = [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()), *extra]})
    await send({"type": "http.response.body", "body": body})
