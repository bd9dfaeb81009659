"""The engine core behind a pipe: in a process of its own (the server's default) or a thread.

The request side (prompts in, text out: `InputProcessor`, `OutputProcessor`) stays with
the server; the core (scheduler, model runner, sampler) steps on its own, so the server's
per-token work and the core's host work never wait for one GIL.

Messages are tuples, pickled once each; a step's outputs travel as one message however
many sequences it had:

    request side -> core                          core -> request side
    ("add", [(Request, SamplingParams), ...])      ("ready", CoreInfo) | ("failed", ...) once
    ("finish", [(seq_id, reason, stop), ...])      ("outputs", pack_outputs(...)) per step
    ("side_stats", {...}) (several sides only)     ("stats", {...}) when something changed or
    ("shutdown",)                                  every STATS_INTERVAL_S while busy, and idle

A sequence the core cannot add, and the sequences of a step that fails, are answered with
error outputs; the core keeps serving the rest. It exits when told to, or when the pipe
closes (the request side is gone, even killed): a core never outlives its server.

A core may serve several request sides, one pipe each (a server with several API
processes): each step's outputs go to the side that added each sequence, stats to every
side (with that side's own count of sequences added). The first pipe is the server's
own: when it closes, or says shutdown, the core stops; another side that goes away has
its sequences aborted and the core serves on.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import multiprocessing.connection
import signal
import sys
import threading
import time
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

from infer.engine.config import EngineConfig
from infer.engine.core_loading import CoreInfo, load_core
from infer.engine.engine_core import EngineCore, SequenceOutput, StepFailed
from infer.engine.request import Request
from infer.engine.setup import freeze_startup_objects
from infer.engine.structured_output import import_grammar_library
from infer.process_exit import exit_code_unreaped, wait_exited
from infer.sampling_params import SamplingParams

log = logging.getLogger(__name__)
STATS_INTERVAL_S = 0.01
_GONE = (EOFError, BrokenPipeError, ConnectionResetError)


# A step's outputs cross the pipe as columns: pickling a tuple per sequence cost ~1 us
# each (61 against 13 us for 64 sequences, columns built included), on the core's loop.
PackedOutputs = tuple[list[str], list[list[int]], list[int], list[tuple[int, SequenceOutput]]]


def pack_outputs(outputs: list[SequenceOutput]) -> PackedOutputs:
    """The outputs that carry only new tokens as columns (ids, tokens, cached tokens);
    the others (logprobs, a finish, an error, prompt logprobs) whole, with their places."""
    ids, tokens, cached, whole = [], [], [], []
    for place, out in enumerate(outputs):
        if (out.logprobs is None and out.finish_reason is None and out.error is None
                and out.prompt_logprobs is None):
            ids.append(out.seq_id)
            tokens.append(out.new_token_ids)
            cached.append(out.num_cached_tokens)
        else:
            whole.append((place, out))
    return ids, tokens, cached, whole


def unpack_outputs(packed: PackedOutputs) -> list[SequenceOutput]:
    """`pack_outputs`' outputs again, in their order."""
    ids, tokens, cached, whole = packed
    outputs = [SequenceOutput(i, t, None, None, None, None, c)
               for i, t, c in zip(ids, tokens, cached)]
    for place, out in whole:  # in increasing order of place: each lands where it was
        outputs.insert(place, out)
    return outputs


