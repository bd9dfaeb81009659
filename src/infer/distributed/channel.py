"""How rank 0 tells the other ranks which model call comes next (`MirroredRunner`'s
messages: a step's inputs, its LM head, prompt rows, stop).

Workers rank 0 spawned on its own host each get one end of a pipe: a message is pickled
once and written to every pipe (tens of microseconds). gloo's `broadcast_object_list`,
which ranks torchrun started (on other hosts, too) must use, is two collectives per
message: ~1.1 ms for a 300-byte batch-1 step on the project's 2-core CPU against 14 µs
through a pipe, paid twice per step (forward, then the LM head) on the step's critical
path. A worker that died makes the next send fail (`BrokenPipeError`); a rank 0 that died
ends the worker's read (`EOFError`).
"""

from __future__ import annotations

import pickle
from multiprocessing.connection import Connection
from typing import Any

from infer.distributed.group import TensorParallelGroup


class PipeSender:
    def __init__(self, pipes: list[Connection]) -> None:
        self.pipes = pipes

    def send(self, message: tuple) -> None:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        for pipe in self.pipes:
            pipe.send_bytes(data)

    def close(self) -> None:
        for pipe in self.pipes:
            pipe.close()


class PipeReceiver:
    def __init__(self, pipe: Connection) -> None:
        self.pipe = pipe

    def receive(self) -> Any:
        return pickle.loads(self.pipe.recv_bytes())


class GlooChannel:
    """Both ends over the group's CPU (gloo) group: ranks that torchrun started."""

    def __init__(self, group: TensorParallelGroup) -> None:
        self.group = group

    def send(self, message: tuple) -> None:
        self.group.broadcast_object(message)

    def receive(self) -> Any:
        return self.group.broadcast_object()

    def close(self) -> None:
        pass
