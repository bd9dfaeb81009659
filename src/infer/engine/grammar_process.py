"""The step loop's side of the grammar worker (`grammar_worker.py`): constrained sequences'
matchers live in that process, and a constrained step costs the loop two messages and a
few queued device operations instead of the grammar work itself.

A step s with constrained rows, on CUDA: `mask` sends ("fill", s) and queues a wait for
the worker's `masks_ready >= s` (a one-program kernel polling host memory), the masks'
copy from the shared block and the bitmask kernel; after the sampling, `publish` queues
the sampled ids' write into the shared block (then its stamp) and sends ("feed", s). The
loop reads the worker's verdicts on s (a grammar finished, or a token refused) when it
accounts s. On the CPU the loop waits for the masks itself and writes the ids.
"""

from __future__ import annotations

import copy
import itertools
import multiprocessing
import os
import threading
import time
from dataclasses import dataclass

import torch

from infer.engine import grammar_worker
from infer.engine.grammar_worker import (
    FED,
    GAVE_UP,
    MASKS_READY,
    REFUSED,
    STOPPED,
    TOKENS_STAMP,
    SharedLayout,
    map_shared,
)
from infer.kernels.reference import apply_token_bitmask_ref
from infer.loader.tokenizer import Tokenizer
from infer.transfer import to_device

# How long the loop waits for the worker (masks on the CPU, verdicts, a new matcher)
# before it takes the worker for broken.
WORKER_WAIT_S = 10.0
SPIN_S = 50e-6


class GrammarWorkerError(RuntimeError):
    """The grammar worker did not answer in time, or has exited."""


@dataclass(eq=False)
class RemoteMatcher:
    """A constrained sequence's matcher, held by the worker under `id`."""

    id: int
    terminated: bool = False  # the worker said its grammar is finished


