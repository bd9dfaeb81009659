"""A step's block tables packed for the device, rewriting only the rows that changed.

From one decode step to the next most sequences keep their table: a table grows by a
block every `block_size` tokens and is otherwise the same list. Packing every row anew
(`metadata.pack_block_tables`) converts batch x context / block size Python ints each
step (0.08 ms at 256 rows of 10 blocks on the CPU machine, ~0.2 ms on an H200's host);
`TablePacker` keeps the tables it last wrote in a host array and writes a row again only
when its list is another object or another length.

Invariant this relies on (the KV manager keeps it): a table list is only ever appended
to; anything that shortens or changes a table gives the sequence a new list. The packer
holds a reference to each list it wrote, so no new list can reuse a dead one's identity.
"""

from __future__ import annotations

import numpy as np


class TablePacker:
    def __init__(self, max_rows: int, max_blocks: int) -> None:
        self._rows = np.zeros((max_rows, max_blocks), dtype=np.int32)
        self._tables: list[list[int] | None] = [None] * max_rows  # as written, by row
        self._lens = [0] * max_rows  # each row's length when written

    def pack(self, block_tables: list[list[int]], rows: int, out: np.ndarray) -> int:
        """`pack_block_tables(block_tables, rows, out)`: the tables into `out` as int32
        `[rows, longest table]`, row-major and zero-padded (rows past the tables all
        zero); returns the width."""
        n = len(block_tables)
        lens = list(map(len, block_tables))
        width = max(lens, default=0)
        host, written, written_lens = self._rows, self._tables, self._lens
        changed = [r for r, (table, old, length, old_length)
                   in enumerate(zip(block_tables, written, lens, written_lens))
                   if table is not old or length != old_length]
        for r in changed:
            table, length, old_length = block_tables[r], lens[r], written_lens[r]
            if table is written[r] and length > old_length:  # grown: the new blocks
                host[r, old_length:length] = table[old_length:]
            else:
                host[r, :length] = table
                if old_length > length:
                    host[r, length:old_length] = 0
            written[r], written_lens[r] = table, length
        for r in range(n, len(written)):  # rows no table fills now: back to zero
            if written[r] is None:
                break
            host[r, :written_lens[r]] = 0
            written[r], written_lens[r] = None, 0
        out[:rows * width].reshape(rows, width)[:] = host[:rows, :width]
        return width
