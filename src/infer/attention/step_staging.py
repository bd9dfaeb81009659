"""A graph step's inputs, written on the host and sent to the device in two copies.

The device buffer is one block of bytes: `rows64` int64 rows of `len64` words (slots, and
the model's own inputs: token ids, positions), then `len32` int32 words (lengths, offsets,
and room for the step's block tables packed `[sequences, widest table]`). Captured graphs
read views of it and of a wide table, so a replay's inputs are one host-to-device copy
from pinned memory, and one copy of the packed tables' rows into the wide table's.

The host side is a ring of pinned buffers written through numpy views. A buffer is reused
only after the copies that read it have run (an event per buffer): with steps launched
ahead, the host writes step s + 1 while step s's copies may still wait in the stream. On
CUDA the copies and events go to the driver directly (`cuda_driver.py`): as torch
operations they cost the loop ~0.13 ms a step on an H200's host.
"""

from __future__ import annotations

import numpy as np
import torch

from infer.cuda_driver import cuda_driver

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
        self._next = 0
        self._driver = None
        if cuda:
            self._driver = cuda_driver()
            self._device_index = torch.cuda._utils._get_device_index(self.device,
                                                                     optional=True)
            self._events = [self._driver.event() for _ in self._host]
            self._addresses = [host.data_ptr() for host in self._host]
            self._raw_address = self.raw.data_ptr()
            self._recorded = [False] * len(self._host)

    def host(self) -> tuple[np.ndarray, np.ndarray]:
        """Numpy views (int64 `[rows64, len64]`, int32 `[len32]`) of the next host buffer,
        free to write; `send` copies what was written."""
        i = self._next
        if self._driver is not None and self._recorded[i]:
            self._driver.synchronize(self._events[i])
        return self._views[i]

    def send_with_tables(self, at: int, rows: int, width: int, tables: torch.Tensor) -> None:
        """`send` the words before int32 word `at`, and the tables packed `[rows, width]`
        at `at` into the wide device table `tables` (its first `rows` rows, `width`
        columns)."""
        if self._driver is None:
            self.send(at + rows * width)
            packed = self.i32[at:at + rows * width]
            tables[:rows, :width].copy_(packed.view(rows, width))
            return
        stream = torch._C._cuda_getCurrentRawStream(self._device_index)
        host = self._addresses[self._next] + self.bytes64 + 4 * at
        word = tables.element_size()  # 4: int32, as the packed rows
        self._driver.copy_rows_to_device(stream, tables.data_ptr(), tables.stride(0) * word,
                                         host, word * width, word * width, rows)
        self.send(at, stream)

    def send(self, words32: int, stream: int | None = None) -> None:
        """Queue the copy of the host buffer `host` gave: every int64 row, and the first
        `words32` int32 words (on CUDA, on `stream`: default the current one)."""
        i = self._next
        n = self.bytes64 + 4 * words32
        if self._driver is None:
            self.raw[:n].copy_(self._host[i][:n])
        else:
            if stream is None:
                stream = torch._C._cuda_getCurrentRawStream(self._device_index)
            self._driver.copy_to_device(stream, self._raw_address, self._addresses[i], n)
            self._driver.record(self._events[i], stream)
            self._recorded[i] = True
        self._next = (i + 1) % len(self._host)


def write_rows(dst: np.ndarray, rows: list[list[int] | None], length: int) -> None:
    """Each of `rows` (host ints, at most `length`; None: none) into the row of `dst` at
    its index, zeroed past it up to `length`."""
    for out, row in zip(dst, rows):
        row = row or ()
        out[:len(row)] = row
        out[len(row):length] = 0
