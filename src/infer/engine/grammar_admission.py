"""Constrained sequences before the scheduler sees them: each waits, off the step loop, for
its grammar (compiled unless cached) and its matcher in the compile thread (0.2-1.3 ms to
make a matcher, in the library without the GIL), then is admitted; a constraint that fails
to compile, or compiles past the thread's time limit, ends its sequence alone.

The grammar library bound to the model's vocabulary (`StructuredOutputs`) is made when
first needed, or ahead by `warm`; with `EngineConfig.grammar_process` the matchers live in
the grammar worker process (`GrammarProcess`, made with the library), which fills the
step's masks while the loop runs on."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from concurrent import futures
from dataclasses import dataclass

import torch

from infer.engine.config import EngineConfig
from infer.engine.cpu_threads import cpus_off_core, thread_cpu
from infer.engine.grammar_process import GrammarProcess, GrammarWorkerError, RemoteMatcher
from infer.engine.request import Request
from infer.engine.structured_output import CompileThread, GrammarMatcher, StructuredOutputs
from infer.loader.tokenizer import Tokenizer
from infer.sampling_params import SamplingParams

log = logging.getLogger(__name__)

# Rows of the grammar worker's masks where the engine was built without max_num_seqs.
MAX_GRAMMAR_ROWS = 1024
# With nothing to step but grammars compiling, a step waits this long for one.
GRAMMAR_WAIT_S = 0.005

Matcher = GrammarMatcher | RemoteMatcher


@dataclass
class _Compiling:
    """A sequence waiting for its grammar's matcher (made in the compile thread)."""

    request: Request
    params: SamplingParams
    job: futures.Future | None = None
    started: float | None = None  # time.monotonic() when its compile began


class GrammarAdmission:
    """The sequences waiting for their matchers (`waiting`, by id), the compile thread, the
    grammar library and the grammar worker (`process`, None without one)."""

    def __init__(self, config: EngineConfig, tokenizer: Tokenizer | None, vocab_size: int,
                 device: torch.device, max_rows: int, loop_thread: int) -> None:
        """`max_rows`: the most rows a step samples (0: unknown); `loop_thread`: the native
        id of the thread that steps the engine."""
        self.config, self.tokenizer, self.vocab_size = config, tokenizer, vocab_size
        self.device, self.max_rows, self.loop_thread = device, max_rows, loop_thread
        self.waiting: dict[str, _Compiling] = {}
        self.compile_thread = CompileThread()
        self.process: GrammarProcess | None = None  # made with the library
        self._library: StructuredOutputs | None = None
        self._lock = threading.Lock()

    def library(self) -> StructuredOutputs:
        """The grammar library bound to this model's vocabulary (made when first needed,
        or by `warm`, which this then waits for)."""
        with self._lock:
            if self._library is None:
                if self.tokenizer is None:
                    raise ValueError("structured_outputs needs the engine's tokenizer, which "
                                     "this core was built without")
                if self._worker_wanted():
                    # a step samples at most one row per sequence (no drafts here)
                    self.process = GrammarProcess(
                        self.tokenizer, self.vocab_size, self.max_rows or MAX_GRAMMAR_ROWS,
                        self.device, self.config.grammar_threads, self._worker_cpus(),
                        self.config.grammar_workers)
                self._library = StructuredOutputs(self.tokenizer, self.vocab_size,
                                                  self.config.grammar_threads)
        return self._library

    def _worker_cpus(self) -> set[int] | None:
        """With `grammar_worker_apart`, the CPUs off the step loop's physical core (where
        the loop runs now; None where that leaves none or cannot be told)."""
        if not self.config.grammar_worker_apart:
            return None
        cpu = thread_cpu(self.loop_thread)
        return (cpus_off_core(cpu) or None) if cpu is not None else None

    def _worker_wanted(self) -> bool:
        """`grammar_process`, its default resolved: on with CUDA unless drafts are checked
        against grammars on the loop."""
        wanted = self.config.grammar_process
        if wanted is None:
            return self.device.type == "cuda" and self.config.speculative_method == "none"
        return wanted

    def warm(self) -> threading.Thread | None:
        """Set up the grammar library's vocabulary in a thread, so that a server's first
        constrained request does not stall every stream while it is made (SmolLM2's 49k
        vocabulary: 3.3 s on the CPU machine, of which the step loop loses at most 0.3 s
        at a time to the GIL). The caller imports the library first
        (`structured_output.import_grammar_library`), not this thread."""
        if self.tokenizer is None:
            return None

        def warm() -> None:
            try:
                self.library()
            except Exception as exc:  # the first constrained request reports it
                log.warning("structured output is not available: %r", exc)

        thread = threading.Thread(target=warm, name="infer-grammar-vocab", daemon=True)
        thread.start()
        return thread

    def submit(self, request: Request, params: SamplingParams) -> None:
        """Queue `request`'s constraint for the compile thread."""
        waiting = _Compiling(request, params)
        self.waiting[request.request_id] = waiting
        self._submit(waiting)

    def _submit(self, waiting: _Compiling) -> None:
        def compile() -> Matcher:
            waiting.started = time.monotonic()
            library = self.library()
            grammar = library.compile(waiting.params.structured_outputs)
            if self.process is not None:
                return self.process.matcher(grammar)
            return library.matcher(grammar)

        waiting.job = self.compile_thread.submit(compile)

    def admit(self) -> tuple[list[tuple[Request, SamplingParams, Matcher]],
                             list[tuple[str, str]]]:
        """(request, params, matcher) of the sequences whose matchers are ready, in the
        order they came; (id, error) of those whose constraint failed to compile or
        compiled for longer than the compile thread's limit (the grammars queued behind an
        overlong one move to a new thread). Both leave `waiting`."""
        ready, failed = [], []
        now = time.monotonic()
        limit = self.compile_thread.timeout_s
        for seq_id, waiting in list(self.waiting.items()):
            overdue = waiting.started is not None and now - waiting.started > limit
            if not waiting.job.done() and not overdue:
                continue
            del self.waiting[seq_id]
            try:
                if not waiting.job.done():
                    self.compile_thread.abandon()
                    for queued in self.waiting.values():
                        if queued.job.cancel():  # not started: compile it in the new thread
                            self._submit(queued)
                    raise ValueError(
                        f"structured_outputs: {self.compile_thread.timeout_message()}")
                matcher = waiting.job.result()
            except Exception as exc:
                failed.append((seq_id, f"{type(exc).__name__}: {exc}"))
                continue
            ready.append((waiting.request, waiting.params, matcher))
        return ready, failed

    def wait_for_one(self) -> None:
        """Wait a little for a waiting sequence's matcher (a step with nothing else to run:
        no busy loop)."""
        futures.wait([w.job for w in self.waiting.values()], timeout=GRAMMAR_WAIT_S,
                     return_when=futures.FIRST_COMPLETED)

    def forget(self, seq_id: str) -> None:
        """A sequence ended while waiting: its matcher, if made, goes unread."""
        waiting = self.waiting.pop(seq_id, None)
        if waiting is not None and waiting.job.done() and waiting.job.exception() is None:
            self.drop([waiting.job.result()])

    def drop(self, matchers: list[Matcher | None]) -> None:
        """Matchers in the grammar worker whose sequences ended are forgotten there."""
        remote = [m for m in matchers if isinstance(m, RemoteMatcher)]
        if remote and self.process is not None:
            with contextlib.suppress(GrammarWorkerError):
                self.process.drop(remote)

    def close(self) -> None:
        """Stop the grammar worker, if there is one."""
        if self.process is not None:
            self.process.close()
            self.process = None
