"""Small all-reduces over peer memory instead of NCCL (`EngineConfig.custom_all_reduce`).

A decode step under tensor parallelism all-reduces a few KB per layer (8 KB per batch row
on the Llama-3.1-8B shape), where NCCL's cost is its fixed latency, not the bytes. Here
each rank's tensor goes into a buffer that every rank of the host can read over NVLink
(torch's symmetric memory); the ranks meet at a barrier on signal pads, and each sums
every rank's buffer itself — one kernel (`symm_mem.one_shot_all_reduce_copy_out`), which
CUDA graphs capture like any other.

Invariants:
- every rank all-reduces the same shapes and dtypes in the same order (as NCCL needs too),
  and `__call__` takes a tensor or declines it by its size and dtype alone, so the ranks
  always agree on the path;
- the kernel ends at a barrier: when it returns on one rank no peer still reads that
  rank's buffer, so the next call may overwrite it;
- ranks sum in rank order, so every rank gets the same bits.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

DEFAULT_MAX_BYTES = 1 << 20  # larger tensors (prefill chunks) go through NCCL
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_ALIGN = 16  # bytes: the kernel's widest vector


class PeerAllReduce:
    """A one-shot all-reduce of tensors up to `max_bytes` over a symmetric buffer."""

    def __init__(self, buffer: torch.Tensor, group_name: str, max_bytes: int) -> None:
        self.buffer = buffer  # uint8, symmetric: every rank's is readable by the others
        self.group_name = group_name
        self.max_bytes = max_bytes
        self.scratch = torch.empty_like(buffer)  # plain memory: the result of a misaligned x

    @classmethod
    def create(cls, device_group: Any, cpu_group: Any, device: torch.device,
               max_bytes: int = DEFAULT_MAX_BYTES) -> PeerAllReduce | None:
        """Set up on every rank together (a collective), or None on every rank, with the
        reason logged, where some rank cannot (no CUDA, no peer access, no symmetric
        memory in this torch)."""
        reason = why_not_any(device_group, cpu_group, device)
        if reason is not None:
            log.info("custom all-reduce off, NCCL for all: %s", reason)
            return None
        import torch.distributed._symmetric_memory as symm_mem

        buffer = symm_mem.empty(max_bytes, dtype=torch.uint8, device=device)
        symm_mem.rendezvous(buffer, device_group.group_name)
        log.info("custom all-reduce: up to %d KiB over peer memory, NCCL above",
                 max_bytes >> 10)
        return cls(buffer, device_group.group_name, max_bytes)

    def takes(self, x: torch.Tensor) -> bool:
        """Whether `x` goes this way; by size and dtype only, the same on every rank."""
        nbytes = x.numel() * x.element_size()
        return (x.dtype in _DTYPES and 0 < nbytes <= self.max_bytes
                and nbytes % _ALIGN == 0)

    def __call__(self, x: torch.Tensor) -> bool:
        """Sum every rank's `x` into `x` and return True, or False (untouched) if it is
        not `takes(x)`."""
        if not self.takes(x):
            return False
        n = x.numel()
        staged = self.buffer.view(x.dtype)[:n]
        if x.is_contiguous() and x.data_ptr() % _ALIGN == 0:
            flat = x.view(-1)  # the kernel copies x in, then writes the sum over it
            torch.ops.symm_mem.one_shot_all_reduce_copy_out(staged, flat, "sum",
                                                            self.group_name, flat)
            return True
        staged.copy_(x.reshape(-1))
        out = self.scratch.view(x.dtype)[:n]
        torch.ops.symm_mem.one_shot_all_reduce_out(staged, "sum", self.group_name, out)
        x.copy_(out.view(x.shape))
        return True


def why_not_any(device_group: Any, cpu_group: Any, device: torch.device) -> str | None:
    """Why some rank cannot take part in peer memory (None: every rank can); a collective,
    so that every rank decides alike."""
    reason = why_not(device, dist.get_world_size(device_group))
    failed = torch.tensor([reason is not None], dtype=torch.int32)
    dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=cpu_group)
    return (reason or "another rank cannot use it") if failed.item() else None


def why_not(device: torch.device, world_size: int) -> str | None:
    """Why this rank cannot take part (None: it can)."""
    if device.type != "cuda":
        return f"the ranks run on {device.type}, not CUDA"
    try:
        import torch.distributed._symmetric_memory
    except ImportError as exc:
        return f"this torch has no symmetric memory ({exc})"
    if not hasattr(torch.ops.symm_mem, "one_shot_all_reduce_copy_out"):
        return "this torch has no symm_mem.one_shot_all_reduce_copy_out"
    count = torch.cuda.device_count()
    if world_size > count:
        return f"{world_size} ranks but {count} GPUs on this host (peer memory is per host)"
    me = device.index if device.index is not None else torch.cuda.current_device()
    for other in range(world_size):
        if other != me and not torch.cuda.can_device_access_peer(me, other):
            return f"cuda:{me} cannot read cuda:{other}'s memory (no peer access)"
    return None
