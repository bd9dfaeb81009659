"""The step loop's side of the grammar workers (`grammar_worker.py`): constrained sequences'
matchers live in those processes, and a constrained step costs the loop no message and a
few queued device operations instead of the grammar work itself.

A step s with constrained rows, on CUDA: `masks` writes the fill of s into the shared block
(no message: the workers watch for it) and queues, on a stream of its own, a wait for each
worker's `masks_ready >= s` (a CUDA stream memory operation on the block) and the masks'
copy from the block, which the step's stream waits for (an event) before it samples: the
copy runs beside the forward, not after it. The sampler applies the masks in its own
pass. After the sampling, `publish` queues the sampled ids' copy into the block and a
stream write of the stamp s, which the workers watch for, and an event the next step's
copy waits for (one buffer of masks on the device). The loop reads the workers' verdicts
on s (a grammar finished, a token refused, a matcher the library would not make) when it
accounts s. On the CPU the loop waits for the masks itself and writes the ids. The
device's side goes through the driver's entry points directly: torch's copies and stream
lookups cost the loop more than the work they queue.

A stream wait has no time limit, so a watchdog thread ends the workers once one has
exited or left a step's masks unfilled for WORKER_WAIT_S, and then releases the device's
waits.
"""

from __future__ import annotations

import contextlib
import itertools
import multiprocessing
import os
import subprocess
import sys
import threading
import time
import weakref
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path

import numpy as np
import torch

from infer.cuda_driver import cuda_driver
from infer.engine.cpu_threads import usable_cores
from infer.engine.grammar_worker import (
    FAILED,
    FED,
    FILL_SLOTS,
    FILLS,
    FILLS_TAKEN,
    LANE_WORDS,
    MASKS_READY,
    NOTED,
    REFUSED,
    STOPPED,
    TOKENS_STAMP,
    SharedLayout,
    make_shared,
)
from infer.engine.structured_output import library_tokenizer_json
from infer.loader.tokenizer import Tokenizer

# How long the loop waits for the worker (masks on the CPU, verdicts, a step's masks on
# the device) before it takes the worker for broken.
WORKER_WAIT_S = 10.0
SPIN_S = 50e-6
# Past any step number: written to `masks_ready` to release the device's waits.
RELEASED = 2**62


class GrammarWorkerError(RuntimeError):
    """The grammar worker did not answer in time, or has exited."""


@dataclass(eq=False)
class RemoteMatcher:
    """A constrained sequence's matcher, held by the worker under `id`."""

    id: int
    terminated: bool = False  # the worker said its grammar is finished


@dataclass
class Verdicts:
    """The worker's word on a step's masked rows."""

    refused: list[int]  # rows whose token the grammar did not allow (a bug if any)
    failed: list[int]  # rows whose matcher the library would not make
    stopped: list[int]  # rows whose grammar this token finished


