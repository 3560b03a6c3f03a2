"""The prefix cache: which device block holds the KV of which full block of tokens.

A full block is known by its chain hash (kv/hashing.py) *and* by what the hash was built
from, so a hit is served only when the content matches, never on the hash alone:

    request tokens   [ 7  8  9 10][11 12 13 14][15 16]            block_size = 4
    chain hashes     h0           h1           (partial: no hash, not shareable)
    index            h0 -> (key0, block 12)    key0 = (parent None, (7,8,9,10), extra_keys)
                     h1 -> (key1, block 3)     key1 = (parent h0, (11,12,13,14), extra_keys)

    lookup(key1') with key1'.block_hash == h1 but other tokens -> miss (forged / colliding
    hash), counted in `num_collisions`.

Comparing the parent hash as well as the tokens and extra keys makes a hit mean "same
tokens after the same (hash-identified) prefix under the same model, KV format and tenant
salt". The index never decides what to evict: the block pool owns lifetimes (refcounts,
LRU) and calls `remove` when it reuses a cached block.

Every change is also written to a bounded event log the router reads to keep its view of
this worker's cache (STORED / EVICTED / CLEARED with sequence numbers).
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass

from kvmesh.kv.hashing import BlockHash
from kvmesh.core.seams import PrefixEvent, PrefixEventBatch, PrefixEventKind

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CachedBlockKey:
    """What a cached block's KV was computed from; equality is the collision check."""

    block_hash: BlockHash
    parent_hash: BlockHash | None
    token_ids: tuple[int, ...]
    extra_keys: tuple[str, ...]


class PrefixEventLog:
    """A bounded ring buffer of prefix-cache events with increasing sequence numbers.

    Changes made during one scheduler step are coalesced: consecutive changes of the same
    kind go into one pending event, and `flush()` (called at step boundaries) publishes
    them. Order between kinds is kept (a hash evicted then stored again in one step yields
    EVICTED then STORED).
    """

    def __init__(self, worker_id: str = "", max_events: int = 4096):
        if max_events < 1:
            raise ValueError("max_events must be >= 1")
        self.worker_id = worker_id
        self._events: deque[PrefixEvent] = deque(maxlen=max_events)
        self._next_seq = 0
        self._pending: list[tuple[PrefixEventKind, list[BlockHash]]] = []

    @property
    def next_seq(self) -> int:
        """Sequence number the next published event will get."""
        return self._next_seq

    def record(self, kind: PrefixEventKind, block_hash: BlockHash | None = None) -> None:
        if kind is PrefixEventKind.CLEARED:
            self._pending.append((kind, []))
            return
        if self._pending and self._pending[-1][0] is kind:
            self._pending[-1][1].append(block_hash)
        else:
            self._pending.append((kind, [block_hash]))

    def flush(self) -> None:
        for kind, hashes in self._pending:
            self._events.append(PrefixEvent(seq=self._next_seq, kind=kind, block_hashes=tuple(hashes)))
            self._next_seq += 1
        self._pending.clear()

    def events_since(self, seq: int, current_hashes: tuple[BlockHash, ...]) -> PrefixEventBatch:
        """Events with sequence number >= `seq` (pass the previous batch's `next_seq`).

        When `seq` is older than the oldest retained event, or newer than anything this log
        has published (the worker restarted), the caller must start over: reset=True with
        every hash currently cached.
        """
        self.flush()
        oldest = self._events[0].seq if self._events else self._next_seq
        if seq < oldest or seq > self._next_seq:
            return PrefixEventBatch(worker_id=self.worker_id, next_seq=self._next_seq, reset=True,
                                    all_hashes=current_hashes)
        events = tuple(e for e in self._events if e.seq >= seq)
        return PrefixEventBatch(worker_id=self.worker_id, next_seq=self._next_seq, events=events)


class PrefixCache:
    """Hash -> block index with content verification, hit statistics and an event log."""

    def __init__(self, worker_id: str = "", max_events: int = 4096):
        self._index: dict[BlockHash, tuple[CachedBlockKey, int]] = {}
        self.events = PrefixEventLog(worker_id, max_events)
        self.num_query_tokens = 0  # prompt tokens looked up at first admission
        self.num_hit_tokens = 0  # of which served from the cache
        self.num_collisions = 0  # lookups whose hash matched but content did not

    def insert(self, key: CachedBlockKey, block_id: int) -> bool:
        """Make `block_id` the holder of `key`. False when the hash is already indexed
        (a duplicate computation, or a collision): the first holder stays."""
        if key.block_hash in self._index:
            return False
        self._index[key.block_hash] = (key, block_id)
        self.events.record(PrefixEventKind.STORED, key.block_hash)
        return True

    def lookup(self, key: CachedBlockKey) -> int | None:
        entry = self._index.get(key.block_hash)
        if entry is None:
            return None
        stored_key, block_id = entry
        if stored_key != key:
            self.num_collisions += 1
            logger.warning("prefix cache: hash %s matched a block with different content; not served",
                           key.block_hash.hex())
            return None
        return block_id

    def remove(self, key: CachedBlockKey, block_id: int, record_event: bool = True) -> None:
        entry = self._index.get(key.block_hash)
        assert entry is not None and entry[1] == block_id, "removing a block the index does not hold"
        del self._index[key.block_hash]
        if record_event:
            self.events.record(PrefixEventKind.EVICTED, key.block_hash)

    def holder(self, block_hash: BlockHash) -> int | None:
        entry = self._index.get(block_hash)
        return None if entry is None else entry[1]

    def items(self) -> list[tuple[CachedBlockKey, int]]:
        return list(self._index.values())

    def hashes(self) -> tuple[BlockHash, ...]:
        return tuple(self._index)

    def record_query(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        self.num_query_tokens += num_query_tokens
        self.num_hit_tokens += num_hit_tokens

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_query_tokens if self.num_query_tokens else 0.0
