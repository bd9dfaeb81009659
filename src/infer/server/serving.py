"""The two generation endpoints: requests -> engine streams -> OpenAI responses / SSE."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from infer.engine.input_processor import RequestRejected
from infer.engine.outputs import CompletionOutput, RequestOutput
from infer.loader.chat_template import ChatTemplateError
from infer.sampling_params import RequestOutputKind, SamplingParams
from infer.server.async_engine import (
    AsyncEngine,
    EngineDeadError,
    QueueFullError,
    RequestStream,
)
from infer.server.chat import ChatSetup, MessageStream, chat_setup, read_message
from infer.server.logprobs import chat_logprobs, completion_logprobs, prompt_logprobs
from infer.server.protocol import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessageOut,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    RequestError,
    TokenizeRequest,
    Usage,
    error_body,
)
from infer.server.text_chunks import with_text_fast_path
from infer.server.tool_parsers import ToolCallDelta
from infer.server.tools import ToolError, tool_calling
from infer.structured_outputs import StructuredOutputsParams

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
# Sequences (prompts x n) one request may ask for: each is queued and scheduled apart.
MAX_SEQS_PER_REQUEST = 1024
_NO_MESSAGE = {"choices": {"__all__": {"message"}}}
T = TypeVar("T")


class ClientGone(Exception):
    """The client disconnected before its request was queued."""


def _tokenizer_pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=2, thread_name_prefix="infer-tokenize")


@dataclass
class ServingContext:
    engine: AsyncEngine
    model_names: list[str]
    request_timeout: float | None = None
    max_seqs_per_request: int = MAX_SEQS_PER_REQUEST
    chat_template: str | None = None  # the server's (--chat-template); None: the model's
    # Chat rendering and tokenization run here, never on the event loop: a long prompt
    # would stall every stream and /health for as long as it takes.
    executor: ThreadPoolExecutor = field(default_factory=_tokenizer_pool)

    def check_model(self, name: str | None) -> str:
        """The served model a request names; without a name, the first (as vLLM takes it:
        a one-model server need not be told which)."""
        if name is None:
            return self.model_names[0]
        if name not in self.model_names:
            raise RequestError(f"The model `{name}` does not exist.", "model", 404,
                               "model_not_found", "NotFoundError")
        return name

    def check_fan_out(self, num_prompts: int, n: int) -> None:
        if num_prompts * n > self.max_seqs_per_request:
            raise RequestError(
                f"the request asks for {num_prompts} prompts x n={n} = {num_prompts * n} "
                f"sequences; this server takes at most {self.max_seqs_per_request} per "
                "request", "prompt" if num_prompts > 1 else "n")

    async def off_loop(self, request: Request, work: Callable[[], T]) -> T:
        """`work()` in the tokenizer pool; raises ClientGone if the client leaves first."""
        loop = asyncio.get_running_loop()
        job = loop.run_in_executor(self.executor, work)
        watcher = asyncio.ensure_future(_until_disconnect(request))
        try:
            await asyncio.wait({job, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
        if not job.done():
            job.cancel()  # a job already running finishes in its thread, unread
            raise ClientGone
        try:
            return job.result()
        except RequestRejected as exc:
            raise _request_error(exc) from None

    def compile_constraint(self, constraint: tuple[StructuredOutputsParams, str] | None
                           ) -> None:
        """(In the tokenizer pool.) The request's output constraint compiled now, so that
        the check when it is added is a cache lookup; one the grammar library cannot take
        is a 400 naming the field that carried it."""
        if constraint is not None:
            self.engine.input_processor.compile_constraint(*constraint)

    def encode_prompt(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a prompt (in the tokenizer pool); a text whose length alone proves
        it over the context length is refused without being tokenized."""
        return self.engine.input_processor.tokenize(text, add_special_tokens)


