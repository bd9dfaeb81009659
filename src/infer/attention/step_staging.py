"""A graph step's inputs, written on the host and sent to the device in one copy.

The device buffer is one block of bytes: `rows64` int64 rows of `len64` words (slots, and
the model's own inputs: token ids, positions), then `len32` int32 words (lengths, offsets
and the step's block tables, packed `[sequences, widest table]`). Captured graphs read
views of it, so a replay's inputs are a single host-to-device copy from pinned memory,
plus one device copy that spreads the packed tables into the graphs' wide table.

The host side is a ring of pinned buffers written through numpy views. A buffer is reused
only after the copy that read it has run (an event per buffer): with steps launched ahead,
the host writes step s + 1 while step s's copy may still wait in the stream.
"""

from __future__ import annotations

import numpy as np
import torch

RING = 4


class StepStaging:
    def __init__(self, rows64: int, len64: int, len32: int, device: torch.device) -> None:
        self.device = torch.device(device)
        self.bytes64 = 8 * rows64 * len64
        nbytes = self.bytes64 + 4 * len32
        self.raw = torch.zeros(nbytes, dtype=torch.uint8, device=self.device)
        self.i64 = self.raw[:self.bytes64].view(torch.int64).view(rows64, len64)
        self.i32 = self.raw[self.bytes64:].view(torch.int32)
        cuda = self.device.type == "cuda"
        self._host = [torch.zeros(nbytes, dtype=torch.uint8, pin_memory=cuda)
                      for _ in range(RING if cuda else 1)]
        self._views = [(raw[:self.bytes64].view(np.int64).reshape(self.i64.shape),
                        raw[self.bytes64:].view(np.int32))
                       for raw in (host.numpy() for host in self._host)]
        self._events: list[torch.cuda.Event | None] = [None] * len(self._host)
        self._next = 0

    def host(self) -> tuple[np.ndarray, np.ndarray]:
        """Numpy views (int64 `[rows64, len64]`, int32 `[len32]`) of the next host buffer,
        free to write; `send` copies what was written."""
        i = self._next
        if self._events[i] is not None:
            self._events[i].synchronize()
        return self._views[i]

    def send_with_tables(self, at: int, rows: int, width: int, tables: torch.Tensor) -> None:
        """`send` up to the tables packed `[rows, width]` at int32 word `at`, then spread
        them into the wide device table `tables` (its first `rows` rows, `width` columns)."""
        self.send(at + rows * width)
        packed = self.i32[at:at + rows * width]
        tables[:rows, :width].copy_(packed.view(rows, width))

    def send(self, words32: int) -> None:
        """Queue the copy of the host buffer `host` gave: every int64 row, and the first
        `words32` int32 words."""
        i = self._next
        n = self.bytes64 + 4 * words32
        self.raw[:n].copy_(self._host[i][:n], non_blocking=True)
        if self.device.type == "cuda":
            event = self._events[i] or torch.cuda.Event()
            event.record()
            self._events[i] = event
        self._next = (i + 1) % len(self._host)


def write_rows(dst: np.ndarray, rows: list[list[int] | None], length: int) -> None:
    """Each of `rows` (host ints, at most `length`; None: none) into the row of `dst` at
    its index, zeroed past it up to `length`."""
    for out, row in zip(dst, rows):
        row = row or ()
        out[:len(row)] = row
        out[len(row):length] = 0
