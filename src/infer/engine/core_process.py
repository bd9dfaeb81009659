"""The engine core behind a pipe: in a process of its own (the server's default) or a thread.

The request side (prompts in, text out: `InputProcessor`, `OutputProcessor`) stays with
the server; the core (scheduler, model runner, sampler) steps on its own, so the server's
per-token work and the core's host work never wait for one GIL.

Messages are tuples, pickled once each; a step's outputs travel as one message however
many sequences it had:

    request side -> core                          core -> request side
    ("add", [(Request, SamplingParams), ...])      ("ready", CoreInfo) | ("failed", ...) once
    ("finish", [(seq_id, reason, stop), ...])      ("outputs", [SequenceOutput, ...]) per step
    ("shutdown",)                                  ("stats", {...}) when something changed or
                                                   every STATS_INTERVAL_S while busy, and idle

A sequence the core cannot add, and the sequences of a step that fails, are answered with
error outputs; the core keeps serving the rest. It exits when told to, or when the pipe
closes (the request side is gone, even killed): a core never outlives its server.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import signal
import threading
import time
from multiprocessing.connection import Connection

from infer.engine.config import EngineConfig
from infer.engine.engine_core import CoreInfo, EngineCore, SequenceOutput, StepFailed, load_core
from infer.engine.request import Request
from infer.engine.setup import freeze_startup_objects
from infer.sampling_params import SamplingParams

log = logging.getLogger(__name__)
STATS_INTERVAL_S = 0.01
_GONE = (EOFError, BrokenPipeError, ConnectionResetError)


class CoreLoop:
    """Apply what the request side sent, step, send what the step did; block when idle."""

    def __init__(self, core: EngineCore, conn: Connection) -> None:
        self.core, self.conn = core, conn
        self.step_errors = 0
        self.num_seqs_added = 0  # lets the request side tell which of its adds are counted
        self._stats_time = 0.0
        self._changed = True  # something the gauges show changed since the last stats

    def run(self) -> None:
        self.core.on_step_start = self._on_step_start
        try:
            while self._apply_commands():
                if self.core.has_unfinished():
                    self._step()
        except _GONE:
            log.info("the request side is gone; the engine core stops")
        finally:
            self.core.on_step_start = None
            self._finish_all("abort")
            self.conn.close()

    def _apply_commands(self) -> bool:
        """Everything that has arrived (waiting for a message when there is nothing to
        step); False once told to shut down."""
        if not self.core.has_unfinished():
            self._send_stats()
            if not self._apply(self.conn.recv()):
                return False
        while self.conn.poll():
            if not self._apply(self.conn.recv()):
                return False
        return True

    def _apply(self, message: tuple) -> bool:
        kind = message[0]
        self._changed = True
        if kind == "add":
            failed = []
            self.num_seqs_added += len(message[1])
            for request, params in message[1]:
                try:
                    self.core.add(request, params)
                except Exception as exc:
                    failed.append(SequenceOutput(request.request_id, [], finish_reason="error",
                                                 error=f"{type(exc).__name__}: {exc}"))
            if failed:
                self.conn.send(("outputs", failed))
        elif kind == "finish":
            for seq_id, reason, stop_reason in message[1]:
                self.core.finish(seq_id, reason, stop_reason)
        elif kind == "shutdown":
            return False
        else:
            raise ValueError(f"unknown message {kind!r} for the engine core")
        return True

    def _step(self) -> None:
        try:
            outputs = self.core.step()
        except StepFailed as exc:
            log.exception("engine step failed; failing its %d sequence(s)", len(exc.seq_ids))
            outputs = self._failed(exc.seq_ids, str(exc))
        except Exception as exc:  # outside any one step (e.g. planning): fail everything
            log.exception("engine core failed; failing every sequence")
            outputs = self._failed(self._finish_all("error"), f"engine core failed: {exc!r}")
        if any(o.finish_reason is not None for o in outputs):
            self._changed = True
        if outputs:
            self.conn.send(("outputs", outputs))

    def _failed(self, seq_ids: list[str], error: str) -> list[SequenceOutput]:
        self.step_errors += 1
        self._send_stats()  # before the error outputs: whoever sees those sees the count
        return [SequenceOutput(s, [], finish_reason="error", error=error) for s in seq_ids]

    def _finish_all(self, reason: str) -> list[str]:
        seq_ids = list(self.core.sequences)
        for seq_id in seq_ids:
            self.core.finish(seq_id, reason)
        return seq_ids

    def _on_step_start(self) -> None:
        if self._changed or time.monotonic() - self._stats_time >= STATS_INTERVAL_S:
            self._send_stats()

    def _send_stats(self) -> None:
        self._changed, self._stats_time = False, time.monotonic()
        self.conn.send(("stats", {**self.core.stats(), "step_errors": self.step_errors,
                                  "num_seqs_added": self.num_seqs_added}))


def run_core_process(config: EngineConfig, conn: Connection) -> None:
    """The core process: load, say ready (or why not), loop until told or orphaned."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the server's to handle
    try:
        core, _, model_name = load_core(config)
    except BaseException as exc:
        conn.send(("failed", isinstance(exc, ValueError), f"{type(exc).__name__}: {exc}"))
        conn.close()
        return
    conn.send(("ready", CoreInfo.of(core, model_name)))
    freeze_startup_objects()
    CoreLoop(core, conn).run()


class CoreClient:
    """The request side's end of the pipe, and the process or thread that runs the core.

    Sends go through one queue and one sender thread, so no caller (an event loop, the
    receiving thread) ever blocks on a full pipe, and messages keep the order they were
    sent in. `recv` is for one reader only."""

    def __init__(self, conn: Connection, runner: multiprocessing.Process | threading.Thread):
        self.conn, self.runner = conn, runner
        self._shut_down = False
        self._outbox: list[tuple | None] = []
        self._ready = threading.Condition()
        self._sender = threading.Thread(target=self._send_loop, name="infer-core-send",
                                        daemon=True)
        self._sender.start()

    @classmethod
    def spawn(cls, config: EngineConfig) -> tuple[CoreClient, CoreInfo]:
        """Start a core process and wait until its model is loaded."""
        ctx = multiprocessing.get_context("spawn")
        conn, child_conn = ctx.Pipe()
        process = ctx.Process(target=run_core_process, args=(config, child_conn),
                              name="infer-core")
        process.start()
        child_conn.close()  # the child's end lives in the child only: its exit is our EOF
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
        return client, message[1]

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
        return self.conn.recv()

    def poll(self) -> bool:
        return self.conn.poll()

    def alive(self) -> bool:
        return self.runner.is_alive()

    @property
    def exitcode(self) -> int | None:
        return getattr(self.runner, "exitcode", None)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Ask the core to stop; a process that does not is terminated, then killed."""
        if self._shut_down:
            return
        self._shut_down = True
        atexit.unregister(self.shutdown)
        self.send(("shutdown",))
        self.send(None)
        self._sender.join(timeout)
        self.runner.join(timeout)
        if isinstance(self.runner, multiprocessing.process.BaseProcess) \
                and self.runner.is_alive():
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
            self.client.runner.join(5)
            raise RuntimeError(
                f"the engine core died (exit code {self.client.exitcode})") from None
        if message[0] == "stats":
            self._stats = message[1]
        elif message[0] == "outputs":
            self._received.append(message[1])

    def shutdown(self) -> None:
        self.client.shutdown()
