"""Block pool and KV manager: exact block ids, reference counts and LRU eviction order."""

from __future__ import annotations

import pytest
import torch

from infer.attention.metadata import padded_block_tables
from infer.cache.block_pool import BlockPool
from infer.cache.kv_manager import KVCacheManager, block_keys


def test_allocate_takes_lowest_free_ids_in_order():
    pool = BlockPool(4)
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.num_free == 1
    with pytest.raises(MemoryError):
        pool.allocate(2)


def test_release_appends_to_free_tail_and_detects_double_free():
    pool = BlockPool(4)
    a = pool.allocate(4)
    pool.release([a[2], a[0]])
    assert list(pool.free) == [2, 0]
    assert pool.allocate(1) == [2]
    with pytest.raises(RuntimeError, match="double free"):
        pool.release([0])  # block 0 is already free


def test_shared_block_freed_only_at_last_reference():
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    pool.share(b)
    pool.release([b])
    assert pool.num_free == 1
    pool.release([b])
    assert pool.num_free == 2


def test_prefix_cache_hit_and_lru_eviction_order():
    kv = KVCacheManager(num_blocks=6, block_size=2, enable_prefix_caching=True)
    a = [1, 2, 3, 4, 5]  # two full blocks + one token
    assert kv.match_prefix("a", a) == 0
    assert kv.allocate("a", 5)
    assert kv.table("a") == [0, 1, 2]
    kv.commit_computed("a", a, 5)
    kv.free("a")
    # Freed last-first: the tail block is evicted first, the prefix last.
    assert list(kv.pool.free)[-3:] == [2, 1, 0]
    b = [1, 2, 3, 4, 9, 9, 9]
    assert kv.match_prefix("b", b) == 4
    assert kv.table("b") == [0, 1]
    assert kv.pool.blocks[0].ref_count == 1
    assert (kv.prefix_queries, kv.prefix_hits) == (5 + 7, 4)
    # The oldest free blocks are 3, 4, 5 (never used), then 2 (a's partial tail).
    assert kv.allocate("b", 7)
    assert kv.table("b") == [0, 1, 3, 4]
    c = list(range(100, 106))
    assert kv.match_prefix("c", c) == 0
    assert kv.allocate("c", 4)
    assert kv.table("c") == [5, 2]
    assert kv.pool.evictions == 0  # block 2 held no full block
    kv.commit_computed("b", b, 7)
    kv.free("b")
    kv.free("c")
    # Evicting now removes cached prefixes in LRU order.
    kv2_blocks = kv.pool.allocate(6)
    assert sorted(kv2_blocks) == list(range(6))
    assert kv.pool.cached == {}


def test_match_prefix_always_leaves_one_token_to_compute():
    kv = KVCacheManager(num_blocks=4, block_size=2, enable_prefix_caching=True)
    tokens = [7, 8, 9, 10]
    kv.match_prefix("a", tokens)
    kv.allocate("a", 4)
    kv.commit_computed("a", tokens, 4)
    assert kv.match_prefix("b", tokens) == 2  # not 4: the last token must produce logits


def test_prefix_caching_disabled_never_hits():
    kv = KVCacheManager(num_blocks=4, block_size=2, enable_prefix_caching=False)
    tokens = [1, 2, 3, 4, 5]
    kv.match_prefix("a", tokens)
    kv.allocate("a", 5)
    kv.commit_computed("a", tokens, 5)
    kv.free("a")
    assert kv.match_prefix("b", tokens) == 0


def test_block_keys_chain_whole_prefix():
    keys_a = block_keys([1, 2, 3, 4], 2)
    keys_b = block_keys([9, 9, 3, 4], 2)
    assert keys_a[1][1] == keys_b[1][1] == (3, 4)
    assert keys_a[1] != keys_b[1]  # same tokens, different prefix


def test_share_prefix_between_siblings():
    kv = KVCacheManager(num_blocks=8, block_size=2)
    prompt = [1, 2, 3, 4, 5]
    kv.allocate("a", 5)
    kv.commit_computed("a", prompt, 5)
    assert kv.share_prefix("a#1", "a", 4) == 4
    assert kv.table("a#1") == kv.table("a")[:2]
    assert kv.pool.blocks[kv.table("a")[0]].ref_count == 2
    kv.free("a")
    kv.free("a#1")
    assert kv.pool.num_free == 8


@pytest.mark.parametrize("tables, rows", [
    ([[3, 1, 4], [1], [5, 9]], None),
    ([[3, 1, 4], [1], [5, 9]], 5),  # padding rows, as a CUDA-graph batch size
    ([[7]], 1),
    ([], 2),
])
def test_padded_block_tables(tables, rows):
    width = max(map(len, tables), default=0)
    n = len(tables) if rows is None else rows
    expected = [t + [0] * (width - len(t)) for t in tables] + [[0] * width] * (n - len(tables))
    out = padded_block_tables(tables, rows)
    assert out.dtype == torch.int32 and tuple(out.shape) == (n, width)
    assert out.tolist() == expected