class GrammarProcess:
    """The grammar workers (`workers` processes; None: `default_workers`) for one tokenizer
    and logits width, masks for up to `rows` rows a step, on `device`; each worker's
    library on `threads` threads (0: the library's default with one worker, else
    `worker_threads`), on `cpus` (None: any of this process's)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, rows: int,
                 device: torch.device, threads: int = 0, cpus: set[int] | None = None,
                 workers: int | None = 1) -> None:
        self.vocab_size, self.rows, self.device = vocab_size, rows, device
        available = len(cpus) if cpus else usable_cores()
        workers = workers or default_workers(available)
        words = (vocab_size + 31) // 32
        name = f"infer-grammar-{os.getpid()}-{id(self):x}"
        self._block, self._shm = make_shared(name, SharedLayout.size(rows, words, workers))
        # At the latest when the interpreter exits: a script that never shuts its engine
        # down leaves no name behind for the resource tracker to warn of.
        self._unlink = weakref.finalize(self, self._shm.unlink)
        self.layout = SharedLayout(memoryview(self._block), rows, words, workers)
        self.layout.header[:] = 0
        self.layout.lanes[:] = 0
        self._lanes = list(self.layout.lanes)
        self._on_cuda = device.type == "cuda"
        if self._on_cuda:
            self._driver = cuda_driver()
            self._register()
        if workers > 1 and not threads:
            threads = worker_threads(available, workers)
        self.processes: list[subprocess.Popen] = []
        self._pipes: list[Connection] = []
        tokenizer_json = library_tokenizer_json(tokenizer)
        for index in range(workers):
            reader, writer = multiprocessing.Pipe(duplex=False)
            self.processes.append(_start_worker(reader))
            reader.close()
            writer.send((name, rows, words, workers, index, tokenizer_json, vocab_size,
                         list(tokenizer.eos_token_ids), self._on_cuda, threads,
                         sorted(cpus) if cpus else None))
            self._pipes.append(writer)
        self._send_lock = threading.Lock()  # the loop and the compile thread both send
        self._published = 0  # the last step whose ids the device was asked to publish
        self._stream = 0  # the CUDA stream of the step being launched
        self._ids = itertools.count(1)
        self._step = 0
        # The last step's masked (row, matcher) pairs and their ids and rows as arrays: a
        # step of the same rows writes those (building them took 0.02-0.04 ms at 256 rows)
        self._last_masked: list[tuple[int, RemoteMatcher]] | None = None
        self._last_ids = self._last_rows = np.zeros(0, dtype=np.int64)
        self.failure: str | None = None  # why the workers are taken for broken
        self._closed = threading.Event()
        threading.Thread(target=self._watch, name="infer-grammar-watch", daemon=True).start()

    def _register(self) -> None:
        """Pin the shared block for the device, and views of it it can use."""
        address = self.layout.header.__array_interface__["data"][0]
        code = torch.cuda.cudart().cudaHostRegister(address, len(self._block), 0)
        if int(code) != 0:
            raise RuntimeError(f"cudaHostRegister of the grammar worker's block: {code}")
        self._registered = address
        device_address = self._driver.device_pointer(address)
        lanes = self.layout.lanes.__array_interface__["data"][0] - address
        self._masks_ready = [device_address + lanes + 8 * (LANE_WORDS * index + MASKS_READY)
                             for index in range(self.layout.workers)]
        self._tokens_stamp = device_address + 8 * TOKENS_STAMP
        self._host_masks = torch.from_numpy(self.layout.masks)
        self._host_tokens = torch.from_numpy(self.layout.tokens)
        if not (self._host_masks.is_pinned() and self._host_tokens.is_pinned()):
            raise RuntimeError("the grammar worker's block is not pinned after registering")
        self._device_masks = torch.empty(self._host_masks.shape, dtype=torch.int32,
                                         device=self.device)
        # The masks' wait and copy go on a stream of their own, so that they run while the
        # step's forward does: `masks_copied` orders the sampling after them, `masks_used`
        # (recorded after a step's sampling) the next copy after that sampling.
        self._copy_stream = torch.cuda.Stream(self.device)
        self._masks_copied = self._driver.event()
        self._masks_used = self._driver.event()
        self._device_index = torch.cuda._utils._get_device_index(self.device, optional=True)

    # -- matchers (from the thread that compiles grammars) ----------------------------
    def matcher(self, grammar: str) -> RemoteMatcher:
        """A matcher for a checked grammar, made in its worker before any step of it (the
        messages keep their order); should the library refuse it there, the sequence's
        first step says so (`Verdicts.failed`)."""
        self._check_usable()
        matcher = RemoteMatcher(next(self._ids))
        self._send(("make", matcher.id, grammar), matcher.id % len(self._pipes))
        return matcher

    def drop(self, matchers: list[RemoteMatcher]) -> None:
        """The workers forget these matchers (their sequences ended)."""
        if not matchers or self.failure is not None:
            return
        workers = len(self._pipes)
        for index in range(workers):
            if ids := [m.id for m in matchers if m.id % workers == index]:
                self._send(("drop", ids), index)

    # -- a step ------------------------------------------------------------------------
    def masks(self, rows: int, masked: list[tuple[int, RemoteMatcher]]
              ) -> tuple[int, torch.Tensor]:
        """The token bitmasks of a step's first `rows` rows, for the sampler: the `masked`
        (row, matcher) rows' once the worker has filled them, every other row allowing
        every token; and the step's number, for `publish` and `verdicts`."""
        self._check_usable()
        step = self._step + 1
        layout = self.layout
        self._wait_for(FILLS_TAKEN, step - FILL_SLOTS, "fill's taking")  # its slot is free
        slot = step % FILL_SLOTS
        if masked != self._last_masked:  # (row, matcher) pairs: matchers by identity
            self._last_masked = masked
            self._last_ids = np.fromiter((m.id for _, m in masked), np.int64, len(masked))
            self._last_rows = np.fromiter((row for row, _ in masked), np.int64, len(masked))
        layout.request_ids[slot, :len(masked)] = self._last_ids
        layout.request_rows[slot, :len(masked)] = self._last_rows
        layout.requests[slot] = (rows, len(masked), self._published)
        self._step = step
        layout.header[FILLS] = step
        if not self._on_cuda:
            self._wait_for(MASKS_READY, step, "masks")
            return step, torch.from_numpy(layout.masks[:rows])
        ops, masks = self._driver, self._device_masks[:rows]
        self._stream = stream = torch._C._cuda_getCurrentRawStream(self._device_index)
        copy = self._copy_stream.cuda_stream
        ops.wait_event(copy, self._masks_used)
        for masks_ready in self._masks_ready:
            ops.wait_at_least(copy, masks_ready, step)
        ops.copy_to_device(copy, masks.data_ptr(), self._host_masks.data_ptr(),
                           masks.numel() * 4)
        ops.record(self._masks_copied, copy)
        ops.wait_event(stream, self._masks_copied)
        return step, masks

    def publish(self, step: int, token_ids: torch.Tensor) -> None:
        """Hand the workers the step's sampled ids (`token_ids`, one per row) to feed the
        matchers of the rows its `masks` named."""
        n = len(token_ids)
        if self._on_cuda:
            if token_ids.dtype == torch.int64 and token_ids.is_contiguous():
                self._driver.copy_to_host(self._stream, self._host_tokens.data_ptr(),
                                          token_ids.data_ptr(), n * 8)
            else:
                self._host_tokens[:n].copy_(token_ids, non_blocking=True)
            self._driver.write(self._stream, self._tokens_stamp, step)
            self._driver.record(self._masks_used, self._stream)
        else:
            self.layout.tokens[:n] = token_ids.numpy()
            self.layout.header[TOKENS_STAMP] = step
        self._published = step

    def verdicts(self, step: int, masked: list[tuple[int, RemoteMatcher]]) -> Verdicts:
        """Once the step's ids are on the host: the workers' word on each masked row; a
        finished grammar's matcher is marked `terminated`. GrammarWorkerError if a worker
        failed the step."""
        self._check_usable()
        self._wait_for(FED, step, "verdicts")
        self._check_usable()  # the watchdog may have released the step's wait
        out = Verdicts([], [], [])
        if all(lane[NOTED + step % 2] != step for lane in self._lanes):  # every row took it
            return out
        verdicts = self.layout.verdicts[step % 2]
        for row, matcher in masked:
            verdict = verdicts[row]
            if verdict == REFUSED:
                out.refused.append(row)
            elif verdict == FAILED:
                out.failed.append(row)
            elif verdict == STOPPED:
                matcher.terminated = True
                out.stopped.append(row)
        return out

    # -- upkeep ------------------------------------------------------------------------
    def _lowest(self, slot: int) -> int:
        """The lowest of the workers' counters `slot`."""
        return min(int(lane[slot]) for lane in self._lanes)

    def _wait_for(self, slot: int, step: int, what: str) -> None:
        start = time.monotonic()
        while self._lowest(slot) < step:
            waited = time.monotonic() - start
            if self.failure is not None or waited > WORKER_WAIT_S or not self.alive():
                self._fail(self.failure or f"a grammar worker sent no {what} in "
                           f"{WORKER_WAIT_S:g} s ({self._exit_codes()})")
            # Spinning on sleep(0) keeps the GIL from this process's other threads (the
            # grammar compiles) for up to a switch interval: past a short spin, sleep.
            time.sleep(0 if waited < SPIN_S else SPIN_S)

    def _watch(self) -> None:
        """End the workers once one exited or left the device waiting on a step's masks
        for WORKER_WAIT_S, and release the device's waits."""
        behind_since = None
        while not self._closed.wait(0.1):
            if self.failure is not None:
                return
            if not self.alive():
                self._give_up(f"a grammar worker exited ({self._exit_codes()})")
                return
            if self._lowest(MASKS_READY) >= self._step:
                behind_since = None
            elif behind_since is None:
                behind_since = time.monotonic()
            elif time.monotonic() - behind_since > WORKER_WAIT_S:
                self._give_up(f"a grammar worker filled no masks in {WORKER_WAIT_S:g} s")
                return

    def _give_up(self, why: str) -> None:
        if self.failure is None:
            self.failure = why
        for process in self.processes:
            if process.poll() is None:
                process.kill()
            process.wait()
        self.layout.lanes[:, MASKS_READY] = RELEASED  # the device's waits pass; rows void

    def _send(self, message: tuple, worker: int) -> None:
        try:
            with self._send_lock:
                self._pipes[worker].send(message)
        except OSError as exc:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.processes[worker].wait(timeout=1)
            self._fail(f"a grammar worker exited ({self._exit_codes()}; {exc!r})")

    def alive(self) -> bool:
        return all(process.poll() is None for process in self.processes)

    def _exit_codes(self) -> str:
        return "exit codes " + ", ".join(str(p.returncode) for p in self.processes)

    def _check_usable(self) -> None:
        if self.failure is not None:
            raise GrammarWorkerError(self.failure)

    def _fail(self, why: str) -> None:
        self._give_up(why)
        raise GrammarWorkerError(self.failure)

    def close(self) -> None:
        """Stop the workers, unlink the block's name (and release its registration)."""
        self._closed.set()
        for pipe in self._pipes:
            pipe.close()
        for process in self.processes:
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self._unlink()  # the mappings live on until unmapped
        if self._on_cuda:
            torch.cuda.synchronize(self.device)  # nothing queued uses the block any more
            torch.cuda.cudart().cudaHostUnregister(self._registered)
            for event in (self._masks_copied, self._masks_used):
                self._driver.destroy(event)


