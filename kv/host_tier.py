"""The host tier: a bounded LRU of evicted prefix blocks in host memory, below the device pool.

Bookkeeping only (no torch): which host slot holds the KV of which full block, keyed and
verified like the prefix cache (kv/prefix_cache.py). The engine owns the bytes and does the
copies the tier asks for. The lifecycle of one entry follows vLLM's offloading manager
(prepare_store / complete_store / prepare_load / complete_load):

    pool evicts block 12 (key k)  ->  store_evicted(12, k): slot 3, PENDING   (copy device 12 ->
                                      host 3 runs before the step's forward)
    copy done, checksum c         ->  confirm(3, k.block_hash, c)    READY
    a prefix lookup misses the    ->  lookup_run([k, ..]) -> slot 3 (READY, the key equal);
    pool, hits the tier               num_verified: the bytes still give c (`verify`, the
                                      engine's); hold(3), load(3, fresh device block)
    schedule() returns            ->  take_copies(): the copies to run; holds end

    slots:  [ 0 ][ 1 ][ 2 ][ 3 ][ 4 ]     free: 0 1        LRU (oldest first): 4 2 3
             free free  k2   k   k4       held this step: 3 (never evicted while held)

A block is stored once per hash: evicting a block whose hash the tier already holds (it
came from the tier and went back to the pool) only refreshes its LRU place. The key equality
check (parent hash, tokens, extra keys with the tenant's salt) means a hit is only ever
served to a request that computed the same hash from the same content under the same salt:
one tenant's salted blocks are never served to another. The content checksum taken when the
bytes arrived is checked again before they are copied back, so a damaged host copy is a
miss (recomputed), never wrong KV.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from kvmesh.kv.hashing import BlockHash
from kvmesh.kv.prefix_cache import CachedBlockKey


@dataclass
class _TierEntry:
    key: CachedBlockKey
    slot: int
    checksum: int | None = None  # None while the store copy is pending


class TierCopies(NamedTuple):
    """One schedule()'s tier copies, for the engine to run around the forward."""

    stores: tuple[tuple[int, int, BlockHash], ...]  # (device block, slot, hash): before anything else
    loads: tuple[tuple[int, int], ...]  # (slot, device block): after the step's other block copies


@dataclass(frozen=True)
class TierStats:
    num_slots_total: int
    num_slots_used: int  # entries, pending or ready
    num_stores: int  # blocks copied device -> host
    num_hits: int  # blocks copied host -> device instead of recomputed
    num_hit_tokens: int
    num_evictions: int  # entries dropped to make room
    num_checksum_failures: int  # host copies that failed the content check (dropped)
    num_store_skips: int  # evicted blocks not stored: every slot held this step


