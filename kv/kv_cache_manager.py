"""Per-request KV block tables over the block pool: allocate, append, fork, swap, free.

One rule covers prefill, chunked prefill, prefix hits and recompute (vLLM v1): a request's
`num_computed_tokens` catches up with its `num_tokens`, and its block table covers the
token slots it has been granted so far:

    block_size = 4, prompt of 10 tokens, 4 of them found in the prefix cache
    match_prefix       -> PrefixMatch(block_ids=[12], num_tokens=4)
    allocate(n=6)      -> block_ids [12, 40, 41]   covers 4 + 6 = 10 slots (ceil(10/4) = 3)
    (forward runs)        num_computed_tokens 4 -> 10; token 11 is sampled and appended
    cache_full_blocks  -> block 40 (tokens 4..7) becomes reusable under its chain hash
    append(n=1)        -> still 3 blocks (slot 10 fits in block 41)

At least the last known token is always computed, so the model yields logits: a prefix hit
is capped at (num_tokens - 1) // block_size full blocks.

The manager needs from a request only the fields of `KVRequest` (duck-typed: kv/ never
imports the worker's Request; from worker/ it takes only the torch-free seam types of
core/seams.py that the router also reads, the prefix events). Predicates `can_allocate` / `can_append` / `can_fork` /
`can_swap_in` answer before the mutating call; running out of blocks is the scheduler's
decision to make (wait or preempt), never an exception here.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Collection
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from kvmesh.kv import hashing
from kvmesh.kv.block_pool import BlockPool
from kvmesh.kv.host_tier import HostTier, TierCopies, TierStats
from kvmesh.kv.prefix_cache import CachedBlockKey, PrefixCache, PrefixEventLog
from kvmesh.kv.swap_space import SwapSpace
from kvmesh.core.seams import PrefixEventBatch, PrefixEventKind

logger = logging.getLogger(__name__)

BlockPair = tuple[int, int]  # (source block, destination block) of one copy


class KVRequest(Protocol):
    request_id: str
    num_computed_tokens: int
    block_ids: list[int]
    block_hashes: list[bytes]
    extra_keys: tuple[str, ...]

    @property
    def all_token_ids(self) -> list[int]: ...

    @property
    def num_tokens(self) -> int: ...

    @property
    def num_prompt_tokens(self) -> int: ...


class PrefixMatch(NamedTuple):
    block_ids: list[int]  # cached blocks to share, in block-table order
    num_tokens: int  # tokens they and the tier blocks cover (a multiple of block_size)
    # The host-tier blocks right after block_ids, (slot, content checksum) each: copied back
    # onto fresh device blocks instead of recomputed (see match_tier).
    tier_slots: tuple[tuple[int, int], ...] = ()

    def resident(self) -> "PrefixMatch":
        """The part already in the device pool."""
        if not self.tier_slots:
            return self
        return PrefixMatch(self.block_ids, self.num_tokens * len(self.block_ids)
                           // (len(self.block_ids) + len(self.tier_slots)))


@dataclass(frozen=True)
class KVCacheStats:
    block_size: int
    num_blocks_total: int
    num_blocks_used: int  # referenced by block tables
    num_blocks_cached: int  # unreferenced, reusable prefix KV (evictable)
    num_blocks_free: int  # neither
    kv_tokens_used: int  # tokens whose KV sits in used blocks (shared blocks counted once)
    kv_slots_allocated: int  # num_blocks_used * block_size
    fragmentation_tokens: int  # allocated slots not holding a token (the partial tails)
    prefix_query_tokens: int
    prefix_hit_tokens: int
    prefix_hit_rate: float
    num_prefix_collisions: int
    num_evictions: int
    num_cpu_blocks_total: int
    num_cpu_blocks_used: int
    tier: TierStats | None = None  # the host tier's figures (None: no tier)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = True,
                 num_cpu_blocks: int = 0, worker_id: str = "", max_events: int = 4096,
                 num_host_tier_blocks: int = 0):
        self.block_size = block_size
        self.prefix_cache = PrefixCache(worker_id, max_events) if enable_prefix_caching else None
        # With caching off there are never events; the log still answers the router politely.
        self.events = PrefixEventLog(worker_id, max_events) if self.prefix_cache is None else self.prefix_cache.events
        self.pool = BlockPool(num_blocks, block_size, self.prefix_cache)
        self.swap = SwapSpace(num_cpu_blocks)
        self._holders: dict[str, KVRequest] = {}  # requests with a device block table
        self._num_granted_tokens: dict[str, int] = {}  # token slots each block table was grown for
        self._num_registered_blocks: dict[str, int] = {}  # leading blocks already offered to the cache
        self._swapped: dict[str, KVRequest] = {}
        # Prefix blocks a queued request was admitted against (see pin_prefix): held from
        # admission to its end, so what its reservation counted as cached stays resident.
        self._pins: dict[str, list[int]] = {}
        # The host tier below the pool (kv/host_tier.py): evicted cached blocks are copied
        # there, and a prefix lookup continues into it past the pool's hits.
        self.host_tier: HostTier | None = None
        if num_host_tier_blocks > 0 and self.prefix_cache is not None:
            self.host_tier = HostTier(num_host_tier_blocks, block_size)
            self.pool.on_evict = self.host_tier.store_evicted
            self.host_tier.on_drop = self._tier_dropped

    @property
    def enable_prefix_caching(self) -> bool:
        return self.prefix_cache is not None

    @property
    def capacity_tokens(self) -> int:
        return self.pool.num_blocks * self.block_size

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def holds(self, request: KVRequest) -> bool:
        return request.request_id in self._holders

    def is_swapped(self, request: KVRequest) -> bool:
        return request.request_id in self._swapped

    # ---- hashing and prefix lookup -------------------------------------------------------

    def update_block_hashes(self, request: KVRequest) -> None:
        """Extend request.block_hashes to every full block of its known tokens."""
        if self.prefix_cache is None:
            return
        tokens = request.all_token_ids
        bs = self.block_size
        for i in range(len(request.block_hashes), len(tokens) // bs):
            parent = request.block_hashes[i - 1] if i else None
            # Looked up through the module so a test can make hashes collide on purpose.
            request.block_hashes.append(hashing.hash_block(parent, tokens[i * bs:(i + 1) * bs], request.extra_keys))

    def _key(self, request: KVRequest, index: int) -> CachedBlockKey:
        bs = self.block_size
        return CachedBlockKey(
            block_hash=request.block_hashes[index],
            parent_hash=request.block_hashes[index - 1] if index else None,
            token_ids=tuple(request.all_token_ids[index * bs:(index + 1) * bs]),
            extra_keys=tuple(request.extra_keys),
        )

    def match_prefix(self, request: KVRequest) -> PrefixMatch:
        """The longest run of cached full blocks at the start of the request's tokens,
        leaving at least the last token to compute. Changes nothing."""
        if self.prefix_cache is None or request.num_tokens == 0:
            return PrefixMatch([], 0)
        self.update_block_hashes(request)
        max_blocks = min((request.num_tokens - 1) // self.block_size, len(request.block_hashes))
        block_ids: list[int] = []
        for index in range(max_blocks):
            block_id = self.pool.lookup(self._key(request, index))
            if block_id is None:
                break
            block_ids.append(block_id)
        return PrefixMatch(block_ids, len(block_ids) * self.block_size)

    # ---- the host tier -------------------------------------------------------------------

    def match_tier(self, request: KVRequest, match: PrefixMatch) -> PrefixMatch:
        """Extend a pool match with the ready host-tier blocks that follow it (same cap: the
        last token is always computed). Changes nothing; the content check is in allocate."""
        if self.host_tier is None or match.tier_slots:
            return match
        max_blocks = min((request.num_tokens - 1) // self.block_size, len(request.block_hashes))
        first = len(match.block_ids)
        slots = self.host_tier.lookup_run(self._key(request, i) for i in range(first, max_blocks))
        return PrefixMatch(match.block_ids, (first + len(slots)) * self.block_size, tuple(slots))

    def _verified(self, request: KVRequest, match: PrefixMatch) -> PrefixMatch:
        """`match` cut at the first tier block whose bytes fail their checksum (dropped)."""
        if not match.tier_slots:
            return match
        first = len(match.block_ids)
        keys = [self._key(request, first + i) for i in range(len(match.tier_slots))]
        kept = self.host_tier.num_verified(keys, match.tier_slots)
        if kept == len(match.tier_slots):
            return match
        return PrefixMatch(match.block_ids, (first + kept) * self.block_size, match.tier_slots[:kept])

    def _tier_dropped(self, block_hash: bytes) -> None:
        """The router's view (prefix events) covers pool and tier: a block the pool evicts into
        the tier is still this worker's (no EVICTED); one leaving the tier is gone unless the
        pool holds it again."""
        if self.prefix_cache.holder(block_hash) is None:
            self.events.record(PrefixEventKind.EVICTED, block_hash)

    def take_tier_copies(self) -> TierCopies:
        return self.host_tier.take_copies() if self.host_tier is not None else TierCopies((), ())

    # ---- pins: cached prefix blocks held for an admitted request --------------------------

    def pin_prefix(self, request: KVRequest) -> PrefixMatch:
        """Hold the request's cached prefix blocks (ref_count + 1) until `unpin`, so the
        admission that counted them as already allocated stays true while it waits, across
        preemption by recompute too. Returns what was pinned (empty with caching off)."""
        assert request.request_id not in self._pins, f"{request.request_id} already pinned"
        match = self.match_prefix(request)
        for block_id in match.block_ids:
            self.pool.touch(block_id)
        self._pins[request.request_id] = list(match.block_ids)
        return match

    def extend_pin(self, request: KVRequest, match: PrefixMatch) -> None:
        """Pin the blocks of `match` past those already pinned (the request found more of its
        prefix resident than at admission). A match shorter than the pins changes nothing."""
        pins = self._pins.setdefault(request.request_id, [])
        if match.block_ids[:len(pins)] != pins:
            return
        for block_id in match.block_ids[len(pins):]:
            self.pool.touch(block_id)
            pins.append(block_id)

    def unpin(self, request: KVRequest) -> None:
        """Release the blocks `pin_prefix` held (a no-op for a request never pinned)."""
        for block_id in reversed(self._pins.pop(request.request_id, [])):
            self.pool.release(block_id)

    def num_pinned_blocks_unowned(self, without: Collection[str] = ()) -> int:
        """Distinct pinned blocks that no request's own allocation covers: the shared prefix
        blocks no admission reservation pays for (each counted once, however many share it).

        A block in a request's table that it did not pin is one its reservation paid for
        (prompt + output less its pinned prefix); a pinned block outside every such table
        (a reused cached block, or one whose allocating request has finished) is paid by nobody.
        `without`: as if these requests held no pins and no blocks (preempted and unpinned)."""
        pinned = {b for rid, blocks in self._pins.items() if rid not in without for b in blocks}
        if not pinned:
            return 0
        owned: set[int] = set()
        for rid, request in self._holders.items():
            if rid not in without:
                owned.update(set(request.block_ids).difference(self._pins.get(rid, ())))
        return len(pinned - owned)

    def record_prefix_query(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        if self.prefix_cache is not None:
            self.prefix_cache.record_query(num_query_tokens, num_hit_tokens)

    # ---- allocation ----------------------------------------------------------------------

    def can_allocate(self, request: KVRequest, num_new_tokens: int, match: PrefixMatch) -> bool:
        """Room for a request without blocks: share `match`, then `num_new_tokens` more."""
        needed = self.blocks_for(match.num_tokens + num_new_tokens) - len(match.block_ids)
        revived = sum(self.pool.is_cached(b) for b in match.block_ids)  # leave the LRU when shared
        return needed <= self.pool.num_free_blocks - revived

    def allocate(self, request: KVRequest, num_new_tokens: int, match: PrefixMatch) -> PrefixMatch:
        """Share `match`'s pool blocks, copy its tier blocks back onto fresh ones (those whose
        bytes pass the content check) and grow the table by `num_new_tokens`. Returns the
        match served (shorter than `match` when a tier block failed its check: the rest is
        computed, within the same number of new tokens, so fewer blocks are needed)."""
        assert not self.holds(request) and not self.is_swapped(request), f"{request.request_id} already has blocks"
        assert self.can_allocate(request, num_new_tokens, match)
        match = self._verified(request, match)
        for block_id in match.block_ids:
            self.pool.touch(block_id)
        for slot, _ in match.tier_slots:  # before _grow, whose evictions store into the tier
            self.host_tier.hold(slot)
        request.block_ids = list(match.block_ids)
        request.num_computed_tokens = match.num_tokens
        self._start_holding(request, granted=match.num_tokens, registered=len(match.block_ids))
        self._grow(request, match.num_tokens + num_new_tokens)
        for i, (slot, _) in enumerate(match.tier_slots):
            self.host_tier.load(slot, request.block_ids[len(match.block_ids) + i])
        return match

    def can_append(self, request: KVRequest, num_new_tokens: int) -> bool:
        needed = self.blocks_for(request.num_computed_tokens + num_new_tokens) - len(request.block_ids)
        return needed <= self.pool.num_free_blocks

    def append(self, request: KVRequest, num_new_tokens: int) -> None:
        assert self.holds(request), f"{request.request_id} holds no blocks"
        assert self.can_append(request, num_new_tokens)
        self._grow(request, request.num_computed_tokens + num_new_tokens)

    def trim(self, request: KVRequest) -> None:
        """Give back the slots granted past num_computed_tokens (drafted tokens the target
        rejected): whole blocks past the last computed token return to the pool. Those
        blocks were never full of computed tokens, so none is registered in the prefix cache."""
        assert self.holds(request), f"{request.request_id} holds no blocks"
        keep = self.blocks_for(request.num_computed_tokens)
        assert keep >= self._num_registered_blocks[request.request_id], "trimming a cached block"
        for block_id in reversed(request.block_ids[keep:]):
            self.pool.release(block_id)
        del request.block_ids[keep:]
        self._num_granted_tokens[request.request_id] = request.num_computed_tokens

    def _start_holding(self, request: KVRequest, granted: int, registered: int) -> None:
        self._holders[request.request_id] = request
        self._num_granted_tokens[request.request_id] = granted
        self._num_registered_blocks[request.request_id] = registered

    def _grow(self, request: KVRequest, num_tokens: int) -> None:
        while len(request.block_ids) < self.blocks_for(num_tokens):
            request.block_ids.append(self.pool.allocate())
        rid = request.request_id
        self._num_granted_tokens[rid] = max(self._num_granted_tokens[rid], num_tokens)

    # ---- fork (n > 1 samples of one prompt) -------------------------------------------------

    def can_fork(self, source: KVRequest, child: KVRequest, num_new_tokens: int) -> bool:
        start = child.num_prompt_tokens - 1
        shared = start // self.block_size
        return self.blocks_for(start + num_new_tokens) - shared <= self.pool.num_free_blocks

    def fork(self, source: KVRequest, child: KVRequest, num_new_tokens: int) -> list[BlockPair]:
        """Give `child` the prompt KV of `source`, which has computed the same prompt.

        The child recomputes the last prompt token for its own logits, so it starts at
        num_computed_tokens = prompt_len - 1: it shares every block wholly before that
        position and gets a private copy of the block holding it (copy-on-write):

            prompt_len = 10, block_size = 4: position 9 is in block 2
            source  [a][b][c]      child [a][b][c']    c' = copy of c (slot 8 kept, 9 recomputed)

        Returns the copies (source block, child block) the engine performs before the forward.
        """
        num_prompt = child.num_prompt_tokens
        assert source.all_token_ids[:num_prompt] == child.all_token_ids[:num_prompt], "fork across different prompts"
        assert self.holds(source) and source.num_computed_tokens >= num_prompt, "fork source has not prefilled"
        assert not self.holds(child) and not self.is_swapped(child)
        assert self.can_fork(source, child, num_new_tokens)
        start = num_prompt - 1
        num_shared = start // self.block_size
        shared = source.block_ids[:num_shared]
        for block_id in shared:
            self.pool.touch(block_id)
        child.block_ids = list(shared)
        child.num_computed_tokens = start
        self._start_holding(child, granted=start, registered=num_shared)
        self._grow(child, start + num_new_tokens)
        if start % self.block_size == 0:
            return []  # the last prompt token opens a fresh block: nothing earlier to copy
        return [(source.block_ids[num_shared], child.block_ids[num_shared])]

    # ---- after a forward -----------------------------------------------------------------

    def cache_full_blocks(self, request: KVRequest) -> None:
        """Offer the request's newly computed full blocks to the prefix cache."""
        if self.prefix_cache is None or not self.holds(request):
            return
        self.update_block_hashes(request)
        rid = request.request_id
        num_full = min(request.num_computed_tokens // self.block_size, len(request.block_hashes),
                       len(request.block_ids))
        for index in range(self._num_registered_blocks[rid], num_full):
            self.pool.register(request.block_ids[index], self._key(request, index))
        self._num_registered_blocks[rid] = max(self._num_registered_blocks[rid], num_full)

    def free(self, request: KVRequest) -> None:
        """Return every block the request holds, device or CPU. Full blocks stay cached.

        Released tail-first so the LRU evicts a prefix's tail before its head (a later
        request can still match the head)."""
        rid = request.request_id
        if rid in self._holders:
            for block_id in reversed(request.block_ids):
                self.pool.release(block_id)
            del self._holders[rid], self._num_granted_tokens[rid], self._num_registered_blocks[rid]
        if rid in self._swapped:
            self.swap.give_back(rid)
            del self._swapped[rid]
        request.block_ids = []

    # ---- swap ------------------------------------------------------------------------------

    def swap_out(self, request: KVRequest) -> list[BlockPair] | None:
        """Move the request's computed KV to CPU blocks; None when swap space is too small
        (the scheduler then recomputes instead). Returns (device block, CPU block) copies."""
        assert self.holds(request)
        num_blocks = self.blocks_for(request.num_computed_tokens)
        if not self.swap.can_hold(num_blocks):
            return None
        cpu_blocks = self.swap.take(request.request_id, num_blocks)
        pairs = list(zip(request.block_ids[:num_blocks], cpu_blocks))
        self.free(request)  # the device blocks' content is copied before anything reuses them
        self._swapped[request.request_id] = request
        return pairs

    def can_swap_in(self, request: KVRequest, num_new_tokens: int) -> bool:
        assert self.is_swapped(request)
        return self.blocks_for(request.num_computed_tokens + num_new_tokens) <= self.pool.num_free_blocks

    def swap_in(self, request: KVRequest, num_new_tokens: int) -> list[BlockPair]:
        """Bring a swapped request back onto fresh device blocks, with room for
        `num_new_tokens` more. Returns (CPU block, device block) copies."""
        assert self.can_swap_in(request, num_new_tokens)
        rid = request.request_id
        cpu_blocks = self.swap.give_back(rid)
        del self._swapped[rid]
        request.block_ids = [self.pool.allocate() for _ in cpu_blocks]
        self._start_holding(request, granted=request.num_computed_tokens, registered=0)
        self._grow(request, request.num_computed_tokens + num_new_tokens)
        return list(zip(cpu_blocks, request.block_ids))

    # ---- events, stats, invariants --------------------------------------------------------

    def flush_events(self) -> None:
        self.events.flush()

    def events_since(self, seq: int) -> PrefixEventBatch:
        hashes = self.prefix_cache.hashes() if self.prefix_cache is not None else ()
        if self.host_tier is not None:
            hashes = tuple(dict.fromkeys(hashes + self.host_tier.hashes()))
        return self.events.events_since(seq, hashes)

    def reset_prefix_cache(self) -> None:
        self.pool.clear_cache()
        for rid in self._num_registered_blocks:
            # Blocks still held lost their keys; never offer them again (their hashes may
            # now be held by fresher blocks).
            self._num_registered_blocks[rid] = len(self._holders[rid].block_ids)
        self.events.flush()

    def stats(self) -> KVCacheStats:
        filled: dict[int, int] = {}
        for request in self._holders.values():
            for index, block_id in enumerate(request.block_ids):
                in_block = min(self.block_size, max(0, request.num_computed_tokens - index * self.block_size))
                filled[block_id] = max(filled.get(block_id, 0), in_block)
        used_tokens = sum(filled.values())
        slots = self.pool.num_used_blocks * self.block_size
        queries = hits = collisions = 0
        if self.prefix_cache is not None:
            pc = self.prefix_cache
            queries, hits, collisions = pc.num_query_tokens, pc.num_hit_tokens, pc.num_collisions
        return KVCacheStats(
            block_size=self.block_size, num_blocks_total=self.pool.num_blocks,
            num_blocks_used=self.pool.num_used_blocks, num_blocks_cached=self.pool.num_cached_blocks,
            num_blocks_free=self.pool.num_empty_blocks, kv_tokens_used=used_tokens,
            kv_slots_allocated=slots, fragmentation_tokens=slots - used_tokens,
            prefix_query_tokens=queries, prefix_hit_tokens=hits, prefix_hit_rate=hits / queries if queries else 0.0,
            num_prefix_collisions=collisions,
            num_evictions=self.pool.num_evictions, num_cpu_blocks_total=self.swap.num_cpu_blocks,
            num_cpu_blocks_used=self.swap.num_used_blocks,
            tier=self.host_tier.stats() if self.host_tier is not None else None,
        )

    def check_integrity(self) -> None:
        self.pool.check_integrity()
        self.swap.check_integrity()
        refs = Counter(b for r in self._holders.values() for b in r.block_ids)
        refs.update(b for blocks in self._pins.values() for b in blocks)
        for block in self.pool.blocks:
            assert block.ref_count == refs.get(block.block_id, 0), (
                f"block {block.block_id}: ref_count {block.ref_count} but {refs.get(block.block_id, 0)} tables")
        for rid, request in self._holders.items():
            granted = self._num_granted_tokens[rid]
            assert len(request.block_ids) == len(set(request.block_ids)), f"{rid}: a block twice in one table"
            assert len(request.block_ids) == self.blocks_for(granted), (
                f"{rid}: {len(request.block_ids)} blocks for {granted} granted tokens")
            assert request.num_computed_tokens <= granted, f"{rid}: computed past its granted slots"
        assert not (self._holders.keys() & self._swapped.keys()), "a request both on device and swapped"
        for rid, request in self._swapped.items():
            assert not request.block_ids and self.swap.holds(rid), f"{rid}: swapped state inconsistent"
            assert len(self.swap.blocks_of(rid)) == self.blocks_for(request.num_computed_tokens)
        assert self.swap.num_used_blocks == sum(len(self.swap.blocks_of(r)) for r in self._swapped)
        if self.host_tier is not None:
            self.host_tier.check_integrity()
