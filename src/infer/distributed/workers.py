"""Rank 0's side of tensor parallelism: start ranks 1..N-1, watch them, stop them.

Each worker is a process of its own (spawned; `worker.py`). They meet rank 0 at a TCP
address on this host; under torchrun (`RANK` and `WORLD_SIZE` in the environment) every
rank is already running and they meet where torchrun says (`env://`), across hosts too.

A worker that exits while the engine runs leaves the ranks unable to go on: the watcher
records why (`failure`), stops the other workers and aborts the device group, so that a
collective rank 0 waits in fails instead of hanging; every later model call raises
`TensorParallelError`. With the custom all-reduce (`peer_all_reduce.py`) the watcher
exits the process instead: a kernel of rank 0 may wait for the dead rank for good.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import multiprocessing
import multiprocessing.connection
import os
import socket
import threading
from collections.abc import Callable

import torch

from infer.distributed.channel import GlooChannel, PipeSender
from infer.distributed.group import TensorParallelGroup, init_group, leave_world, peer_options
from infer.distributed.torchrun import torchrun_rank
from infer.distributed.worker import worker_main
from infer.engine.config import EngineConfig
from infer.process_exit import exit_code_unreaped

log = logging.getLogger(__name__)
_STOP_TIMEOUT_S = 10.0
_ABORT_WAIT_S = 2.0


class TensorParallelError(RuntimeError):
    """A rank died or the ranks fell out of step: the engine cannot go on."""


class Workers:
    def __init__(self, processes: list[multiprocessing.process.BaseProcess],
                 group: TensorParallelGroup, channel: PipeSender | GlooChannel) -> None:
        self.processes, self.group, self.channel = processes, group, channel
        self.failure: str | None = None
        # Rank 0's runner drops its CUDA graphs here before the world is left (an NCCL
        # teardown waits for the graphs that captured its collectives: group.leave_world).
        self.before_leaving: Callable[[], None] | None = None
        self._stopping = False
        if processes:
            threading.Thread(target=self._watch, name="infer-tp-watch", daemon=True).start()
        atexit.register(self.shutdown)

    @classmethod
    def start(cls, config: EngineConfig, device: torch.device) -> Workers:
        """Start the other ranks and form the group with them (rank 0 is this process)."""
        size = config.tensor_parallel_size
        if torchrun_rank() is not None:
            if int(os.environ["WORLD_SIZE"]) != size:
                raise ValueError(f"tensor_parallel_size={size} but torchrun started "
                                 f"WORLD_SIZE={os.environ['WORLD_SIZE']} ranks")
            group = init_group(0, size, "env://", device, **peer_options(config))
            return cls([], group, GlooChannel(group))
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        ctx = multiprocessing.get_context("spawn")
        processes, senders, receivers = [], [], []
        for rank in range(1, size):
            rank_device = f"cuda:{rank}" if device.type == "cuda" else "cpu"
            receiver, sender = ctx.Pipe(duplex=False)
            senders.append(sender)
            receivers.append(receiver)
            processes.append(ctx.Process(
                target=worker_main,
                args=(config, rank, size, init_method, rank_device, os.getpid(), receiver),
                name=f"infer-tp-rank{rank}", daemon=True))
        for process in processes:
            process.start()
        for receiver in receivers:  # the worker's now: a dead worker breaks our sends
            receiver.close()
        try:
            group = _join(processes, size, init_method, device, peer_options(config))
        except BaseException:
            _stop(processes)
            raise
        return cls(processes, group, PipeSender(senders))

    def check(self) -> None:
        if self.failure is not None:
            raise TensorParallelError(self.failure)

    def exited(self, grace_s: float = 0.5) -> str | None:
        """Why the ranks cannot go on, if a worker has exited or exits within `grace_s`
        (called after a failed call: a send to a dying worker can fail before the watcher,
        or the worker's own exit, has happened)."""
        if self.failure is None and self.processes:
            ended = multiprocessing.connection.wait([p.sentinel for p in self.processes],
                                                    grace_s)
            for rank, process in enumerate(self.processes, 1):
                # A ready sentinel is an exit under way: the kernel closes a dying
                # process's files (its sockets too: what rank 0 saw fail) before the
                # process can be reaped (`_exited` waits for that, reaping nothing: the
                # watcher may be reading the same exit, process_exit.py).
                if process.sentinel in ended or not process.is_alive():
                    return _exited(rank, process)
        return self.failure

    def fail(self, reason: str) -> None:
        """The ranks are out of step for good (a model call failed on rank 0)."""
        if self.failure is None:
            self.failure = reason

    def shutdown(self) -> None:
        """Tell the workers to stop (those that do not are terminated), leave the group.
        After a failure nothing waits on the others: the device group is aborted, not
        destroyed (destroying an NCCL group whose peer is gone can block)."""
        if self._stopping:
            return
        self._stopping = True
        atexit.unregister(self.shutdown)
        if self.failure is None and self.before_leaving is not None:
            self.before_leaving()  # not after a failure: the device may never finish
        if self.failure is None and self.group.size > 1:
            with contextlib.suppress(Exception):  # a worker already gone: stopped below
                self.channel.send(("stop",))
                # Every rank leaves the world after this barrier, the workers too (a
                # rank torchrun started is not ours to join).
                self.group.barrier()
        self.channel.close()
        _stop(self.processes, _STOP_TIMEOUT_S)
        if self.failure is not None:
            self._abort()
        else:
            leave_world()

    def _watch(self) -> None:
        by_sentinel = {p.sentinel: (rank, p) for rank, p in enumerate(self.processes, 1)}
        ready = multiprocessing.connection.wait(list(by_sentinel))
        if self._stopping:
            return
        rank, process = by_sentinel[ready[0]]
        self.failure = _exited(rank, process)
        log.error("%s: stopping the other ranks", self.failure)
        _stop(self.processes)
        self._abort()
        if self.group.peer is not None or self.group.add_rmsnorm is not None:
            # A peer-memory all-reduce waits for its peers in a kernel, which no abort
            # ends: this GPU may never finish its stream again, so this process cannot go on.
            log.error("peer-memory all-reduce: rank 0's GPU may wait for the dead rank for "
                      "good; exiting")
            logging.shutdown()
            os._exit(1)

    def _abort(self) -> None:
        """An NCCL collective rank 0 waits in (or will) returns with an error; waited for
        at most _ABORT_WAIT_S (the graphs that captured its collectives are still alive:
        `leave_world`)."""
        if self.group.device_group is not None and torch.cuda.is_available():
            leave_world(_ABORT_WAIT_S)


def _exited(rank: int, process: multiprocessing.process.BaseProcess) -> str:
    return (f"tensor-parallel rank {rank} exited (exit code {exit_code_unreaped(process)}); "
            "the engine cannot go on")


def _join(processes: list[multiprocessing.process.BaseProcess], size: int, init_method: str,
          device: torch.device, options: dict[str, bool]) -> TensorParallelGroup:
    """Form the group in a thread, so that a worker that dies before it joins ends the
    wait at once (the rendezvous itself would wait for its timeout)."""
    result: list = []

    def rendezvous() -> None:
        try:
            result.append(init_group(0, size, init_method, device, **options))
        except BaseException as exc:
            result.append(exc)

    thread = threading.Thread(target=rendezvous, name="infer-tp-rendezvous", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(0.1)
        for rank, process in enumerate(processes, 1):
            if not process.is_alive():
                raise RuntimeError(f"tensor-parallel rank {rank} exited while starting "
                                   f"(exit code {process.exitcode})")
    if isinstance(result[0], BaseException):
        raise result[0]
    return result[0]


def _stop(processes: list[multiprocessing.process.BaseProcess],
          timeout: float = 0.0) -> None:
    for process in processes:
        process.join(timeout)
        if process.is_alive():
            process.terminate()
            process.join(5)
            if process.is_alive():
                process.kill()
                process.join()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
