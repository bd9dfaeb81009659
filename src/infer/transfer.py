"""Host <-> device copies that never make the host wait for the GPU.

With async scheduling the GPU still runs step N while the host prepares step N+1. A copy
from pageable host memory may make the driver drain the stream first (to stage it), and a
plain device-to-host copy always does: either would stall the host behind step N. So
host-to-device inputs go through pinned memory, and results come back into pinned memory
with an event to wait on.
"""

from __future__ import annotations

import torch


def to_device(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """`host` on `device`, queued on the current stream without blocking the host."""
    device = torch.device(device)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


class HostCopy:
    """Device tensors copied to the host in the background; `wait()` returns them."""

    def __init__(self, *tensors: torch.Tensor | None) -> None:
        self._event: torch.cuda.Event | None = None
        self._host: list[torch.Tensor | None] = []
        on_cuda = any(t is not None and t.is_cuda for t in tensors)
        for t in tensors:
            if t is None or not on_cuda:
                self._host.append(t)
                continue
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            host.copy_(t, non_blocking=True)
            self._host.append(host)
        if on_cuda:
            self._event = torch.cuda.Event()
            self._event.record()

    def wait(self) -> list[torch.Tensor | None]:
        if self._event is not None:
            self._event.synchronize()
        return self._host