async def create_completion(body: CompletionRequest, ctx: ServingContext,
                            request: Request) -> Response:
    model = ctx.check_model(body.model)
    body.check()
    texts = body.prompts()
    ctx.check_fan_out(len(texts), body.n)
    constraint = body.constraint()

    tokenizer = ctx.engine.tokenizer

    def prepare() -> tuple[list[list[int]], list[str]]:
        ctx.compile_constraint(constraint)
        ids = [ctx.encode_prompt(p) if isinstance(p, str) else p for p in texts]
        echoed = [(p if isinstance(p, str) else tokenizer.decode(p, False)) if body.echo
                  else "" for p in texts]
        return ids, echoed

    try:
        prompts, echoed = await ctx.off_loop(request, prepare)
    except ClientGone:
        return Response(status_code=499)
    # echo with max_tokens=0 scores the prompt: one token is generated, then dropped
    score_only = body.max_tokens == 0
    max_tokens = _max_tokens(ctx, prompts, 1 if score_only else body.max_tokens,
                             COMPLETION_DEFAULT_MAX_TOKENS)
    params = body.sampling_params(max_tokens, body.logprobs, constraint)
    if body.echo and body.logprobs is not None:  # the echoed prompt's logprobs
        params = dataclasses.replace(params, prompt_logprobs=max(
            body.logprobs, params.prompt_logprobs or 0))
    rid = f"cmpl-{uuid.uuid4().hex}"
    streams = await _add_all(ctx.engine, rid, prompts, params)

    def choice(i: int, c: CompletionOutput, out: RequestOutput | None = None
               ) -> CompletionChoice:
        """`out`: the choice's whole request output, which the prompt's echo and logprobs
        come from (not streaming)."""
        text, entries, token_ids = c.text, c.logprobs, c.token_ids
        if score_only:
            text, token_ids = "", []
            entries = None if entries is None else []
        if body.echo and out is not None:
            text = echoed[i // params.n] + text
        if body.echo and out is not None and out.prompt_logprobs is not None:
            entries = out.prompt_logprobs + (entries or [])
            token_ids = out.prompt_token_ids + token_ids
        lps = None
        if entries is not None and body.logprobs is not None:
            lps = completion_logprobs(entries, token_ids, body.logprobs,
                                      lambda t: tokenizer.decode([t], False))
        plp = None
        if out is not None and body.prompt_logprobs is not None:
            plp = prompt_logprobs(out.prompt_logprobs or [])
        return CompletionChoice(index=i, text=text, logprobs=lps, prompt_logprobs=plp,
                                finish_reason=c.finish_reason, stop_reason=c.stop_reason)

    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        created = int(time.time())
        unechoed = set(range(len(prompts) * params.n)) if body.echo else set()

        def chunk(i: int, c: CompletionOutput) -> str:
            return CompletionResponse(id=rid, model=model, created=created,
                                      choices=[choice(i, c)]).model_dump_json()

        fast = with_text_fast_path(chunk)

        def echo_first(i: int, c: CompletionOutput) -> str:
            """With echo, a choice's first chunk starts with its prompt."""
            if i in unechoed:
                unechoed.discard(i)
                return chunk(i, dataclasses.replace(c, text=echoed[i // params.n] + c.text))
            return fast(i, c)

        def usage_chunk(usage: Usage) -> str:
            return CompletionResponse(id=rid, model=model, created=created, choices=[],
                                      usage=usage).model_dump_json()

        return _sse(_stream_events(streams, params.n, ctx, request,
                                   echo_first if body.echo else fast, None,
                                   usage_chunk if include_usage else None))
    finals = await _collect(streams, ctx, request)
    if isinstance(finals, Response):
        return finals
    choices = [choice(p * params.n + c.index, c, out)
               for p, out in enumerate(finals) for c in out.outputs]
    return JSONResponse(CompletionResponse(
        id=rid, model=model, choices=choices,
        usage=_usage(finals, generated=not score_only)).model_dump())


async def create_chat_completion(body: ChatCompletionRequest, ctx: ServingContext,
                                 request: Request) -> Response:
    model = ctx.check_model(body.model)
    body.check()
    ctx.check_fan_out(1, body.n)
    setup = _chat_setup(body, ctx)
    constraint = body.constraint()
    if setup.tools.constraint is not None:
        if constraint is not None:
            raise RequestError("a tool_choice that requires a call (required or a named "
                               f"function) cannot be combined with {constraint[1]}",
                               "tool_choice")
        constraint = (setup.tools.constraint, "tools")
    tokenizer = ctx.engine.tokenizer

    def prepare() -> tuple[list[int], str | None, tuple[StructuredOutputsParams, str] | None]:
        try:
            text = setup.render(tokenizer, body.add_generation_prompt,
                                body.continue_final_message)
        except ChatTemplateError as exc:
            raise RequestError(str(exc), "messages") from None
        reasoning = setup.reasoning(text)
        c = constraint
        if c is not None:
            c = (setup.constraint_after_reasoning(c[0], reasoning), c[1])
        ctx.compile_constraint(c)
        return ctx.encode_prompt(text, add_special_tokens=False), reasoning, c

    try:
        prompt, reasoning, constraint = await ctx.off_loop(request, prepare)
    except ClientGone:
        return Response(status_code=499)
    max_tokens = _max_tokens(ctx, [prompt], body.max_new_tokens(), None)
    top = (body.top_logprobs or 0) if body.logprobs else None
    params = body.sampling_params(max_tokens, top, constraint)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    streams = await _add_all(ctx.engine, rid, [prompt], params)
    plain = setup.tools.parser is None and reasoning is None

    def logprobs(c: CompletionOutput) -> ChatLogprobs | None:
        return None if c.logprobs is None else chat_logprobs(c.logprobs, c.token_ids, top or 0)

    def final_choice(c: CompletionOutput) -> ChatChoice:
        parts = read_message(c.text, setup, reasoning)
        calls = [{"id": t.id, "type": "function",
                  "function": {"name": t.name, "arguments": t.arguments}}
                 for t in parts.tool_calls]
        message = ChatMessageOut(role="assistant", content=parts.content,
                                 reasoning_content=parts.reasoning, tool_calls=calls or None)
        return ChatChoice(index=c.index, message=message, logprobs=logprobs(c),
                          finish_reason=_finish_reason(c.finish_reason, bool(calls)),
                          stop_reason=c.stop_reason)

    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        created = int(time.time())

        def response(choices: list[ChatChoice], usage: Usage | None = None) -> str:
            return ChatCompletionResponse(
                id=rid, model=model, object="chat.completion.chunk", created=created,
                choices=choices, usage=usage).model_dump_json(exclude=_NO_MESSAGE)

        def text_chunk(i: int, c: CompletionOutput) -> str:
            return response([ChatChoice(index=i, delta=ChatMessageOut(content=c.text),
                                        logprobs=logprobs(c), finish_reason=c.finish_reason,
                                        stop_reason=c.stop_reason)])

        readers: dict[int, MessageStream] = {}

        def message_chunk(i: int, c: CompletionOutput) -> str | None:
            reader = readers.get(i)
            if reader is None:
                reader = readers[i] = MessageStream(setup, reasoning)
            thought, content, calls = reader.feed(c.text, c.finish_reason is not None)
            if not (thought or content or calls or c.finish_reason or c.logprobs):
                return None
            delta = ChatMessageOut(content=content or None, reasoning_content=thought or None,
                                   tool_calls=[_call_delta(d) for d in calls] or None)
            return response([ChatChoice(
                index=i, delta=delta, logprobs=logprobs(c),
                finish_reason=_finish_reason(c.finish_reason, reader.called),
                stop_reason=c.stop_reason)])

        def role_chunk(i: int) -> str:
            return response([ChatChoice(index=i, delta=ChatMessageOut(role="assistant",
                                                                      content=""))])

        def usage_chunk(usage: Usage) -> str:
            return response([], usage)

        chunk = with_text_fast_path(text_chunk) if plain else message_chunk
        return _sse(_stream_events(streams, params.n, ctx, request, chunk, role_chunk,
                                   usage_chunk if include_usage else None))
    finals = await _collect(streams, ctx, request)
    if isinstance(finals, Response):
        return finals
    choices = [final_choice(c) for c in finals[0].outputs]
    plp = None
    if body.prompt_logprobs is not None:
        plp = prompt_logprobs(finals[0].prompt_logprobs or [])
    return JSONResponse(ChatCompletionResponse(
        id=rid, model=model, choices=choices, usage=_usage(finals),
        prompt_logprobs=plp).model_dump(exclude={"choices": {"__all__": {"delta"}}}))


def _chat_setup(body: ChatCompletionRequest, ctx: ServingContext) -> ChatSetup:
    """The request's template inputs and how its answer is read; a 400 naming the field
    for tools, tool_choice or chat_template_kwargs that do not fit."""
    tokenizer = ctx.engine.tokenizer
    try:
        template = tokenizer.get_chat_template(ctx.chat_template, body.tools or None)
    except ChatTemplateError as exc:
        raise RequestError(str(exc), "messages") from None
    try:
        tools = tool_calling(body.tools, body.tool_choice, body.parallel_tool_calls, template)
    except ToolError as exc:
        raise RequestError(str(exc), exc.param) from None
    messages = [m.as_template_message() for m in body.messages]
    try:
        return chat_setup(messages, tools, body.chat_template_kwargs, template)
    except ValueError as exc:
        raise RequestError(str(exc), "chat_template_kwargs") from None


def _finish_reason(reason: str | None, called: bool) -> str | None:
    return "tool_calls" if called and reason == "stop" else reason


def _call_delta(delta: ToolCallDelta) -> dict[str, Any]:
    if delta.id is None:
        return {"index": delta.index, "function": {"arguments": delta.arguments}}
    return {"index": delta.index, "id": delta.id, "type": "function",
            "function": {"name": delta.name, "arguments": delta.arguments}}


async def serve_tokenize(body: TokenizeRequest, ctx: ServingContext,
                         request: Request) -> Response:
    """Token ids of a prompt or a chat; the ids and their JSON are made off the loop."""
    ctx.check_model(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise RequestError("give exactly one of prompt and messages", "prompt")
    tok = ctx.engine.tokenizer

    def work() -> bytes:
        if body.messages is not None:
            messages = [m.as_template_message() for m in body.messages]
            try:
                ids = tok.encode_chat(messages, body.add_generation_prompt,
                                      chat_template=ctx.chat_template)
            except ChatTemplateError as exc:
                raise RequestError(str(exc), "messages") from None
        else:
            ids = tok.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        return json.dumps({"tokens": ids, "count": len(ids),
                           "max_model_len": ctx.engine.max_model_len}).encode()

    try:
        return Response(await ctx.off_loop(request, work), media_type="application/json")
    except ClientGone:
        return Response(status_code=499)


async def serve_detokenize(body: DetokenizeRequest, ctx: ServingContext,
                           request: Request) -> Response:
    ctx.check_model(body.model)
    vocab = ctx.engine.input_processor.vocab_size

    def work() -> bytes:
        if any(not 0 <= t < vocab for t in body.tokens):
            raise RequestError(f"token ids must be in [0, {vocab})", "tokens")
        text = ctx.engine.tokenizer.decode(body.tokens, skip_special_tokens=False)
        return json.dumps({"prompt": text}).encode()

    try:
        return Response(await ctx.off_loop(request, work), media_type="application/json")
    except ClientGone:
        return Response(status_code=499)


# -- helpers --------------------------------------------------------------------------
def _max_tokens(ctx: ServingContext, prompts: list[list[int]], requested: int | None,
                default: int | None) -> int | None:
    """The request's max_tokens: as asked (refused past the context length, as OpenAI
    does), or `default` capped to what fits, or None for as many as fit."""
    fit = ctx.engine.input_processor.max_new_tokens
    try:
        for ids in prompts:
            fit(len(ids), requested, strict=True)
    except RequestRejected as exc:
        raise _request_error(exc) from None
    if requested is None and default is not None:
        return min(default, ctx.engine.max_model_len - max(len(ids) for ids in prompts))
    return requested


def _request_error(exc: RequestRejected) -> RequestError:
    return RequestError(str(exc), exc.param, code=exc.code)


async def _add_all(engine: AsyncEngine, rid: str, prompts: list[list[int]],
                   params: SamplingParams) -> list[RequestStream]:
    """Queue every prompt's sequences; outputs come back as deltas (O(new tokens) per
    step), which the endpoints stream as they are or add up for a final answer."""
    params = dataclasses.replace(params, output_kind=RequestOutputKind.DELTA)
    try:
        return await engine.add_requests(
            [(f"{rid}-{i}", ids) for i, ids in enumerate(prompts)], params)
    except Exception as exc:
        if isinstance(exc, QueueFullError):
            raise RequestError(str(exc), None, 503, "server_busy", "ServiceUnavailable") from None
        if isinstance(exc, RequestRejected):
            raise _request_error(exc) from None
        if isinstance(exc, ValueError) and not isinstance(exc, RequestError):
            raise RequestError(str(exc), getattr(exc, "param", "prompt")) from None
        raise


async def _merge(streams: list[RequestStream]
                 ) -> AsyncIterator[tuple[int, list[RequestOutput]]]:
    """(stream index, outputs) as they come; one stream is read without any task."""
    try:
        if len(streams) == 1:
            while not streams[0].finished:
                yield 0, await streams[0].next_batch()
            return
        pending = {asyncio.ensure_future(s.next_batch()): i for i, s in enumerate(streams)}
        try:
            while pending:
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    i = pending.pop(task)
                    yield i, task.result()
                    if not streams[i].finished:
                        pending[asyncio.ensure_future(streams[i].next_batch())] = i
        finally:
            for task in pending:
                task.cancel()
    finally:
        for stream in streams:
            stream.abort()


async def _until_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _collect(streams: list[RequestStream], ctx: ServingContext,
                   request: Request) -> list[RequestOutput] | Response:
    async def run() -> list[RequestOutput]:
        totals = [_Total() for _ in streams]
        async for i, outputs in _merge(streams):
            for output in outputs:
                totals[i].add(output)
        return [t.output() for t in totals]

    work = asyncio.ensure_future(run())
    watcher = asyncio.ensure_future(_until_disconnect(request))
    try:
        done, _ = await asyncio.wait({work, watcher}, timeout=ctx.request_timeout,
                                     return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not work.done():
            work.cancel()  # disconnect or timeout: abort, freeing the KV blocks now
    if work in done:
        return work.result()
    with contextlib.suppress(asyncio.CancelledError):
        await work  # a cancel is only a request: let the abort run before answering
    if watcher in done:
        return Response(status_code=499)
    raise RequestError("the request timed out", None, 504, "timeout", "Timeout")


@dataclass
class _Choice:
    """One completion added up from its deltas (text in pieces: no quadratic joins)."""

    index: int
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def add(self, c: CompletionOutput) -> None:
        if c.text:
            self.text.append(c.text)
        self.token_ids += c.token_ids
        if c.logprobs is not None:
            self.logprobs = (self.logprobs or []) + c.logprobs
        self.cumulative_logprob = c.cumulative_logprob
        self.finish_reason, self.stop_reason = c.finish_reason, c.stop_reason

    @property
    def has_news(self) -> bool:
        """Text to send, or the end (tokens whose text is held back wait for more)."""
        return bool(self.text) or self.finish_reason is not None

    def take(self) -> CompletionOutput:
        """What was added since the last take, as one completion delta."""
        text = self.text[0] if len(self.text) == 1 else "".join(self.text)
        out = CompletionOutput(self.index, text, self.token_ids, self.cumulative_logprob,
                               self.logprobs, self.finish_reason, self.stop_reason)
        self.text, self.token_ids, self.logprobs = [], [], None
        return out


def _choice(choices: dict[int, _Choice], index: int) -> _Choice:
    """The choice at `index`, made on first use (no throwaway object per call)."""
    choice = choices.get(index)
    if choice is None:
        choice = choices[index] = _Choice(index)
    return choice


class _Total:
    """A request's final output, added up from its delta outputs."""

    def __init__(self) -> None:
        self.last: RequestOutput | None = None
        self.choices: dict[int, _Choice] = {}
        self.prompt_logprobs = None  # in one delta only

    def add(self, output: RequestOutput) -> None:
        self.last = output
        self.prompt_logprobs = output.prompt_logprobs or self.prompt_logprobs
        for c in output.outputs:
            _choice(self.choices, c.index).add(c)

    def output(self) -> RequestOutput:
        assert self.last is not None and self.last.finished
        return dataclasses.replace(
            self.last, outputs=[self.choices[i].take() for i in sorted(self.choices)],
            prompt_logprobs=self.prompt_logprobs)


def _usage(outputs: list[RequestOutput], generated: bool = True) -> Usage:
    """`generated` False: the tokens generated were dropped (echo with max_tokens=0)."""
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs) if generated else 0
    return Usage(prompt_tokens=prompt, completion_tokens=completion,
                 total_tokens=prompt + completion)


async def _stream_events(
    streams: list[RequestStream], n: int, ctx: ServingContext, request: Request,
    chunk: Callable[[int, CompletionOutput], str | None],
    role_chunk: Callable[[int], str] | None,
    usage_chunk: Callable[[Usage], str] | None,
) -> AsyncIterator[str]:
    """One chunk per choice with new text each time its stream is read (one step's
    outputs, or several when the reader fell behind: fewer, larger chunks under load;
    tokens whose text is held back, e.g. half a character, ride with the next chunk),
    and one when the choice finishes."""
    pending: dict[int, _Choice] = {}
    prompt_tokens = [0] * len(streams)
    completion_tokens = 0
    if role_chunk is not None:
        for i in range(len(streams) * n):
            yield f"data: {role_chunk(i)}\n\n"
    merged = _merge(streams)
    timers = []
    if ctx.request_timeout is not None:
        deadline = asyncio.get_running_loop().time() + ctx.request_timeout
        timers = [stream.fail_at(deadline, _Timeout()) for stream in streams]
    try:
        while True:
            try:
                p, outputs = await merged.__anext__()
            except StopAsyncIteration:
                break
            except _Timeout:
                yield _error_event("the request timed out", "Timeout", "timeout")
                return
            except EngineDeadError as exc:
                yield _error_event(str(exc), "InternalError", 500)
                return
            touched: dict[int, _Choice] = {}
            for output in outputs:
                prompt_tokens[p] = len(output.prompt_token_ids)
                for c in output.outputs:
                    index = p * n + c.index
                    choice = _choice(pending, index)
                    choice.add(c)
                    completion_tokens += len(c.token_ids)
                    touched[index] = choice
            for choice in touched.values():
                if choice.has_news:
                    event = chunk(choice.index, choice.take())
                    if event is not None:  # None: nothing to send yet (held back)
                        yield f"data: {event}\n\n"
        if usage_chunk is not None:
            prompt = sum(prompt_tokens)
            usage = Usage(prompt_tokens=prompt, completion_tokens=completion_tokens,
                          total_tokens=prompt + completion_tokens)
            yield f"data: {usage_chunk(usage)}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        for timer in timers:
            timer.cancel()
        await merged.aclose()


class _Timeout(Exception):
    """Put in a stream's place at its request's deadline."""


def _error_event(message: str, type: str, code: str | int) -> str:
    """After the 200 has gone out, an error can only be an event (and no [DONE])."""
    return f"data: {json.dumps(error_body(message, type, code))}\n\n"


def _sse(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})
