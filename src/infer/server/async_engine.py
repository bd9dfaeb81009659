"""AsyncEngine: the request side of the server, over an engine core that steps on its own.

The core (scheduler, model runner, sampler) runs in a process of its own
(`AsyncEngine.launch`, the server's default), or in a thread (`AsyncEngine.in_thread`);
either way it is reached through the same pipe and messages (`engine/core_process.py`).
This side keeps tokenized-prompt checks, detokenizing, stop strings and outputs: a caller
on any event loop adds requests and reads a RequestStream; one receiving thread turns the
token deltas of each step (of every step that piled up while a loop was busy) into
RequestOutputs and hands them to each stream's loop, one `call_soon_threadsafe` per loop.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Protocol

from infer.engine.config import EngineConfig
from infer.engine.core_loading import CoreInfo
from infer.engine.core_process import CoreClient, unpack_outputs
from infer.engine.engine_core import SequenceOutput
from infer.engine.input_processor import InputProcessor, split_into_sequences
from infer.engine.llm_engine import LLMEngine
from infer.engine.output_processor import OutputProcessor
from infer.engine.outputs import RequestOutput
from infer.engine.setup import load_tokenizer
from infer.loader.tokenizer import Tokenizer
from infer.sampling_params import RequestOutputKind, SamplingParams

log = logging.getLogger(__name__)


# Longest the receiving thread waits for a loop to take a delivery before it reads on
# (a loop blocked that long gets its outputs queued, as without the wait; 0: no wait).
DELIVERY_WAIT_S = 1.0
# How often a side of a shared core (several API processes) sends its request counters and
# latency histograms, which the core passes on to the other sides for their /metrics.
SIDE_STATS_INTERVAL_S = 0.5


class QueueFullError(RuntimeError):
    """Too many requests are waiting; the caller should retry later (HTTP 503)."""


class EngineDeadError(RuntimeError):
    """The engine failed or was shut down while the request was in flight (HTTP 500)."""


class LatencyObserver(Protocol):
    """Receives latencies in seconds; called from the receiving thread."""

    def observe_ttft(self, seconds: float) -> None: ...
    def observe_itl(self, seconds: float, count: int = 1) -> None:
        """`count` inter-token latencies of `seconds` each."""
    def observe_e2e(self, seconds: float) -> None: ...
    def snapshot(self) -> dict[str, tuple[list[int], float]]:
        """Each histogram's bucket counts and sum, for the other API processes."""


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

    Leaving it early (cancellation, `abort()`) or an error in its place (the engine's, a
    deadline's) aborts the request in the engine, which frees its KV blocks before the
    next step.
    """

    def __init__(self, engine: AsyncEngine, request_id: str, q: asyncio.Queue) -> None:
        self._engine = engine
        self.request_id = request_id
        self._queue = q
        self._done = False
        self._error: BaseException | None = None  # taken from the queue, raised next

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        if self._error is not None:
            item, self._error = self._error, None
        else:
            try:
                item = await self._queue.get()
            except asyncio.CancelledError:
                self.abort()
                raise
        if isinstance(item, BaseException):
            self.abort()
            raise item
        if item.finished:
            self._done = True
        return item

    async def next_batch(self) -> list[RequestOutput]:
        """The next output and every one already queued behind it (a reader that fell
        behind catches up in one go); raises what the engine put in its place."""
        batch = [await self.__anext__()]
        while not self._done and not self._queue.empty():
            item = self._queue.get_nowait()
            if isinstance(item, BaseException):
                self._error = item  # raised by the next call, after this batch
                break
            batch.append(item)
            self._done = item.finished
        return batch

    def fail_at(self, when: float, error: BaseException) -> asyncio.TimerHandle:
        """Make the reader raise `error` at loop time `when` (a deadline), unless done."""
        return asyncio.get_running_loop().call_at(when, self._queue.put_nowait, error)

    @property
    def finished(self) -> bool:
        return self._done

    def abort(self) -> None:
        if not self._done:
            self._done = True
            self._engine.abort(self.request_id)


class AsyncEngine:
    """Build with `AsyncEngine.launch(config)` (the core in its own process) or
    `AsyncEngine.in_thread(engine)` (the core of an engine built here, in a thread)."""

    def __init__(self, client: CoreClient, tokenizer: Tokenizer, info: CoreInfo,
                 config: EngineConfig, engine: LLMEngine | None = None,
                 max_waiting_requests: int | None = None,
                 observer: LatencyObserver | None = None) -> None:
        self.engine = engine  # None with a core process: the core's state lives there
        self.config = config
        self.info = info
        self.tokenizer = tokenizer
        self.model_name = info.model_name
        self.max_model_len = info.max_model_len
        self.input_processor = (engine.input_processor if engine is not None
                                else InputProcessor.for_core(tokenizer, info))
        self.output_processor = (engine.output_processor if engine is not None
                                 else OutputProcessor(tokenizer))
        self.max_waiting_requests = (max_waiting_requests if max_waiting_requests is not None
                                     else config.max_waiting_requests)
        self.observer = observer
        # Called (from the receiving thread) once the core has died: a server exits.
        self.on_core_death: Callable[[], None] | None = None
        self.requests_rejected = 0
        self._num_seqs_sent = 0
        self.core_stats: dict[str, float] = {}  # replaced (never mutated) on each report
        self._stats_shared = 0.0
        self._last_shared: dict | None = None
        self._client = client
        self._lock = threading.Lock()  # the output processor and the streams
        self._streams: dict[str, _Stream] = {}
        self._stopped = self._dead = False
        self._receiver = threading.Thread(target=self._receive, name="infer-outputs",
                                          daemon=True)
        self._receiver.start()

    @classmethod
    def launch(cls, config: EngineConfig, max_waiting_requests: int | None = None,
               observer: LatencyObserver | None = None) -> AsyncEngine:
        """Start the engine core in its own process; returns once its model is loaded."""
        tokenizer = load_tokenizer(config.model)
        client, info = CoreClient.spawn(config)
        return cls(client, tokenizer, info, config, None, max_waiting_requests, observer)

    @classmethod
    def launch_shared(cls, config: EngineConfig, sides: int
                      ) -> tuple[AsyncEngine, list[Connection]]:
        """`launch`, with a core that serves `sides` request sides: this one, and pipe ends
        for the others (`attach`, in other processes)."""
        tokenizer = load_tokenizer(config.model)
        client, info, others = CoreClient.spawn_shared(config, sides)
        return cls(client, tokenizer, info, config), others

    @classmethod
    def attach(cls, config: EngineConfig, conn: Connection,
               max_waiting_requests: int | None = None,
               observer: LatencyObserver | None = None) -> AsyncEngine:
        """Another request side of a core that another process started (a server's
        further API processes: `CoreClient.spawn_shared`)."""
        tokenizer = load_tokenizer(config.model)
        client, info = CoreClient.attach(conn)
        return cls(client, tokenizer, info, config, None, max_waiting_requests, observer)

    @classmethod
    def in_thread(cls, engine: LLMEngine, max_waiting_requests: int | None = None,
                  observer: LatencyObserver | None = None) -> AsyncEngine:
        """The core of `engine` stepping in a thread of this process, through the same
        pipe and messages (tests look inside it; nothing is loaded twice)."""
        return cls(CoreClient.in_thread(engine.core), engine.tokenizer, engine.info,
                   engine.config, engine, max_waiting_requests, observer)

    @property
    def stats(self) -> dict[str, float]:
        """The core's counters, and this side's request counters plus those of the other
        sides of a shared core (as of their last report)."""
        stats = {k: v for k, v in self.core_stats.items() if k != "sides"}
        mine = self.request_stats()
        for side in self.core_stats.get("sides", ()):
            for key, value in side["stats"].items():
                mine[key] = mine.get(key, 0) + value
        return {**stats, **mine}

    def request_stats(self) -> dict[str, float]:
        """This side's own request counters."""
        return {**self.output_processor.stats(), "requests_rejected": self.requests_rejected}

    def other_sides_histograms(self) -> list[dict[str, tuple[list[int], float]]]:
        return [side["histograms"] for side in self.core_stats.get("sides", ())]

    @property
    def step_errors(self) -> int:
        return int(self.core_stats.get("step_errors", 0))

    @property
    def core_pid(self) -> int | None:
        return getattr(self._client.runner, "pid", None)

    # -- event-loop side -------------------------------------------------------------
    async def add_request(self, request_id: str, prompt: str | list[int],
                          params: SamplingParams) -> RequestStream:
        """Queue a request; raises ValueError / QueueFullError before any output."""
        return (await self.add_requests([(request_id, prompt)], params))[0]

    async def add_requests(self, prompts: list[tuple[str, str | list[int]]],
                           params: SamplingParams) -> list[RequestStream]:
        """Queue (request id, prompt) pairs that share `params`, all or none; raises
        ValueError / QueueFullError before any output."""
        if not self.alive:
            raise EngineDeadError("the engine is shut down" if self._stopped
                                  else "the engine core is not running")
        loop = asyncio.get_running_loop()
        processed = [self.input_processor.process(prompt, params) for _, prompt in prompts]
        now = time.monotonic()
        delta = params.output_kind is RequestOutputKind.DELTA
        sequences, streams = [], []
        with self._lock:
            limit = self.max_waiting_requests
            if limit is not None and self._num_waiting() >= limit:
                self.requests_rejected += 1
                raise QueueFullError(f"{limit} requests are already waiting; retry later")
            ids = [rid for rid, _ in prompts]
            taken = [rid for rid in ids if rid in self.output_processor.groups]
            if taken or len(set(ids)) < len(ids):
                raise ValueError(f"duplicate request id {(taken or ids)[0]!r}")
            for request_id, prompt in zip(ids, processed):
                seqs = split_into_sequences(request_id, prompt, now)
                self.output_processor.add(request_id, prompt.text, prompt.token_ids,
                                          [r.request_id for r, _ in seqs],
                                          [p for _, p in seqs], now)
                stream = _Stream(loop, asyncio.Queue(), now, delta)
                self._streams[request_id] = stream
                streams.append(RequestStream(self, request_id, stream.queue))
                sequences += seqs
            self._num_seqs_sent += len(sequences)
        self._client.send(("add", sequences))
        return streams

    def _num_waiting(self) -> int:
        """Sequences waiting in the core as of its last report, plus those sent since."""
        stats = self.core_stats
        return (int(stats.get("num_requests_waiting", 0)) + self._num_seqs_sent
                - int(stats.get("num_seqs_added", 0)))

    async def generate(self, prompt: str | list[int], params: SamplingParams,
                       request_id: str) -> AsyncIterator[RequestOutput]:
        stream = await self.add_request(request_id, prompt, params)
        try:
            async for output in stream:
                yield output
        finally:
            stream.abort()

    def abort(self, request_id: str) -> None:
        """Forget the request here and free its sequences in the core; any thread."""
        with self._lock:
            self._streams.pop(request_id, None)
            seq_ids = self.output_processor.remove(request_id)
        if seq_ids:
            self._client.send(("finish", [(s, "abort", None) for s in seq_ids]))

    def shutdown(self) -> None:
        self._stopped = True
        self._client.shutdown()
        self._receiver.join(timeout=30)

    @property
    def alive(self) -> bool:
        return not (self._stopped or self._dead) and self._client.alive()

    # -- receiving thread ------------------------------------------------------------
    def _receive(self) -> None:
        try:
            while True:
                updates: list[SequenceOutput] = []
                if (self.core_stats.get("num_sides", 1) > 1
                        and not self._client.poll(SIDE_STATS_INTERVAL_S)):
                    self._share_stats()  # idle, but the other sides' /metrics want ours
                    continue
                message = self._client.recv()
                while True:  # what piled up while the last batch was delivered: one batch
                    if message[0] == "outputs":
                        updates += unpack_outputs(message[1])
                    elif message[0] == "stats":
                        self.core_stats = message[1]
                    if not self._client.poll():
                        break
                    message = self._client.recv()
                if updates:
                    for delivered in self._deliver(updates, time.monotonic()):
                        if DELIVERY_WAIT_S > 0:
                            delivered.wait(DELIVERY_WAIT_S)
                self._share_stats()
        except (EOFError, OSError):
            pass
        except Exception:
            log.exception("the output thread failed")
        self._core_gone()

    def _share_stats(self) -> None:
        """With other sides on the core, this side's counters for their /metrics: at most
        every SIDE_STATS_INTERVAL_S, when they changed."""
        now = time.monotonic()
        if (self.core_stats.get("num_sides", 1) > 1
                and now - self._stats_shared >= SIDE_STATS_INTERVAL_S):
            self._stats_shared = now
            histograms = self.observer.snapshot() if self.observer is not None else {}
            snapshot = {"stats": self.request_stats(), "histograms": histograms}
            if snapshot != self._last_shared:
                self._last_shared = snapshot
                self._client.send(("side_stats", snapshot))

    def _deliver(self, updates: list[SequenceOutput], now: float) -> list[threading.Event]:
        """Hand the outputs to their streams' loops; returns an event per loop, set once
        that loop has run every stream the outputs woke. The receiving thread waits for
        them before it reads on, so steps that arrive meanwhile are delivered together:
        a loop that falls behind gets fewer, larger outputs, not a queue of small ones."""
        deliveries: list[tuple[_Stream, RequestOutput]] = []
        with self._lock:
            processed = self.output_processor.process(updates, now)
            for output in processed.outputs:
                stream = self._streams.get(output.request_id)
                if stream is None:
                    continue
                if output.finished:
                    del self._streams[output.request_id]
                deliveries.append((stream, output))
        if processed.to_finish:
            self._client.send(("finish", processed.to_finish))
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, object]]] = {}
        for stream, output in deliveries:
            self._observe(stream, output, now)
            item = output if output.error is None else EngineDeadError(
                f"the request failed: {output.error}")
            by_loop.setdefault(stream.loop, []).append((stream.queue, item))
        delivered = []
        for loop, items in by_loop.items():
            done = threading.Event()
            if _call(loop, _put_all, items, done):
                delivered.append(done)
            else:  # that event loop is gone
                for stream, output in deliveries:
                    if stream.loop is loop:
                        self.abort(output.request_id)
        return delivered

    def _observe(self, stream: _Stream, output: RequestOutput, now: float) -> None:
        """TTFT, then one ITL per new token (of the request's longest sequence)."""
        completions = output.outputs
        longest = (len(completions[0].token_ids) if len(completions) == 1
                   else max((len(c.token_ids) for c in completions), default=0))
        tokens = stream.num_tokens + longest if stream.delta else longest
        new = tokens - stream.num_tokens
        if self.observer is not None:
            if new > 0 and stream.last_token_time is None:
                self.observer.observe_ttft(now - stream.arrival)
            elif new > 0:
                self.observer.observe_itl((now - stream.last_token_time) / new, new)
            if output.finished:
                self.observer.observe_e2e(now - stream.arrival)
        if new > 0:
            stream.num_tokens, stream.last_token_time = tokens, now

    def _core_gone(self) -> None:
        """The pipe closed: shut down, or the core died. Fail whatever was in flight."""
        if self._stopped:
            error = EngineDeadError("the engine is shut down")
        else:
            self._dead = True
            self._client.join(5)
            error = EngineDeadError(self._client.death_message())
            log.error("%s; failing %d request(s)", error, len(self._streams))
        with self._lock:
            streams, self._streams = self._streams, {}
            for request_id in list(self.output_processor.groups):
                self.output_processor.remove(request_id)
        for stream in streams.values():
            _call(stream.loop, stream.queue.put_nowait, error)
        if self._dead and self.on_core_death is not None:
            self.on_core_death()


def _put_all(items: list[tuple[asyncio.Queue, object]], done: threading.Event) -> None:
    for q, item in items:
        q.put_nowait(item)
    # The readers these puts woke run first (call_soon is FIFO), then `done` is set.
    asyncio.get_running_loop().call_soon(done.set)


def _call(loop: asyncio.AbstractEventLoop, fn, *args) -> bool:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the loop is closed
        return False
    return True
