"""Signals between the device and another process on the host, through host memory the
device can address (pinned and registered with CUDA: on a 64-bit system with unified
addressing the device reaches it at its host address).

`wait_for_host`: one program spins until an int64 counter in host memory reaches a value,
so that what is queued after it on the stream waits for a host process while the thread
that queued it goes on. A poll limit keeps a writer that never comes from holding the
stream for good: the kernel then says so in host memory, and the caller refuses what it
guarded.

`publish_to_host`: token ids written to host memory, then a stamp (release, system scope),
so that a host reader that sees the stamp sees the ids.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# ~1 us a poll of host memory across the bus: a few seconds at most.
MAX_POLLS = 4_000_000
PUBLISH_BLOCK = 1024


@triton.jit
def _wait_kernel(counter_ptr, gave_up_ptr, value, max_polls):
    seen = tl.load(counter_ptr, volatile=True)
    polls = 0
    while (seen < value) & (polls < max_polls):
        seen = tl.load(counter_ptr, volatile=True)
        polls += 1
    if seen < value:
        tl.store(gave_up_ptr, value)


@triton.jit
def _publish_kernel(ids_ptr, out_ptr, stamp_ptr, n, stamp, BLOCK: tl.constexpr):
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        ids = tl.load(ids_ptr + offs, mask=offs < n)
        tl.store(out_ptr + offs, ids.to(tl.int64), mask=offs < n)
    tl.debug_barrier()
    tl.atomic_xchg(stamp_ptr, stamp, sem="release", scope="sys")


class HostWords:
    """An int64 array in registered host memory as a kernel argument: Triton takes any
    object with `data_ptr()` and `dtype`."""

    dtype = torch.int64

    def __init__(self, address: int) -> None:
        self._address = address

    def data_ptr(self) -> int:
        return self._address


def wait_for_host(counter: HostWords | torch.Tensor, gave_up: HostWords | torch.Tensor,
                  value: int, max_polls: int = MAX_POLLS) -> None:
    """Queue: the stream waits until `counter[0] >= value`; after `max_polls` reads it
    goes on and writes `value` to `gave_up[0]`."""
    _wait_kernel[(1,)](counter, gave_up, value, max_polls, num_warps=1)


def publish_to_host(ids: torch.Tensor, out: HostWords | torch.Tensor,
                    stamp: HostWords | torch.Tensor, value: int) -> None:
    """Queue: `out[:len(ids)] = ids` (as int64), then `stamp[0] = value`."""
    assert ids.dim() == 1 and ids.is_contiguous() and not ids.is_floating_point()
    _publish_kernel[(1,)](ids, out, stamp, len(ids), value, BLOCK=PUBLISH_BLOCK,
                          num_warps=4)
