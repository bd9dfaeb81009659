"""Host <-> device copies that never make the host wait for the GPU.

With async scheduling the GPU still runs step N while the host prepares step N+1. A copy
from pageable host memory may make the driver drain the stream first (to stage it), and a
plain device-to-host copy always does: either would stall the host behind step N. So
host-to-device inputs go through pinned memory, and results come back into pinned memory
with an event to wait on.

On CUDA a result's copies and its event go to the driver directly (`cuda_driver.py`; as
torch operations they cost the loop ~35 µs a step on an H200's host). torch's pinned
allocator then does not know of the copies: a result dropped before it was waited for
keeps its buffers, beside its event, until the event has passed.
"""

from __future__ import annotations

import collections

import torch

from infer.cuda_driver import cuda_driver


def to_device(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """`host` on `device`, queued on the current stream without blocking the host."""
    device = torch.device(device)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


class _Events:
    """A device's driver events for results, and the buffers of results dropped unwaited."""

    def __init__(self, device: torch.device) -> None:
        self.driver = cuda_driver()
        self.device_index = torch.cuda._utils._get_device_index(device, optional=True)
        self.free: list[int] = []
        self.dropped: collections.deque[tuple[int, list[torch.Tensor | None]]] = (
            collections.deque())

    def take(self) -> int:
        while self.dropped and self.driver.done(self.dropped[0][0]):
            self.free.append(self.dropped.popleft()[0])  # its buffers go
        return self.free.pop() if self.free else self.driver.event()


_EVENTS: dict[torch.device, _Events] = {}


class HostCopy:
    """Device tensors copied to the host in the background; `wait()` returns them."""

    def __init__(self, *tensors: torch.Tensor | None) -> None:
        self._event: int | None = None
        self._host: list[torch.Tensor | None] = []
        device = next((t.device for t in tensors if t is not None and t.is_cuda), None)
        if device is None:
            self._host = list(tensors)
            return
        events = _EVENTS.get(device)
        if events is None:
            events = _EVENTS[device] = _Events(device)
        self._events = events
        stream = torch._C._cuda_getCurrentRawStream(events.device_index)
        for t in tensors:
            if t is None:
                self._host.append(None)
                continue
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            if t.nbytes and t.is_cuda and t.is_contiguous():
                events.driver.copy_to_host(stream, host.data_ptr(), t.data_ptr(), t.nbytes)
            elif t.nbytes:  # (torch's copy, known to its pinned allocator)
                host.copy_(t, non_blocking=True)
            self._host.append(host)
        self._event = events.take()
        events.driver.record(self._event, stream)

    def wait(self) -> list[torch.Tensor | None]:
        if self._event is not None:
            self._events.driver.synchronize(self._event)
            self._events.free.append(self._event)
            self._event = None
        return self._host

    def __del__(self) -> None:
        if self._event is not None:  # never waited for: the copies may still be running
            self._events.dropped.append((self._event, self._host))