class GrammarProcess:
    """The grammar worker for one tokenizer and logits width, masks for up to `rows` rows
    a step, on `device`."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, rows: int,
                 device: torch.device) -> None:
        self.vocab_size, self.rows, self.device = vocab_size, rows, device
        words = (vocab_size + 31) // 32
        # The worker unlinks the block's name once it has mapped it too.
        name = f"infer-grammar-{os.getpid()}-{id(self):x}"
        self._block = map_shared(name, SharedLayout.size(rows, words))
        self.layout = SharedLayout(memoryview(self._block), rows, words)
        self.layout.header[:] = 0
        self._on_cuda = device.type == "cuda"
        if self._on_cuda:
            self._register()
        backend = copy.copy(tokenizer.backend)  # the library reads its JSON, unpadded
        backend.no_padding()
        backend.no_truncation()
        ctx = multiprocessing.get_context("spawn")
        self._control, worker_control = ctx.Pipe()
        self._steps, worker_steps = ctx.Pipe(duplex=False)[::-1]
        self.process = ctx.Process(
            target=grammar_worker.serve, name="infer-grammar", daemon=True,
            args=(name, rows, words, backend.to_str(), vocab_size,
                  list(tokenizer.eos_token_ids), worker_control, worker_steps))
        self.process.start()
        worker_control.close()
        worker_steps.close()
        self._control_lock = threading.Lock()
        self._ids = itertools.count(1)
        self._step = 0
        self.failure: str | None = None  # why the worker is taken for broken

    def _register(self) -> None:
        """Pin the shared block for the device, and views of it it can use."""
        address = self.layout.header.__array_interface__["data"][0]
        cudart = torch.cuda.cudart()
        code = cudart.cudaHostRegister(address, len(self._block), 0)
        if int(code) != 0:
            raise RuntimeError(f"cudaHostRegister of the grammar worker's block: {code}")
        self._registered = address
        from infer.kernels.host_signal import HostWords

        def words(slot: int) -> HostWords:
            return HostWords(address + 8 * slot)

        self._masks_ready, self._gave_up = words(MASKS_READY), words(GAVE_UP)
        self._tokens_stamp = words(TOKENS_STAMP)
        self._tokens = HostWords(address + self.layout.offset_of(self.layout.tokens))
        self._host_masks = torch.from_numpy(self.layout.masks)
        if not self._host_masks.is_pinned():
            raise RuntimeError("the grammar worker's block is not pinned after registering")
        self._device_masks = torch.empty(self._host_masks.shape, dtype=torch.int32,
                                         device=self.device)

    # -- matchers (called from the thread that compiles grammars) ---------------------------
    def matcher(self, grammar: str) -> RemoteMatcher:
        """A new matcher for a compiled grammar, made in the worker; ValueError if the
        library refuses it."""
        self._check_usable()
        self._check_alive()
        matcher_id = next(self._ids)
        with self._control_lock:
            self._control.send(("make", matcher_id, grammar))
            deadline = time.monotonic() + WORKER_WAIT_S
            while True:  # answers to callers that gave up before are skipped
                left = deadline - time.monotonic()
                if left <= 0 or not self._control.poll(left):
                    self._check_alive()
                    raise GrammarWorkerError(
                        f"the grammar worker made no matcher in {WORKER_WAIT_S:g} s")
                answer_id, error = self._control.recv()
                if answer_id == matcher_id:
                    break
        if error is not None:
            raise ValueError(f"structured_outputs: {error}")
        return RemoteMatcher(matcher_id)

    def drop(self, matchers: list[RemoteMatcher]) -> None:
        """The worker forgets these matchers (their sequences ended)."""
        if matchers and self.failure is None:
            self._send(("drop", [m.id for m in matchers]))

    # -- a step ------------------------------------------------------------------------
    def mask(self, logits: torch.Tensor, masked: list[tuple[int, RemoteMatcher]]) -> int:
        """Disallowed tokens -> -inf on the `masked` (row, matcher) rows once the worker has
        filled them; the step's number, for `publish` and `verdicts`."""
        self._check_usable()
        self._step += 1
        step = self._step
        rows = [row for row, _ in masked]
        self._send(("fill", step, [m.id for _, m in masked], rows))
        n = max(rows) + 1
        index = torch.tensor(rows, dtype=torch.int64)
        with torch.inference_mode():  # the logits are inference tensors
            if self._on_cuda:
                from infer.kernels.host_signal import wait_for_host
                from infer.kernels.token_bitmask import apply_token_bitmask

                wait_for_host(self._masks_ready, self._gave_up, step)
                self._device_masks[:n].copy_(self._host_masks[:n], non_blocking=True)
                apply_token_bitmask(logits, self._device_masks[:n],
                                    to_device(index, self.device))
            else:
                self._wait_for(MASKS_READY, step, "masks")
                apply_token_bitmask_ref(logits, torch.from_numpy(self.layout.masks[:n]).clone(),
                                        index)
        return step

    def publish(self, step: int, token_ids: torch.Tensor,
                masked: list[tuple[int, RemoteMatcher]]) -> None:
        """Hand the worker the step's sampled ids (`token_ids`, one per row) to feed the
        `masked` rows' matchers."""
        if self._on_cuda:
            from infer.kernels.host_signal import publish_to_host

            publish_to_host(token_ids, self._tokens, self._tokens_stamp, step)
        else:
            self.layout.tokens[:len(token_ids)] = token_ids.numpy()
            self.layout.header[TOKENS_STAMP] = step
        self._send(("feed", step, [m.id for _, m in masked], [row for row, _ in masked]))

    def verdicts(self, step: int, masked: list[tuple[int, RemoteMatcher]]) -> list[int]:
        """Once the step's ids are on the host: the worker's word on each masked row;
        a finished grammar's matcher is marked `terminated`. Returns the rows whose token
        the grammar refused. GrammarWorkerError if the worker failed the step."""
        self._check_usable()
        if self.layout.header[GAVE_UP] != 0:
            self._fail("the device waited too long for the grammar worker's masks")
        self._wait_for(FED, step, "verdicts")
        verdicts = self.layout.verdicts[step % 2]
        refused = []
        for row, matcher in masked:
            verdict = verdicts[row]
            if verdict == REFUSED:
                refused.append(row)
            elif verdict == STOPPED:
                matcher.terminated = True
        return refused

    # -- upkeep ------------------------------------------------------------------------
    def _wait_for(self, slot: int, step: int, what: str) -> None:
        header = self.layout.header
        if header[slot] >= step:
            return
        start = time.monotonic()
        while header[slot] < step:
            waited = time.monotonic() - start
            if waited > WORKER_WAIT_S or not self.process.is_alive():
                self._check_alive()
                self._fail(f"the grammar worker sent no {what} in {WORKER_WAIT_S:g} s")
            # Spinning on sleep(0) keeps the GIL from this process's other threads (the
            # grammar compiles) for up to a switch interval: past a short spin, sleep.
            time.sleep(0 if waited < SPIN_S else SPIN_S)

    def _send(self, message: tuple) -> None:
        try:
            self._steps.send(message)
        except OSError as exc:
            self._fail(f"the grammar worker is gone ({exc!r})")

    def _check_alive(self) -> None:
        if not self.process.is_alive():
            self._fail(f"the grammar worker exited (code {self.process.exitcode})")

    def _check_usable(self) -> None:
        if self.failure is not None:
            raise GrammarWorkerError(self.failure)

    def _fail(self, why: str) -> None:
        if self.failure is None:
            self.failure = why
        raise GrammarWorkerError(self.failure)

    def close(self) -> None:
        """Stop the worker and free the block."""
        self._steps.close()
        self._control.close()
        self.process.join(timeout=5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        if self._on_cuda:
            torch.cuda.synchronize(self.device)  # nothing queued reads the block any more
            torch.cuda.cudart().cudaHostUnregister(self._registered)
