"""The tensor-parallel group: this process's rank of `size`, and the collectives its layers
and its engine call.

Two torch.distributed groups over the same ranks: `device_group` moves tensors (NCCL on
GPUs, gloo on CPUs; the model's all-reduces, the LM head's gather, the step's token ids),
`cpu_group` (gloo) moves Python objects (each step's inputs) without touching the GPU.
A group of size 1 calls nothing: it is what every layer gets outside tensor parallelism.
With `peer`, small all-reduces skip NCCL and go over peer memory (`peer_all_reduce.py`).

Layers take the group in effect when they are built (`tensor_parallel(group)`), as they
take their linear method, so a model file never mentions ranks.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from infer.distributed.peer_add_rmsnorm import PeerAddRMSNorm
from infer.distributed.peer_all_reduce import PeerAllReduce

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TensorParallelGroup:
    rank: int = 0
    size: int = 1
    device_group: Any = None  # torch.distributed ProcessGroup (None: size 1)
    cpu_group: Any = None
    peer: PeerAllReduce | None = None  # the custom all-reduce, where it is on
    add_rmsnorm: PeerAddRMSNorm | None = None  # the fused one, where it is on

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's `x` (in place; returned)."""
        if self.size > 1 and (self.peer is None or not self.peer(x)):
            dist.all_reduce(x, group=self.device_group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's `x` concatenated along `dim`, in rank order."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x, group=self.device_group)
        return torch.cat(parts, dim)

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's `x` into every rank's `x` (same shape and dtype everywhere)."""
        if self.size > 1:
            dist.broadcast(x, self.global_rank(0), group=self.device_group)
        return x

    def broadcast_object(self, obj: Any = None) -> Any:
        """Rank 0's `obj` (pickled), returned on every rank."""
        if self.size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, self.global_rank(0), group=self.cpu_group)
        return box[0]

    def min(self, value: int) -> int:
        """The smallest of every rank's `value`."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.long)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(t.item())

    def barrier(self) -> None:
        """Wait until every rank is here."""
        if self.size > 1:
            dist.barrier(group=self.cpu_group)

    def global_rank(self, rank: int) -> int:
        return dist.get_global_rank(self.cpu_group, rank) if self.cpu_group else rank


SINGLE = TensorParallelGroup()


def init_group(rank: int, size: int, init_method: str, device: torch.device,
               custom_all_reduce: bool = False, fuse_all_reduce_norm: bool = False,
               timeout_s: float = 600.0) -> TensorParallelGroup:
    """Join the `size`-rank world at `init_method` (tcp://host:port, env://, file://) as
    `rank`: NCCL for tensors on a GPU, gloo on a CPU, gloo for objects either way; with
    `custom_all_reduce`, small all-reduces over peer memory where every rank can; with
    `fuse_all_reduce_norm`, the all-reduces before an add + RMSNorm fused with it there."""
    from datetime import timedelta

    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    timeout = timedelta(seconds=timeout_s)
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size,
                            timeout=timeout, **kwargs)
    cpu_group = dist.new_group(backend="gloo", timeout=timeout) if backend == "nccl" \
        else dist.group.WORLD
    peer = PeerAllReduce.create(dist.group.WORLD, cpu_group, device) \
        if custom_all_reduce else None
    add_rmsnorm = PeerAddRMSNorm.create(dist.group.WORLD, cpu_group, device) \
        if fuse_all_reduce_norm else None
    return TensorParallelGroup(rank, size, dist.group.WORLD, cpu_group, peer, add_rmsnorm)


def peer_options(config: Any) -> dict[str, bool]:
    """`init_group`'s peer-memory switches, from an `EngineConfig`."""
    return {"custom_all_reduce": config.custom_all_reduce,
            "fuse_all_reduce_norm": config.fuse_all_reduce_norm}


def leave_world(wait_s: float = 10.0) -> None:
    """Leave the torch.distributed world, after every rank's last collective and after
    the CUDA graphs that captured its collectives are destroyed (NCCL's teardown waits
    for them: with them alive it never returned on two H200s). A world with NCCL is
    aborted, not destroyed (no rank waits for another; the global state is cleared as by
    destroy, so that a later engine can form a world again); gloo's is destroyed.
    At most `wait_s` is spent: the teardown runs in a thread of its own, left behind
    (and logged) if it has not ended by then. After a failure (graphs still alive) that
    is the expected end of an abort: NCCL flags its in-flight kernels to end at once,
    then waits for the graphs."""
    if not dist.is_initialized():
        return
    nccl = dist.get_backend() == "nccl"
    leave = dist.distributed_c10d._abort_process_group if nccl else dist.destroy_process_group

    def teardown() -> None:
        try:
            if dist.is_initialized():  # a second call after the first ended: nothing left
                leave()
        except Exception:
            log.exception("could not leave the tensor-parallel world")

    thread = threading.Thread(target=teardown, name="infer-tp-leave", daemon=True)
    thread.start()
    thread.join(wait_s)
    if thread.is_alive():
        log.warning("the tensor-parallel world was not torn down in %.0f s; going on "
                    "without waiting", wait_s)


_CURRENT: ContextVar[TensorParallelGroup] = ContextVar("tensor_parallel_group", default=SINGLE)


@contextmanager
def tensor_parallel(group: TensorParallelGroup) -> Iterator[None]:
    """Within: every layer built without a group of its own is part `group.rank` of
    `group.size` (see `models/linear.py`)."""
    token = _CURRENT.set(group)
    try:
        yield
    finally:
        _CURRENT.reset(token)


def current_group() -> TensorParallelGroup:
    return _CURRENT.get()
