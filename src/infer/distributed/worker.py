"""A tensor-parallel worker: ranks 1..N-1, one process each.

It loads its shard of the model, builds its runner exactly as rank 0 builds its own
(`engine/runner_setup.py`: the warm-up forward and each graph capture are collectives),
then makes, call for call, the model calls rank 0's `MirroredRunner` announces:

    ("forward", StepInputs, num_device_ids, dtype)   then, if num_device_ids, the step's
                                                     token ids come by a device broadcast
    ("logits",)                                      the LM head over the rows that sample
    ("rows", rows, chunk)                            the LM head over prompt rows
    ("stop",)

It never samples: tokens come from rank 0. It exits when told to, when a collective fails
(a peer is gone), or when its parent (rank 0's process) is gone. SIGUSR1 prints its
threads' stacks to stderr (faulthandler): where a rank that hangs waits.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import threading
import time
from multiprocessing.connection import Connection

import torch

from infer.distributed.channel import GlooChannel, PipeReceiver
from infer.distributed.group import TensorParallelGroup, init_group, leave_world, peer_options
from infer.engine.config import EngineConfig
from infer.engine.model_runner import ModelRunner

log = logging.getLogger(__name__)
_PARENT_POLL_S = 0.5


def worker_main(config: EngineConfig, rank: int, size: int, init_method: str,
                device_name: str, parent_pid: int | None = None,
                messages: Connection | None = None) -> None:
    """Rank `rank` of `size` on `device_name` (cpu, cuda:N). `parent_pid`: exit when that
    process is gone (None: launched by torchrun, whose agent ends the ranks). `messages`:
    the pipe rank 0 announces its model calls on (None: over the group, `channel.py`)."""
    from infer.engine.core_loading import load_model_shard
    from infer.engine.cpu_threads import set_cpu_threads
    from infer.engine.runner_setup import build_runner, capture_graphs, uses_graphs
    from infer.engine.setup import pick_device_and_dtype

    faulthandler.register(signal.SIGUSR1, all_threads=True)
    if parent_pid is not None:
        threading.Thread(target=_exit_with_parent, args=(parent_pid,), daemon=True,
                         name="infer-tp-parent-watch").start()
    device, dtype = pick_device_and_dtype(device_name, config.dtype)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        set_cpu_threads(config.threads)
    group = init_group(rank, size, init_method, device, **peer_options(config))
    model, model_config, *_ = load_model_shard(config, dtype, device, group)
    config, max_model_len = group.broadcast_object()  # as rank 0 settled them
    runner = build_runner(config, model, model_config, device, dtype, max_model_len,
                          tp=group)
    if uses_graphs(config, device, runner.attention_backend):
        capture_graphs(runner, config, max_model_len)
    serve(runner, group, GlooChannel(group) if messages is None else PipeReceiver(messages))
    runner.release_graphs()
    group.barrier()  # rank 0 leaves the group with us
    leave_world()


def serve(runner: ModelRunner, group: TensorParallelGroup,
          channel: PipeReceiver | GlooChannel) -> None:
    """Make rank 0's model calls until told to stop."""
    hidden = inputs = None
    while True:
        try:
            message = channel.receive()
        except EOFError:  # rank 0 is gone (the parent watch would see it within 0.5 s)
            os._exit(1)
        kind = message[0]
        if kind == "forward":
            _, inputs, num_ids, dtype = message
            ids = None
            if num_ids:
                ids = group.broadcast(torch.empty(num_ids, dtype=getattr(torch, dtype),
                                                  device=runner.device))
            hidden = runner.forward(inputs, ids)
        elif kind == "logits":
            runner.sample_logits(hidden, inputs)
        elif kind == "rows":
            for _ in runner.logits_of_rows(hidden, message[1], message[2]):
                pass
        elif kind == "stop":
            return
        else:
            raise ValueError(f"unknown message {kind!r} for a tensor-parallel worker")


def _exit_with_parent(parent_pid: int) -> None:
    """A worker never outlives rank 0 (even one killed outright)."""
    while True:
        time.sleep(_PARENT_POLL_S)
        if os.getppid() != parent_pid:
            os._exit(1)
