"""Per-request block tables on top of the block pool; prefix-cache lookups and fills.

A request's tokens `0 .. n-1` live in its block table: token `p` in block
`table[p // block_size]`. A block is *full* once all `block_size` of its tokens have been
computed; only full blocks are ever shared through the prefix cache, so a shared block is
never written again.
"""

from __future__ import annotations

from collections.abc import Sequence

from infer.cache.block_pool import BlockKey, BlockPool

_ROOT_HASH = 0


def block_keys(token_ids: Sequence[int], block_size: int, start_hash: int = _ROOT_HASH,
               skip: int = 0) -> list[BlockKey]:
    """Keys of the full blocks of `token_ids`, each chained to the hash of all before it."""
    keys, parent = [], start_hash
    for i in range(skip * block_size, len(token_ids) - block_size + 1, block_size):
        key = (parent, tuple(token_ids[i:i + block_size]))
        keys.append(key)
        parent = hash(key)
    return keys


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False):
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self.tables: dict[str, list[int]] = {}
        # Keys of each request's full blocks computed so far (in order).
        self._keys: dict[str, list[BlockKey]] = {}
        self.prefix_queries = 0  # tokens looked up
        self.prefix_hits = 0  # tokens found

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def table(self, request_id: str) -> list[int]:
        return self.tables.get(request_id, [])

    def match_prefix(self, request_id: str, token_ids: Sequence[int]) -> int:
        """For a request without blocks: share the longest cached run of its full blocks.
        Returns how many tokens are already computed. At least one token is always left to
        compute, so the step that follows produces logits."""
        assert request_id not in self.tables
        if not self.pool.enable_prefix_caching:
            return 0
        usable = (len(token_ids) - 1) // self.block_size
        keys = block_keys(token_ids[:usable * self.block_size], self.block_size)
        hits = []
        for key in keys:
            block_id = self.pool.lookup(key)
            if block_id is None:
                break
            hits.append(block_id)
        self.prefix_queries += len(token_ids)
        self.prefix_hits += len(hits) * self.block_size
        for block_id in hits:
            self.pool.share(block_id)
        self.tables[request_id] = hits
        self._keys[request_id] = keys[:len(hits)]
        return len(hits) * self.block_size

    def share_prefix(self, request_id: str, source_id: str, num_tokens: int) -> int:
        """Give a new request the first full blocks (up to `num_tokens`) of another request
        (n > 1 siblings). Returns the tokens covered."""
        assert request_id not in self.tables
        count = min(num_tokens // self.block_size, len(self._keys.get(source_id, [])))
        shared = self.tables[source_id][:count]
        for block_id in shared:
            self.pool.share(block_id)
        self.tables[request_id] = list(shared)
        self._keys[request_id] = self._keys[source_id][:count]
        return count * self.block_size

    def allocate(self, request_id: str, total_tokens: int) -> bool:
        """Grow the request's table to hold `total_tokens`; False (and no change) if the
        pool has too few free blocks."""
        table = self.tables.get(request_id)
        if table is not None and len(table) * self.block_size >= total_tokens:
            return True  # the common case (a decode step inside its last block), first
        table = self.tables.setdefault(request_id, [])
        self._keys.setdefault(request_id, [])
        need = self.blocks_needed(total_tokens) - len(table)
        if need <= 0:
            return True
        if need > self.pool.num_free:
            return False
        table.extend(self.pool.allocate(need))
        return True

    def trim(self, request_id: str, num_tokens: int) -> None:
        """Give back the blocks past the first `num_tokens` tokens (slots of rejected draft
        tokens). They were never full with computed tokens, so none is in the cache."""
        table = self.tables[request_id]
        keep = self.blocks_needed(num_tokens)
        assert keep >= len(self._keys[request_id])
        self.pool.release(table[keep:][::-1])
        # A new list, not the old one cut: a table list only grows (TablePacker's rule)
        self.tables[request_id] = table[:keep]

    def commit_computed(self, request_id: str, token_ids: Sequence[int], num_computed: int):
        """Register the request's newly full blocks in the prefix cache."""
        keys = self._keys[request_id]
        full = num_computed // self.block_size
        if full <= len(keys):
            return
        parent = hash(keys[-1]) if keys else _ROOT_HASH
        new = block_keys(token_ids[:full * self.block_size], self.block_size, parent,
                         skip=len(keys))
        table = self.tables[request_id]
        for key in new:
            self.pool.register(table[len(keys)], key)
            keys.append(key)

    def free(self, request_id: str) -> None:
        table = self.tables.pop(request_id, [])
        self._keys.pop(request_id, None)
        self.pool.release(table[::-1])
