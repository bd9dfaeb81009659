"""AsyncEngine: the LLMEngine stepping in its own thread, each request streamed to asyncio.

Only the engine thread touches the LLMEngine. The event loop talks to it through a
thread-safe command queue (add / abort) and an Event that wakes the thread; outputs go
back through each request's asyncio.Queue via `loop.call_soon_threadsafe`, so one
AsyncEngine can serve callers on several event loops.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

from infer.engine.llm_engine import LLMEngine
from infer.engine.outputs import RequestOutput
from infer.sampling_params import RequestOutputKind, SamplingParams

log = logging.getLogger(__name__)


class QueueFullError(RuntimeError):
    """Too many requests are waiting; the caller should retry later (HTTP 503)."""


class EngineDeadError(RuntimeError):
    """The engine failed or was shut down while the request was in flight (HTTP 500)."""


class LatencyObserver(Protocol):
    """Receives latencies in seconds; called from the engine thread."""

    def observe_ttft(self, seconds: float) -> None: ...
    def observe_itl(self, seconds: float) -> None: ...
    def observe_e2e(self, seconds: float) -> None: ...


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    arrival: float = field(default_factory=time.monotonic)
    delta: bool = False  # outputs carry only what is new (RequestOutputKind.DELTA)
    last_token_time: float | None = None
    num_tokens: int = 0


class RequestStream:
    """Async iterator over one request's RequestOutputs (of its params' output kind).

    Leaving it early (cancellation, `abort()`) aborts the request in the engine, which
    frees its KV blocks before the next step.
    """

    def __init__(self, engine: AsyncEngine, request_id: str, q: asyncio.Queue) -> None:
        self._engine = engine
        self.request_id = request_id
        self._queue = q
        self._done = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        try:
            item = await self._queue.get()
        except asyncio.CancelledError:
            self.abort()
            raise
        if isinstance(item, BaseException):
            self._done = True
            raise item
        if item.finished:
            self._done = True
        return item

    @property
    def finished(self) -> bool:
        return self._done

    def abort(self) -> None:
        if not self._done:
            self._done = True
            self._engine.abort(self.request_id)


class AsyncEngine:
    def __init__(self, engine: LLMEngine, max_waiting_requests: int | None = None,
                 observer: LatencyObserver | None = None) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.input_processor = engine.input_processor  # host checks, safe from any thread
        self.model_name = engine.model_name
        self.max_model_len = engine.max_model_len
        self.max_waiting_requests = (max_waiting_requests if max_waiting_requests is not None
                                     else engine.config.max_waiting_requests)
        self.observer = observer
        self.step_errors = 0
        self.requests_rejected = 0
        self.stats: dict[str, float] = engine.stats()  # replaced (never mutated) by the thread
        engine.on_step_start = self._publish_stats
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}  # engine thread only
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="infer-engine", daemon=True)
        self._thread.start()

    # -- event-loop side -------------------------------------------------------------
    async def add_request(self, request_id: str, prompt: str | list[int],
                          params: SamplingParams) -> RequestStream:
        """Queue a request; raises ValueError / QueueFullError before any output."""
        return (await self.add_requests([(request_id, prompt)], params))[0]

    async def add_requests(self, prompts: list[tuple[str, str | list[int]]],
                           params: SamplingParams) -> list[RequestStream]:
        """Queue (request id, prompt) pairs that share `params`, all or none, in one turn
        of the engine thread; raises ValueError / QueueFullError before any output."""
        if self._stopped:
            raise EngineDeadError("the engine is shut down")
        loop = asyncio.get_running_loop()
        added: asyncio.Future = loop.create_future()
        delta = params.output_kind is RequestOutputKind.DELTA
        streams = [_Stream(loop, asyncio.Queue(), delta=delta) for _ in prompts]
        self._send(("add", prompts, params, streams, added))
        try:
            await added
        except asyncio.CancelledError:
            for request_id, _ in prompts:
                self.abort(request_id)  # FIFO: processed after the add
            raise
        return [RequestStream(self, rid, stream.queue)
                for (rid, _), stream in zip(prompts, streams)]

    async def generate(self, prompt: str | list[int], params: SamplingParams,
                       request_id: str) -> AsyncIterator[RequestOutput]:
        stream = await self.add_request(request_id, prompt, params)
        try:
            async for output in stream:
                yield output
        finally:
            stream.abort()

    def abort(self, request_id: str) -> None:
        self._send(("abort", request_id))

    def shutdown(self) -> None:
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=30)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopped

    def _send(self, command: tuple) -> None:
        self._commands.put(command)
        self._wake.set()

    # -- engine thread ---------------------------------------------------------------
    def _run(self) -> None:
        while not self._stopped:
            self._wake.clear()
            self._drain_commands()
            if not self.engine.has_unfinished_requests():
                self._publish_stats()
                self._wake.wait()
                continue
            try:
                outputs = self.engine.step()
            except Exception as exc:  # fail what the step held, keep serving
                self.step_errors += 1
                self._fail_step(EngineDeadError(f"engine step failed: {exc!r}"))
                continue
            self._deliver(outputs, time.monotonic())
            self._publish_stats()
        self._drain_commands()
        self._fail_all(EngineDeadError("the engine is shut down"))

    def _publish_stats(self) -> None:
        self.stats = self.engine.stats()

    def _drain_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if command[0] == "add":
                self._add(*command[1:])
            else:
                self.engine.abort_request(command[1])
                self._streams.pop(command[1], None)

    def _add(self, prompts: list[tuple[str, str | list[int]]], params: SamplingParams,
             streams: list[_Stream], added: asyncio.Future) -> None:
        done: list[str] = []
        try:
            if self._stopped:
                raise EngineDeadError("the engine is shut down")
            limit = self.max_waiting_requests
            if limit is not None and len(self.engine.scheduler.waiting) >= limit:
                self.requests_rejected += 1
                raise QueueFullError(f"{limit} requests are already waiting; retry later")
            for request_id, prompt in prompts:
                self.engine.add_request(request_id, prompt, params)
                done.append(request_id)
        except Exception as exc:
            for request_id in done:
                self.engine.abort_request(request_id)
            _call(added.get_loop(), _resolve, added, exc)
            return
        for (request_id, _), stream in zip(prompts, streams):
            self._streams[request_id] = stream
        _call(added.get_loop(), _resolve, added, None)

    def _deliver(self, outputs: list[RequestOutput], now: float) -> None:
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            self._observe(stream, output, now)
            if output.finished:
                del self._streams[output.request_id]
            if output.error is not None:
                _call(stream.loop, stream.queue.put_nowait,
                      EngineDeadError(f"the request failed: {output.error}"))
                continue
            if not _call(stream.loop, stream.queue.put_nowait, output):
                self.engine.abort_request(output.request_id)  # its event loop is gone
                self._streams.pop(output.request_id, None)

    def _observe(self, stream: _Stream, output: RequestOutput, now: float) -> None:
        """TTFT, then one ITL per new token (of the request's longest sequence)."""
        if stream.delta:
            tokens = stream.num_tokens + max((len(c.token_ids) for c in output.outputs),
                                             default=0)
        else:
            tokens = max((len(c.token_ids) for c in output.outputs), default=0)
        new = tokens - stream.num_tokens
        if self.observer is not None:
            if new > 0 and stream.last_token_time is None:
                self.observer.observe_ttft(now - stream.arrival)
            elif new > 0:
                for _ in range(new):
                    self.observer.observe_itl((now - stream.last_token_time) / new)
            if output.finished:
                self.observer.observe_e2e(now - stream.arrival)
        if new > 0:
            stream.num_tokens, stream.last_token_time = tokens, now

    def _fail_step(self, exc: Exception) -> None:
        """LLMEngine.step aborts the requests of a step that raised; fail just those. If
        it aborted none, the error came from outside the model step: fail everything."""
        gone = [rid for rid in self._streams
                if rid not in self.engine.output_processor.groups]
        log.exception("engine step failed; failing %d of %d requests",
                      len(gone) or len(self._streams), len(self._streams))
        if not gone:
            return self._fail_all(exc)
        for request_id in gone:
            stream = self._streams.pop(request_id)
            _call(stream.loop, stream.queue.put_nowait, exc)

    def _fail_all(self, exc: Exception) -> None:
        for request_id, stream in list(self._streams.items()):
            try:
                self.engine.abort_request(request_id)
            except Exception:
                log.exception("abort of %s failed", request_id)
            _call(stream.loop, stream.queue.put_nowait, exc)
        self._streams.clear()


def _resolve(future: asyncio.Future, exc: BaseException | None) -> None:
    if future.done():
        return
    if exc is None:
        future.set_result(None)
    else:
        future.set_exception(exc)


def _call(loop: asyncio.AbstractEventLoop, fn, *args) -> bool:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the loop is closed
        return False
    return True
