"""The device block pool: fixed-size KV blocks, reference counts, free list, LRU of cached blocks.

Every block is in exactly one of three states:

    used       ref_count > 0                  held by one or more block tables
    cached     ref_count == 0, has a key      unreferenced but still holding reusable prefix
                                              KV; evictable, least recently released first
    free       ref_count == 0, no key         nothing worth keeping

    allocate():  free list first, else evict the LRU cached block (its hash leaves the index)
    touch(b):    ref_count += 1 (a cached block becomes used again: a prefix hit)
    release(b):  ref_count -= 1; at 0 -> cached (keyed) or free (not keyed)

A used block is never evicted: eviction only takes from the cached LRU. The pool holds no
requests and no queues (nano-vllm's block_manager split): deciding *whether* to allocate is
the KV cache manager's and the scheduler's job; running out is never an exception here, the
caller checks `num_free_blocks` first.
"""

from __future__ import annotations

import logging
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass

from kvmesh.kv.prefix_cache import CachedBlockKey, PrefixCache
from kvmesh.core.seams import PrefixEventKind

logger = logging.getLogger(__name__)


@dataclass
class KVBlock:
    block_id: int
    ref_count: int = 0
    cache_key: CachedBlockKey | None = None  # set while the prefix cache indexes this block


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, prefix_cache: PrefixCache | None = None):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_cache = prefix_cache  # None = prefix caching disabled
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free: deque[int] = deque(range(num_blocks))
        self._cached_lru: OrderedDict[int, None] = OrderedDict()  # first = least recently released
        self.num_evictions = 0
        # Called with (block_id, key) as a cached block is evicted, before its key is dropped:
        # the host tier (kv/host_tier.py) keeps a copy of what the pool forgets. True = this
        # worker still holds the block (in the tier): no EVICTED event for the router.
        self.on_evict: Callable[[int, CachedBlockKey], bool] | None = None

    # ---- counts ----------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take right now (free + evictable cached)."""
        return len(self._free) + len(self._cached_lru)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached_lru)

    @property
    def num_empty_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free) - len(self._cached_lru)

    def ref_count(self, block_id: int) -> int:
        return self.blocks[block_id].ref_count

    def is_cached(self, block_id: int) -> bool:
        """Unreferenced and evictable (touching it takes it off the LRU)."""
        return block_id in self._cached_lru

    # ---- lifetimes -------------------------------------------------------------------------

    def allocate(self) -> int:
        if self._free:
            block_id = self._free.popleft()
        else:
            assert self._cached_lru, "allocate() on an exhausted pool: check num_free_blocks first"
            block_id, _ = self._cached_lru.popitem(last=False)
            kept = self.on_evict is not None and self.on_evict(block_id, self.blocks[block_id].cache_key)
            self._drop_key(self.blocks[block_id], record_event=not kept)
            self.num_evictions += 1
        block = self.blocks[block_id]
        assert block.ref_count == 0 and block.cache_key is None
        block.ref_count = 1
        return block_id

    def touch(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            assert block_id in self._cached_lru, f"touching block {block_id} that is free, not cached"
            del self._cached_lru[block_id]
        block.ref_count += 1

    def release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        assert block.ref_count > 0, f"releasing block {block_id} with ref_count 0"
        block.ref_count -= 1
        if block.ref_count == 0:
            if block.cache_key is not None:
                self._cached_lru[block_id] = None  # most recently released: evicted last
            else:
                self._free.append(block_id)

    # ---- prefix cache ----------------------------------------------------------------------

    def register(self, block_id: int, key: CachedBlockKey) -> bool:
        """Index a full, computed, used block under `key`. False when caching is off, the
        block is already keyed, or another block already holds the hash."""
        block = self.blocks[block_id]
        assert block.ref_count > 0, "only a used block's content is known to be computed"
        if self.prefix_cache is None or block.cache_key is not None:
            return False
        if not self.prefix_cache.insert(key, block_id):
            return False
        block.cache_key = key
        return True

    def lookup(self, key: CachedBlockKey) -> int | None:
        return None if self.prefix_cache is None else self.prefix_cache.lookup(key)

    def clear_cache(self) -> int:
        """Forget every cached prefix (used blocks stay with their holders, unkeyed).
        Returns the number of blocks moved from cached to free."""
        if self.prefix_cache is None:
            return 0
        for block in self.blocks:
            if block.cache_key is not None:  # one CLEARED event stands for all of these
                self.prefix_cache.remove(block.cache_key, block.block_id, record_event=False)
                block.cache_key = None
        moved = len(self._cached_lru)
        self._free.extend(self._cached_lru)
        self._cached_lru.clear()
        self.prefix_cache.events.record(PrefixEventKind.CLEARED)
        return moved

    def _drop_key(self, block: KVBlock, record_event: bool = True) -> None:
        assert self.prefix_cache is not None and block.cache_key is not None
        self.prefix_cache.remove(block.cache_key, block.block_id, record_event)
        block.cache_key = None

    # ---- invariants ------------------------------------------------------------------------

    def check_integrity(self) -> None:
        free = set(self._free)
        assert len(free) == len(self._free), "duplicate block in the free list"
        assert not (free & set(self._cached_lru)), "a block is both free and cached"
        for block in self.blocks:
            if block.block_id in free:
                assert block.ref_count == 0 and block.cache_key is None, f"free block {block.block_id} in use or keyed"
            elif block.block_id in self._cached_lru:
                assert block.ref_count == 0 and block.cache_key is not None, f"cached block {block.block_id} bad state"
            else:
                assert block.ref_count > 0, f"block {block.block_id} is lost: unreferenced, not free, not cached"
        assert len(free) + len(self._cached_lru) + self.num_used_blocks == self.num_blocks
        if self.prefix_cache is None:
            assert all(b.cache_key is None for b in self.blocks)
            return
        indexed = self.prefix_cache.items()
        assert len(indexed) == sum(b.cache_key is not None for b in self.blocks), "index and block keys disagree"
        for key, block_id in indexed:
            assert self.blocks[block_id].cache_key == key, f"index maps {key.block_hash.hex()} to the wrong block"