def default_workers(cpus: int) -> int:
    """Grammar workers on `cpus` CPUs: two where there are 8 or more (on an H200's host of
    16, a 256-row JSON-schema step 1.14x a plain one in the median of five runs with two,
    1.25-1.39x with one, 1.13-1.15x with three or four: docs/performance.md, "Eighteenth
    pass"), else one."""
    return 2 if cpus >= 8 else 1


def worker_threads(cpus: int, workers: int) -> int:
    """Each of `workers` (more than one) grammar workers' library threads on `cpus` CPUs:
    half the library's own default (80 % of the CPUs, at most 32) shared out among them,
    the rest left to their spinning threads and the step loop (on an H200's host of 16,
    3 threads each: a 256-row JSON-schema step 2.04-2.30 ms in five runs, against
    1.99-3.59 ms in nine with 6 each: docs/performance.md, "Eighteenth pass")."""
    return max(1, min(32, cpus * 4 // 5) // 2 // workers)


def _start_worker(steps: Connection) -> subprocess.Popen:
    """`grammar_worker.main` in a fresh interpreter reading `steps` (its file descriptor
    passed down). Not multiprocessing's spawn: that runs the parent's main script again in
    the child, which a script without a `__main__` guard (`LLM(...)` at its top level) would
    take for a second engine."""
    package_root = str(Path(__file__).resolve().parents[2])  # the folder holding `infer`
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [package_root, *filter(None, [env.get("PYTHONPATH")])])
    fd = steps.fileno()
    return subprocess.Popen(
        [sys.executable, "-c", f"from infer.engine.grammar_worker import main; main({fd})"],
        pass_fds=(fd,), env=env, stdin=subprocess.DEVNULL)
