"""Block pool and KV cache manager: allocation, refcounts, LRU eviction, fragmentation, swap."""

import pytest

from kvmesh.kv.block_pool import BlockPool
from kvmesh.kv.kv_cache_manager import KVCacheManager, PrefixMatch
from kvmesh.kv.prefix_cache import CachedBlockKey, PrefixCache
from kvmesh.core.seams import SamplingParams
from kvmesh.worker.engine_loop.request import Request


def key(n: int) -> CachedBlockKey:
    return CachedBlockKey(block_hash=bytes([n]) * 16, parent_hash=None, token_ids=(n,), extra_keys=())


def make_request(rid: str, prompt: list[int]) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=4), arrival_time=0.0)


def test_allocate_release_refcounts_and_states():
    pool = BlockPool(4, 16, PrefixCache())
    a, b = pool.allocate(), pool.allocate()
    assert (pool.num_used_blocks, pool.num_free_blocks) == (2, 2)
    pool.touch(a)
    assert pool.ref_count(a) == 2
    pool.release(a)
    assert pool.ref_count(a) == 1 and pool.num_used_blocks == 2
    assert pool.register(a, key(1))
    pool.release(a)  # keyed: stays cached, evictable
    pool.release(b)  # unkeyed: straight to the free list
    assert (pool.num_used_blocks, pool.num_cached_blocks, pool.num_empty_blocks) == (0, 1, 3)
    assert pool.lookup(key(1)) == a
    pool.touch(a)  # a prefix hit revives the cached block
    assert pool.ref_count(a) == 1 and pool.num_cached_blocks == 0
    pool.check_integrity()


def test_lru_eviction_order_and_referenced_blocks_survive():
    pool = BlockPool(3, 4, PrefixCache())
    blocks = [pool.allocate() for _ in range(3)]
    for n, block in enumerate(blocks):
        pool.register(block, key(n))
    pool.release(blocks[1])  # released first: least recently used
    pool.release(blocks[0])
    # blocks[2] stays referenced
    first = pool.allocate()
    assert first == blocks[1] and pool.lookup(key(1)) is None  # evicted, hash gone
    second = pool.allocate()
    assert second == blocks[0] and pool.lookup(key(0)) is None
    assert pool.num_free_blocks == 0  # the referenced block is never taken
    assert pool.lookup(key(2)) == blocks[2] and pool.ref_count(blocks[2]) == 1
    assert pool.num_evictions == 2
    pool.check_integrity()


def test_touch_refreshes_lru_position():
    pool = BlockPool(2, 4, PrefixCache())
    a, b = pool.allocate(), pool.allocate()
    pool.register(a, key(1))
    pool.register(b, key(2))
    pool.release(a)
    pool.release(b)
    pool.touch(a)  # a used again: now b is the least recently released
    pool.release(a)
    assert pool.allocate() == b


def test_register_keeps_first_holder_and_needs_caching_enabled():
    pool = BlockPool(3, 4, PrefixCache())
    a, b = pool.allocate(), pool.allocate()
    assert pool.register(a, key(7))
    assert not pool.register(b, key(7))  # same hash: the first holder stays
    assert pool.lookup(key(7)) == a
    off = BlockPool(2, 4, None)
    block = off.allocate()
    assert not off.register(block, key(7)) and off.lookup(key(7)) is None


def test_manager_block_table_grows_one_block_at_a_time_and_fragmentation():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    req = make_request("r", list(range(10)))
    assert kv.can_allocate(req, 10, PrefixMatch([], 0))
    kv.allocate(req, 10, PrefixMatch([], 0))
    assert len(req.block_ids) == 3  # ceil(10 / 4)
    req.num_computed_tokens = 10
    stats = kv.stats()
    assert (stats.kv_tokens_used, stats.kv_slots_allocated, stats.fragmentation_tokens) == (10, 12, 2)
    kv.append(req, 2)  # slots 10, 11 fit in the third block
    assert len(req.block_ids) == 3
    req.num_computed_tokens = 12
    kv.append(req, 1)
    assert len(req.block_ids) == 4
    req.num_computed_tokens = 13
    stats = kv.stats()
    assert (stats.kv_tokens_used, stats.kv_slots_allocated, stats.fragmentation_tokens) == (13, 16, 3)
    kv.check_integrity()
    kv.free(req)
    assert req.block_ids == [] and kv.pool.num_used_blocks == 0
    kv.check_integrity()


def test_can_append_and_can_allocate_count_free_and_cached_blocks():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    a = make_request("a", list(range(8)))
    kv.allocate(a, 8, kv.match_prefix(a))
    a.num_computed_tokens = 8
    kv.cache_full_blocks(a)
    kv.free(a)  # both full blocks stay cached
    assert kv.pool.num_cached_blocks == 2 and kv.pool.num_free_blocks == 4
    b = make_request("b", list(range(8)) + [99])
    match = kv.match_prefix(b)
    assert match.num_tokens == 8
    # 9 tokens: share 2 cached blocks (they leave the LRU), need 1 more of the 2 empty ones.
    assert kv.can_allocate(b, 1, match)
    assert not kv.can_allocate(b, 1 + 12, match)
    kv.allocate(b, 1, match)
    assert kv.pool.num_free_blocks == 1 and kv.can_append(b, 8) and not kv.can_append(b, 9)
    kv.check_integrity()


def test_swap_out_and_in_move_only_computed_blocks():
    kv = KVCacheManager(num_blocks=4, block_size=4, num_cpu_blocks=2)
    req = make_request("s", list(range(7)))
    kv.allocate(req, 7, PrefixMatch([], 0))
    req.num_computed_tokens = 7
    device_blocks = list(req.block_ids)
    pairs = kv.swap_out(req)
    assert [d for d, _ in pairs] == device_blocks and len(pairs) == 2
    assert req.block_ids == [] and kv.is_swapped(req) and kv.swap.num_free_blocks == 0
    kv.check_integrity()
    assert kv.can_swap_in(req, 1)
    back = kv.swap_in(req, 1)
    assert [c for c, _ in back] == [c for _, c in pairs]
    assert len(req.block_ids) == 2 and kv.swap.num_free_blocks == 2  # 7 + 1 slots = 2 blocks
    kv.check_integrity()
    kv.free(req)
    kv.check_integrity()


def test_swap_out_refuses_when_swap_space_is_full():
    kv = KVCacheManager(num_blocks=4, block_size=4, num_cpu_blocks=1)
    req = make_request("s", list(range(7)))
    kv.allocate(req, 7, PrefixMatch([], 0))
    req.num_computed_tokens = 7
    assert kv.swap_out(req) is None
    assert len(req.block_ids) == 2 and kv.holds(req)  # unchanged
    kv.check_integrity()


def test_check_integrity_catches_a_corrupted_refcount():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    req = make_request("r", list(range(5)))
    kv.allocate(req, 5, PrefixMatch([], 0))
    kv.pool.blocks[req.block_ids[0]].ref_count += 1
    with pytest.raises(AssertionError):
        kv.check_integrity()