class HostTier:
    def __init__(self, num_slots: int, block_size: int):
        if num_slots < 1 or block_size < 1:
            raise ValueError(f"need num_slots >= 1 and block_size >= 1, got {num_slots}, {block_size}")
        self.num_slots = num_slots
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_slots))
        self._entries: OrderedDict[BlockHash, _TierEntry] = OrderedDict()  # first = least recently used
        self._slot_hash: dict[int, BlockHash] = {}
        self._held: dict[int, int] = {}  # slot -> holds taken this step (loads in flight)
        self.num_stores = 0
        self.num_hits = 0
        self.num_evictions = 0
        self.num_checksum_failures = 0
        self.num_store_skips = 0
        # Called with the hash of an entry evicted or rejected (the worker may no longer hold it).
        self.on_drop: Callable[[BlockHash], None] | None = None
        # Set by the engine, which owns the bytes: does `slot` still hold content with this
        # checksum? None = trusted (bookkeeping-only tests).
        self.verify: Callable[[int, int], bool] | None = None
        self._pending_stores: list[tuple[int, int, BlockHash]] = []
        self._pending_loads: list[tuple[int, int]] = []

    # ---- stores ----------------------------------------------------------------------------

    def store(self, key: CachedBlockKey) -> int | None:
        """A slot for the evicted block's KV, or None when no copy is needed (the hash is
        already here: refreshed) or possible (every slot is held). The caller copies the
        block into the returned slot before the device block is overwritten, then confirms."""
        entry = self._entries.get(key.block_hash)
        if entry is not None and entry.key == key:
            self._entries.move_to_end(key.block_hash)
            return None
        if entry is not None:  # same hash, other content: a collision; the newer content wins
            self._drop(entry)
        slot = self._take_slot()
        if slot is None:
            self.num_store_skips += 1
            return None
        self._entries[key.block_hash] = _TierEntry(key, slot)
        self._slot_hash[slot] = key.block_hash
        self.num_stores += 1
        return slot

    def store_evicted(self, block_id: int, key: CachedBlockKey) -> bool:
        """The pool evicts `block_id` (BlockPool.on_evict): keep a copy, copied this step.
        True = the tier holds the block now (the worker still has it)."""
        slot = self.store(key)
        if slot is not None:
            self._pending_stores.append((block_id, slot, key.block_hash))
        return self.holds_hash(key.block_hash)

    def confirm(self, slot: int, block_hash: BlockHash, checksum: int) -> None:
        """The store copy into `slot` finished; `checksum` is its content's. Ignored when the
        slot was reused meanwhile (the entry it was for is gone)."""
        if self._slot_hash.get(slot) == block_hash:
            self._entries[block_hash].checksum = checksum

    def _take_slot(self) -> int | None:
        if self._free:
            return self._free.popleft()
        for block_hash, entry in self._entries.items():  # oldest first
            if entry.slot not in self._held:
                self._drop(entry)
                self.num_evictions += 1
                if self.on_drop is not None:
                    self.on_drop(block_hash)
                return self._free.popleft()
        return None

    def _drop(self, entry: _TierEntry) -> None:
        del self._entries[entry.key.block_hash], self._slot_hash[entry.slot]
        self._free.append(entry.slot)

    # ---- loads -----------------------------------------------------------------------------

    def lookup_run(self, keys: Iterable[CachedBlockKey]) -> list[tuple[int, int]]:
        """(slot, checksum) of the ready entries for `keys`, up to the first miss."""
        found = []
        for key in keys:
            entry = self.lookup(key)
            if entry is None:
                break
            found.append(entry)
        return found

    def num_verified(self, keys: Sequence[CachedBlockKey], found: Sequence[tuple[int, int]]) -> int:
        """How many of `found` (from lookup_run over `keys`), from the first, still hold their
        checksummed bytes; the first that does not is dropped (its block is recomputed)."""
        for i, (slot, checksum) in enumerate(found):
            if self.verify is not None and not self.verify(slot, checksum):
                self.reject(keys[i])
                return i
        return len(found)

    def lookup(self, key: CachedBlockKey) -> tuple[int, int] | None:
        """(slot, checksum) of a ready entry whose key equals `key`, else None. Changes nothing."""
        entry = self._entries.get(key.block_hash)
        if entry is None or entry.checksum is None or entry.key != key:
            return None
        return entry.slot, entry.checksum

    def reject(self, key: CachedBlockKey) -> None:
        """The entry's bytes failed the content check: drop it (the caller recomputes)."""
        entry = self._entries.get(key.block_hash)
        if entry is not None and entry.key == key:
            self._drop(entry)
            self.num_checksum_failures += 1
            if self.on_drop is not None:
                self.on_drop(key.block_hash)

    def hold(self, slot: int) -> None:
        """Protect `slot` from eviction until `take_copies` (its load is in flight)."""
        assert slot in self._slot_hash, f"holding tier slot {slot}, which holds nothing"
        self._held[slot] = self._held.get(slot, 0) + 1
        self._entries.move_to_end(self._slot_hash[slot])
        self.num_hits += 1

    def load(self, slot: int, device_block: int) -> None:
        """Copy held `slot` onto `device_block` this step."""
        assert slot in self._held, "load from a slot not held"
        self._pending_loads.append((slot, device_block))

    def take_copies(self) -> TierCopies:
        """The copies this schedule() decided, once. Only a schedule() evicts from the tier,
        and the engine runs these loads before the next one, so the slots they read need no
        protection past this point: holds end here."""
        copies = TierCopies(tuple(self._pending_stores), tuple(self._pending_loads))
        self._pending_stores, self._pending_loads = [], []
        self._held.clear()
        return copies

    # ---- figures and invariants --------------------------------------------------------------

    @property
    def num_used_slots(self) -> int:
        return len(self._entries)

    @property
    def num_held_slots(self) -> int:
        return len(self._held)

    def holds_hash(self, block_hash: BlockHash) -> bool:
        return block_hash in self._entries

    def hashes(self) -> tuple[BlockHash, ...]:
        return tuple(self._entries)

    def stats(self) -> TierStats:
        return TierStats(self.num_slots, len(self._entries), self.num_stores, self.num_hits,
                         self.num_hits * self.block_size, self.num_evictions, self.num_checksum_failures,
                         self.num_store_skips)

    def check_integrity(self) -> None:
        slots = [e.slot for e in self._entries.values()] + list(self._free)
        assert len(slots) == len(set(slots)) == self.num_slots, "tier slots lost or doubly used"
        assert self._slot_hash == {e.slot: h for h, e in self._entries.items()}, "slot map disagrees"
        assert all(h == e.key.block_hash for h, e in self._entries.items()), "entry under the wrong hash"
        assert set(self._held) <= set(self._slot_hash), "a held slot holds nothing"
