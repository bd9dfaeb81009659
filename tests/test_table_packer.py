"""TablePacker against a fresh pack of every row (`pack_block_tables`), over random steps
that grow tables in place, give sequences new (shorter) tables, reorder, drop and add rows,
as the KV manager and the scheduler do between two steps."""

from __future__ import annotations

import random

import numpy as np

from infer.attention.metadata import pack_block_tables
from infer.attention.table_packer import TablePacker
from infer.cache.kv_manager import KVCacheManager

MAX_ROWS, MAX_BLOCKS = 12, 9


def test_the_packer_writes_what_a_full_pack_writes_step_after_step() -> None:
    rng = random.Random(0)
    packer = TablePacker(MAX_ROWS, MAX_BLOCKS)
    tables = [[rng.randrange(100) for _ in range(rng.randrange(1, 4))] for _ in range(8)]
    for _ in range(400):
        for _ in range(rng.randrange(4)):
            action, r = rng.randrange(5), rng.randrange(len(tables))
            if action == 0 and len(tables[r]) < MAX_BLOCKS:  # grows in place
                tables[r].extend(rng.randrange(100) for _ in range(
                    rng.randrange(1, MAX_BLOCKS - len(tables[r]) + 1)))
            elif action == 1:  # a new table, as after a trim or a preemption
                tables[r] = [rng.randrange(100) for _ in range(rng.randrange(0, MAX_BLOCKS))]
            elif action == 2:
                rng.shuffle(tables)
            elif action == 3 and len(tables) > 1:
                tables.pop(r)
            elif action == 4 and len(tables) < MAX_ROWS:
                tables.insert(r, [rng.randrange(100) for _ in range(rng.randrange(1, 4))])
        rows = rng.randrange(len(tables), MAX_ROWS + 1)
        got = np.full(MAX_ROWS * MAX_BLOCKS, -7, dtype=np.int32)
        want = np.full(MAX_ROWS * MAX_BLOCKS, -7, dtype=np.int32)
        width = packer.pack(tables, rows, got)
        assert width == pack_block_tables(tables, rows, want)
        np.testing.assert_array_equal(got[:rows * width], want[:rows * width])


def test_a_trimmed_table_is_a_new_list_and_a_grown_one_the_same() -> None:
    """The rule the packer relies on: a table list only grows; a trim gives a new one."""
    kv = KVCacheManager(num_blocks=16, block_size=4)
    assert kv.allocate("a", 9)
    table = kv.tables["a"]
    assert kv.allocate("a", 16) and kv.tables["a"] is table and len(table) == 4
    kv.trim("a", 5)
    assert kv.tables["a"] is not table and kv.tables["a"] == table[:2]