class CoreLoop:
    """Apply what the request sides sent, step, send what the step did; block when idle."""

    def __init__(self, core: EngineCore, conns: Connection | list[Connection]) -> None:
        self.core = core
        self.conns = conns if isinstance(conns, list) else [conns]
        self.main = self.conns[0]  # its end or shutdown stops the core
        self.owner: dict[str, Connection] = {}  # seq id -> the side that added it
        # Lets each side tell which of its adds are counted.
        self.num_seqs_added: dict[Connection, int] = dict.fromkeys(self.conns, 0)
        # Each side's own request counters and latency histograms (when several share
        # this core), passed on to the others so that any side's /metrics shows all.
        self.side_stats: dict[Connection, dict] = {}
        self.step_errors = 0
        # Where the loop's time goes (seconds, cumulative; in the stats): applying what
        # the request sides sent, the core's steps, and sending their outputs.
        self.seconds = {"core_input_seconds": 0.0, "core_step_seconds": 0.0,
                        "core_output_seconds": 0.0}
        self._stats_time = 0.0
        self._changed = True  # something the gauges show changed since the last stats

    def run(self) -> bool:
        """False when the core stopped because it cannot go on (`StepFailed.fatal`)."""
        self.core.on_step_start = self._on_step_start
        try:
            while self._apply_commands():
                if self.core.has_unfinished() and not self._step():
                    return False
        except _GONE:
            log.info("the request side is gone; the engine core stops")
        finally:
            self.core.on_step_start = None
            self._finish_all("abort")
            for conn in self.conns:
                conn.close()
        return True

    def _apply_commands(self) -> bool:
        """Everything that has arrived (waiting for a message when there is nothing to
        step); False once told to shut down."""
        if not self.core.has_unfinished():
            self._send_stats()
            multiprocessing.connection.wait(self.conns)
        start = time.perf_counter()
        try:
            return self._apply_arrived()
        finally:
            self.seconds["core_input_seconds"] += time.perf_counter() - start

    def _apply_arrived(self) -> bool:
        for conn in list(self.conns):
            try:
                while conn.poll():
                    if not self._apply(conn.recv(), conn):
                        return False
            except _GONE:
                if conn is self.main:
                    raise
                self._drop(conn)
        return True

    def _drop(self, conn: Connection) -> None:
        """A request side other than the server's own went away: abort its sequences."""
        log.warning("a request side is gone; aborting its sequences")
        self.conns.remove(conn)
        del self.num_seqs_added[conn]
        self.side_stats.pop(conn, None)
        for seq_id in [s for s, c in self.owner.items() if c is conn]:
            del self.owner[seq_id]
            self.core.finish(seq_id, "abort")
        conn.close()

    def _apply(self, message: tuple, conn: Connection) -> bool:
        kind = message[0]
        self._changed = True
        if kind == "add":
            failed = []
            self.num_seqs_added[conn] += len(message[1])
            for request, params in message[1]:
                try:
                    self.core.add(request, params)
                    self.owner[request.request_id] = conn
                except Exception as exc:
                    failed.append(SequenceOutput(request.request_id, [], finish_reason="error",
                                                 error=f"{type(exc).__name__}: {exc}"))
            if failed:
                conn.send(("outputs", pack_outputs(failed)))
        elif kind == "finish":
            for seq_id, reason, stop_reason in message[1]:
                self.core.finish(seq_id, reason, stop_reason)
                self.owner.pop(seq_id, None)
        elif kind == "side_stats":
            self.side_stats[conn] = message[1]
        elif kind == "shutdown":
            return conn is not self.main
        else:
            raise ValueError(f"unknown message {kind!r} for the engine core")
        return True

    def _step(self) -> bool:
        """False when the core cannot go on: every sequence has been failed."""
        start = time.perf_counter()
        try:
            outputs = self.core.step()
        except StepFailed as exc:
            if exc.fatal:
                log.error("%s; failing every sequence and stopping the engine core", exc)
                seq_ids = exc.seq_ids + self._finish_all("error")
                self._send_outputs(self._failed(seq_ids, str(exc)))
                return False
            log.exception("engine step failed; failing its %d sequence(s)", len(exc.seq_ids))
            outputs = self._failed(exc.seq_ids, str(exc))
        except Exception as exc:  # outside any one step (e.g. planning): fail everything
            log.exception("engine core failed; failing every sequence")
            outputs = self._failed(self._finish_all("error"), f"engine core failed: {exc!r}")
        stepped = time.perf_counter()
        self.seconds["core_step_seconds"] += stepped - start
        if any(o.finish_reason is not None for o in outputs):
            self._changed = True
        if outputs:
            self._send_outputs(outputs)
            self.seconds["core_output_seconds"] += time.perf_counter() - stepped
        return True

    def _send_outputs(self, outputs: list[SequenceOutput]) -> None:
        """Each output to the side that added its sequence."""
        if len(self.conns) == 1:
            self.main.send(("outputs", pack_outputs(outputs)))
            for output in outputs:
                if output.finish_reason is not None:
                    self.owner.pop(output.seq_id, None)
            return
        by_side: dict[Connection, list[SequenceOutput]] = {}
        for output in outputs:
            conn = (self.owner.pop(output.seq_id, None) if output.finish_reason is not None
                    else self.owner.get(output.seq_id))
            by_side.setdefault(conn or self.main, []).append(output)
        for conn, batch in by_side.items():
            self._send(conn, ("outputs", pack_outputs(batch)))

    def _send(self, conn: Connection, message: tuple) -> None:
        try:
            conn.send(message)
        except _GONE:
            if conn is self.main:
                raise
            self._drop(conn)

    def _failed(self, seq_ids: list[str], error: str) -> list[SequenceOutput]:
        self.step_errors += 1
        self._send_stats()  # before the error outputs: whoever sees those sees the count
        return [SequenceOutput(s, [], finish_reason="error", error=error) for s in seq_ids]

    def _finish_all(self, reason: str) -> list[str]:
        seq_ids = self.core.unfinished_ids()
        for seq_id in seq_ids:
            self.core.finish(seq_id, reason)
        return seq_ids

    def _on_step_start(self) -> None:
        if self._changed or time.monotonic() - self._stats_time >= STATS_INTERVAL_S:
            self._send_stats()

    def _send_stats(self) -> None:
        self._changed, self._stats_time = False, time.monotonic()
        stats = {**self.core.stats(), **self.seconds, "step_errors": self.step_errors,
                 "num_sides": len(self.conns)}
        for conn in list(self.conns):
            mine = {"num_seqs_added": self.num_seqs_added[conn]}
            if len(self.conns) > 1:
                mine["sides"] = [v for c, v in self.side_stats.items() if c is not conn]
            self._send(conn, ("stats", {**stats, **mine}))


