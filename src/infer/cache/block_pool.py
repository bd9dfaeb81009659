"""The pool of KV-cache blocks: reference counts, an LRU free list, and the prefix cache.

Pure Python on ints (no torch), so it can be tested exactly and quickly.

Invariants:
- a block is in the free list iff its reference count is 0;
- a free block may still hold a cached prefix (its hash stays in `cached` until the block
  is handed out again), so a later request can revive it: that is the LRU prefix cache;
- the free list is ordered oldest-freed first, and allocation takes from the front, so the
  least recently used cached block is evicted first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

BlockKey = tuple[int, tuple[int, ...]]  # (hash of the whole prefix, this block's tokens)


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    # Set while the block holds a full, reusable block of tokens.
    key: BlockKey | None = None


class BlockPool:
    def __init__(self, num_blocks: int, enable_prefix_caching: bool = False) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[BlockKey, int] = {}
        self.evictions = 0

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free)

    def allocate(self, count: int) -> list[int]:
        """Take `count` blocks (reference count 1 each), evicting cached prefixes LRU-first."""
        if count > len(self.free):
            raise MemoryError(f"asked for {count} KV blocks, {len(self.free)} free")
        ids = []
        for _ in range(count):
            block_id, _ = self.free.popitem(last=False)
            block = self.blocks[block_id]
            if block.key is not None:
                del self.cached[block.key]
                block.key = None
                self.evictions += 1
            block.ref_count = 1
            ids.append(block_id)
        return ids

    def release(self, block_ids: Sequence[int]) -> None:
        """Drop one reference from each block; blocks reaching 0 join the free list's tail
        in the given order (callers pass a sequence's blocks last-first, so its prefix,
        the most shareable part, is evicted last)."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count <= 0:
                raise RuntimeError(f"double free of KV block {block_id}")
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free[block_id] = None

    def share(self, block_id: int) -> None:
        """Add a reference to a block (a prefix-cache hit, or a sibling sequence)."""
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free[block_id]
        block.ref_count += 1

    def lookup(self, key: BlockKey) -> int | None:
        return self.cached.get(key) if self.enable_prefix_caching else None

    def register(self, block_id: int, key: BlockKey) -> None:
        """Record that `block_id` holds the full block `key` (first writer wins)."""
        if not self.enable_prefix_caching or key in self.cached:
            return
        self.blocks[block_id].key = key
        self.cached[key] = block_id
