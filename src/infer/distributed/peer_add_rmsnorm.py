"""The buffers of the fused all-reduce + residual add + RMSNorm (`kernels/all_reduce_norm.py`,
`EngineConfig.fuse_all_reduce_norm`): a staging buffer per rank in torch symmetric memory,
so that every rank's kernel writes into the others' directly.

Invariants: every rank takes or declines a call by its shapes and dtype alone (`takes`),
the same on every rank, since a rank that waits for a peer's words the peer never writes
waits for good; the staging buffers start at zero on every rank (no call's tag) before any
rank's first call.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist

from infer.distributed.peer_all_reduce import why_not_any

log = logging.getLogger(__name__)

HALF_BYTES = 2 << 20  # per half of the staging buffer: decode steps' rows, not prefills'
SLOTS = 256  # rows the call counts hold
# Rows the engine sends this way (decode steps), as measured in an 8B TP=2 step on two
# H200s with the kernel's earlier form (data, then a flag): 2.93 -> 2.71 ms at 1 row,
# 3.93 -> 3.68 ms at 32 (benchmarks/tensor_parallel.py); the kernel alone 1.45x NCCL +
# the norm kernel at 1 row, 1.38x at 32.
MAX_ROWS = 32
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class PeerAddRMSNorm:
    """`(x, residual) -> (rmsnorm(residual + all-reduce(x)), residual + all-reduce(x))`,
    or without a residual `rmsnorm(all-reduce(x))`, in one kernel, for tensors of up to
    `MAX_ROWS` rows that fit `HALF_BYTES`."""

    def __init__(self, buffers: torch.Tensor, rank: int, keep: tuple[Any, ...] = ()) -> None:
        self.buffers = buffers  # int64 addresses of every rank's staging buffer
        self.epochs = torch.zeros(SLOTS, dtype=torch.int64, device=buffers.device)
        self.rank = rank
        self._keep = keep  # the symmetric tensors the addresses point into

    @classmethod
    def create(cls, device_group: Any, cpu_group: Any, device: torch.device
               ) -> PeerAddRMSNorm | None:
        """Set up on every rank together (a collective), or None on every rank, with the
        reason logged, where some rank cannot."""
        reason = why_not_any(device_group, cpu_group, device)
        if reason is not None:
            log.info("fused all-reduce + RMSNorm off: %s", reason)
            return None
        import torch.distributed._symmetric_memory as symm_mem

        staging = symm_mem.empty(2 * HALF_BYTES, dtype=torch.uint8, device=device)
        staging.zero_()
        staged = symm_mem.rendezvous(staging, device_group.group_name)
        torch.cuda.synchronize(device)
        dist.barrier(group=cpu_group)  # every rank's buffer zeroed before any rank's call

        rank = dist.get_rank(device_group)

        def addresses(tensor: torch.Tensor, handle: Any) -> torch.Tensor:
            # The tensor may lie at an offset into its allocation: the same on every rank.
            offset = tensor.data_ptr() - handle.buffer_ptrs[rank]
            return torch.tensor([base + offset for base in handle.buffer_ptrs],
                                dtype=torch.int64, device=device)

        log.info("fused all-reduce + residual add + RMSNorm over peer memory, up to %d "
                 "rows of %d KiB", MAX_ROWS, HALF_BYTES >> 10)
        return cls(addresses(staging, staged), rank, (staging, staged))

    def takes(self, x: torch.Tensor, residual: torch.Tensor | None) -> bool:
        """Whether this call goes this way; by shapes, dtypes and layout only."""
        n = x.shape[-1]
        rows = x.numel() // n if n else 0
        return (x.dtype in _DTYPES and 0 < rows <= MAX_ROWS
                and n * x.element_size() % 4 == 0  # whole words
                # 8-byte words of 4 bytes of x each, from every rank
                and rows * self.buffers.numel() * n * x.element_size() * 2 <= HALF_BYTES
                and x.is_contiguous()
                and (residual is None or (residual.dtype == x.dtype
                                          and residual.shape == x.shape
                                          and residual.is_contiguous())))

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float, offset: float) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        from infer.kernels.all_reduce_norm import all_reduce_add_rmsnorm

        return all_reduce_add_rmsnorm(x, residual, weight, eps, offset, self.buffers,
                                      self.epochs, self.rank, HALF_BYTES // 8)