def run_core_process(config: EngineConfig, conns: list[Connection]) -> None:
    """The core process: load, say ready (or why not) to every request side, loop until
    told or orphaned."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the server's to handle
    try:
        core, _, model_name = load_core(config)
    except BaseException as exc:
        for conn in conns:
            conn.send(("failed", isinstance(exc, ValueError), f"{type(exc).__name__}: {exc}"))
            conn.close()
        return
    for conn in conns:
        conn.send(("ready", CoreInfo.of(core, model_name)))
    import_grammar_library()
    freeze_startup_objects()
    warming = core.warm_structured_outputs()
    went_on = CoreLoop(core, conns).run()
    core.shutdown()
    if warming is not None:  # a thread still in native code at exit aborts the process
        warming.join(30)
    if not went_on:
        sys.exit(1)


class CoreClient:
    """The request side's end of the pipe, and the process or thread that runs the core.

    Sends go through one queue and one sender thread, so no caller (an event loop, the
    receiving thread) ever blocks on a full pipe, and messages keep the order they were
    sent in. `recv` is for one reader only."""

    def __init__(self, conn: Connection,
                 runner: multiprocessing.Process | threading.Thread | None):
        # runner None: a core this process did not start (another API server's), known
        # only through the pipe.
        self.conn, self.runner = conn, runner
        self._shut_down = self._gone = False
        self._outbox: list[tuple | None] = []
        self._ready = threading.Condition()
        self._sender = threading.Thread(target=self._send_loop, name="infer-core-send",
                                        daemon=True)
        self._sender.start()

    @classmethod
    def spawn(cls, config: EngineConfig) -> tuple[CoreClient, CoreInfo]:
        """Start a core process and wait until its model is loaded."""
        client, info, _ = cls.spawn_shared(config, 1)
        return client, info

    @classmethod
    def spawn_shared(cls, config: EngineConfig, sides: int
                     ) -> tuple[CoreClient, CoreInfo, list[Connection]]:
        """A core process that serves `sides` request sides: this one's client, and the
        pipe ends for the other sides (for other processes: `attach`; close them here
        once handed over)."""
        ctx = multiprocessing.get_context("spawn")
        pairs = [ctx.Pipe() for _ in range(sides)]
        process = ctx.Process(target=run_core_process, args=(config, [c for _, c in pairs]),
                              name="infer-core")
        process.start()
        for _, child_conn in pairs:  # the child's ends live in the child only: its exit
            child_conn.close()       # is our EOF
        conn = pairs[0][0]
        while not conn.poll(0.1):
            if not process.is_alive():
                raise RuntimeError("the engine core exited while loading the model (exit "
                                   f"code {process.exitcode})")
        message = conn.recv()
        if message[0] == "failed":
            process.join()
            _, is_value_error, text = message
            raise (ValueError if is_value_error else RuntimeError)(text)
        client = cls(conn, process)
        atexit.register(client.shutdown)  # before multiprocessing's own exit hook joins it
        return client, message[1], [parent for parent, _ in pairs[1:]]

    @classmethod
    def attach(cls, conn: Connection) -> tuple[CoreClient, CoreInfo]:
        """A request side of a core another process started (`spawn_shared`)."""
        message = conn.recv()
        if message[0] != "ready":
            raise RuntimeError(f"the engine core did not start: {message[-1]}")
        return cls(conn, None), message[1]

    @classmethod
    def in_thread(cls, core: EngineCore) -> CoreClient:
        """The same loop and messages with the core in a thread of this process (tests,
        and a core shared with an offline engine)."""
        conn, child_conn = multiprocessing.Pipe()
        thread = threading.Thread(target=CoreLoop(core, child_conn).run, name="infer-core",
                                  daemon=True)
        thread.start()
        return cls(conn, thread)

    def send(self, message: tuple) -> None:
        with self._ready:
            self._outbox.append(message)
            self._ready.notify()

    def recv(self) -> tuple:
        try:
            return self.conn.recv()
        except _GONE:
            self._gone = True
            raise

    def poll(self, timeout: float = 0.0) -> bool:
        return self.conn.poll(timeout)

    def alive(self) -> bool:
        return self.runner.is_alive() if self.runner is not None else not self._gone

    def join(self, timeout: float) -> None:
        """Wait for the core to end, if this process started it (a process is left for
        `shutdown` to reap: process_exit.py)."""
        if isinstance(self.runner, BaseProcess):
            wait_exited(self.runner, timeout)
        elif self.runner is not None:
            self.runner.join(timeout)

    @property
    def exitcode(self) -> int | None:
        if isinstance(self.runner, BaseProcess):
            return exit_code_unreaped(self.runner)
        return None

    def death_message(self) -> str:
        """What to tell the requests in flight; the exit code where this process knows it
        (it started the core, and the core has exited)."""
        code = self.exitcode
        return "the engine core died" + ("" if code is None else f" (exit code {code})")

    def shutdown(self, timeout: float = 10.0) -> None:
        """Ask the core to stop; a process that does not is terminated, then killed."""
        if self._shut_down:
            return
        self._shut_down = True
        atexit.unregister(self.shutdown)
        self.send(("shutdown",))
        self.send(None)
        self._sender.join(timeout)
        if self.runner is None:
            return
        self.runner.join(timeout)
        if isinstance(self.runner, BaseProcess) and self.runner.is_alive():
            log.warning("the engine core did not stop in %.0f s; terminating it", timeout)
            self.runner.terminate()
            self.runner.join(5)
            if self.runner.is_alive():
                self.runner.kill()
                self.runner.join()

    def _send_loop(self) -> None:
        while True:
            with self._ready:
                while not self._outbox:
                    self._ready.wait()
                batch, self._outbox = self._outbox, []
            for message in batch:
                if message is None:
                    return
                try:
                    self.conn.send(message)
                except OSError:  # the core is gone; the receiver reports it
                    return


class RemoteCore:
    """The EngineCore calls an LLMEngine makes (add, finish, step, stats), over a
    CoreClient: an offline engine whose core runs in a process of its own
    (`EngineConfig.core_process`). Adds wait for the next `step`, which sends them in one
    message and returns the next step's outputs from the core (waiting for them)."""

    def __init__(self, client: CoreClient) -> None:
        self.client = client
        self.sequences: set[str] = set()  # added here, not yet seen to finish
        self._adds: list[tuple[Request, SamplingParams]] = []
        self._received: list[list[SequenceOutput]] = []  # outputs read by `stats`
        self._stats: dict[str, float] = {}

    def add(self, request: Request, params: SamplingParams) -> None:
        self._adds.append((request, params))
        self.sequences.add(request.request_id)

    def finish(self, seq_id: str, reason: str, stop_reason: int | str | None = None) -> None:
        if seq_id in self.sequences:
            self.sequences.discard(seq_id)
            self.client.send(("finish", [(seq_id, reason, stop_reason)]))

    def has_unfinished(self) -> bool:
        return bool(self.sequences)

    def step(self) -> list[SequenceOutput]:
        if self._adds:
            self.client.send(("add", self._adds))
            self._adds = []
        while not self._received:
            self._read()
        outputs = self._received.pop(0)
        for output in outputs:
            if output.finish_reason is not None:
                self.sequences.discard(output.seq_id)
        return outputs

    def stats(self) -> dict[str, float]:
        """The core's counters as of its last report (reports that have come are read)."""
        while self.client.poll():
            self._read()
        return dict(self._stats)

    def _read(self) -> None:
        try:
            message = self.client.recv()
        except (EOFError, OSError):
            self.sequences.clear()
            self.client.join(5)
            raise RuntimeError(self.client.death_message()) from None
        if message[0] == "stats":
            self._stats = message[1]
        elif message[0] == "outputs":
            self._received.append(unpack_outputs(message[1]))

    def shutdown(self) -> None:
        self.client.shutdown()
