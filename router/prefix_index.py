"""Which workers hold which cached KV blocks, learned from the workers' prefix-cache events.

The router keeps one `PrefixIndex` per replica. It is fed by each worker's
`PrefixEventBatch` (STORED / EVICTED / CLEARED, or a reset carrying all current hashes), so
it forgets blocks a worker evicted instead of guessing from what it once routed there.

Data structure: an inverted index from block hash to the set of workers holding it, plus
each worker's own hash set (for CLEARED, reset and worker removal):

    holders:  {h0: {w1, w2}, h1: {w1, w2}, h2: {w1}, h5: {w2}}
    blocks:   {w1: {h0, h1, h2}, w2: {h0, h1, h5}}

Block hashes are chain hashes (kv/hashing.py): h_i covers blocks 0..i, so a worker holding
h_i of *this* request holds the same prefix through block i. `longest_prefix` walks the
request's hashes from the start, keeping the workers that still match and recording where
each one dropped out:

    request hashes: [h0, h1, h2, h3]
      i=0  h0 -> {w1, w2}   candidates {w1, w2}
      i=1  h1 -> {w1, w2}   candidates {w1, w2}
      i=2  h2 -> {w1}       w2 stops: matched 2 blocks       candidates {w1}
      i=3  h3 -> {}         w1 stops: matched 3 blocks       candidates {}  -> stop
    result: {w1: 3, w2: 2}            (a worker with no block of the prefix is absent)

Cost per lookup is O(matched blocks x candidate workers); the walk stops at the first block
no candidate holds. A worker whose events show a gap (batch.reset) is rebuilt from
`all_hashes`. The index is single-owner state (the router's event loop); it takes no lock.

In flight: a request's prefix counts as held by its worker from the moment it is dispatched
(`add_in_flight`), not only once the worker's STORED event arrives a prefill and a poll
later. Without it, the second request of a family arriving while the first is still queued
or prefilling saw no match and went wherever load said; with four in flight every family
landed on both workers (measured on the cluster, the issue's table). The claim lasts while
the request runs and `linger_s` after it ends (time for its STORED events to be polled),
and an EVICTED event for the block on that worker drops it at once: the events correct it.
`longest_prefix(..., include_in_flight=False)` answers from events alone (what is surely
resident: admission charges only for that).

Per-request cost stays independent of how many requests are in flight: ended claims expire
from a heap ordered by expiry, and each worker's count of blocks claimed but not reported
(`num_blocks_known`) is kept as claims and events arrive, not recounted over every claim
(at 1,000 requests per second that recount cost ~30 ms a request: load_tests/bench_routing.py).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvmesh.kv.hashing import BlockHash
from kvmesh.core.seams import PrefixEventBatch, PrefixEventKind

logger = logging.getLogger(__name__)


@dataclass
class _InFlight:
    worker_id: str
    block_hashes: tuple[BlockHash, ...]
    expires_at: float | None = None  # set when the request ends


class PrefixIndex:
    def __init__(self, linger_s: float = 1.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.linger_s = linger_s
        self._clock = clock
        self._in_flight: dict[int, _InFlight] = {}
        self._in_flight_holders: dict[BlockHash, dict[str, int]] = {}  # block -> {worker: claims}
        self._live_holders: dict[BlockHash, dict[str, int]] = {}  # the same, requests not ended only
        self._expiries: list[tuple[float, int]] = []  # (expires_at, token) of ended claims, a heap
        # Per worker: distinct blocks claimed in flight there and not (yet) reported there.
        self._claimed_only: Counter[str] = Counter()
        self._tokens = itertools.count()
        self._holders: dict[BlockHash, set[str]] = {}
        self._blocks: dict[str, set[BlockHash]] = {}
        # Per worker: the seq to ask for next (`prefix_events(since_seq=...)`) and the last
        # event seq applied, so a batch delivered twice or late is not replayed.
        self._next_seq: dict[str, int] = {}
        self._last_applied_seq: dict[str, int] = {}
        # Called with (worker, blocks) for each STORED event after a worker's first batch (that
        # one replays its history): the blocks it computed, as every router replica hears them.
        self.on_stored: Callable[[str, int], None] | None = None

    # ---- feeding ----------------------------------------------------------------------------

    def apply(self, batch: PrefixEventBatch) -> None:
        """Apply one worker's event batch (in seq order; events already applied are skipped)."""
        worker_id = batch.worker_id
        if batch.reset:
            self._drop_blocks(worker_id)
            self._blocks[worker_id] = set()
            self._add(worker_id, batch.all_hashes)
            self._last_applied_seq[worker_id] = -1
            logger.debug("prefix index: %s reset with %d blocks", worker_id, len(batch.all_hashes))
        self._blocks.setdefault(worker_id, set())
        last = self._last_applied_seq.get(worker_id, -1)
        on_stored = self.on_stored if worker_id in self._next_seq else None
        for event in sorted(batch.events, key=lambda e: e.seq):
            if event.seq <= last:
                continue
            if event.kind is PrefixEventKind.STORED:
                self._add(worker_id, event.block_hashes)
                if on_stored is not None:
                    on_stored(worker_id, len(event.block_hashes))
            elif event.kind is PrefixEventKind.EVICTED:
                self._remove(worker_id, event.block_hashes, evicted=True)
            elif event.kind is PrefixEventKind.CLEARED:
                self._drop_blocks(worker_id)
                self._blocks[worker_id] = set()
            last = event.seq
        self._last_applied_seq[worker_id] = last
        self._next_seq[worker_id] = batch.next_seq

    def add_in_flight(self, worker_id: str, block_hashes: Sequence[BlockHash]) -> int:
        """A request with these prefix blocks was dispatched to `worker_id`: count them as held
        there until `end_in_flight(token)` + linger_s. Returns the token."""
        token = next(self._tokens)
        entry = _InFlight(worker_id, tuple(block_hashes))
        self._in_flight[token] = entry
        reported, holders = self._blocks.get(worker_id, ()), self._in_flight_holders
        for block_hash in entry.block_hashes:
            claims = holders.get(block_hash)
            if claims is None:
                claims = holders[block_hash] = {}
            count = claims[worker_id] = claims.get(worker_id, 0) + 1
            if count == 1 and block_hash not in reported:
                self._claimed_only[worker_id] += 1
        self._count_live(entry, +1)
        return token

    def _count_live(self, entry: _InFlight, sign: int) -> None:
        for block_hash in entry.block_hashes:
            live = self._live_holders.setdefault(block_hash, {})
            live[entry.worker_id] = live.get(entry.worker_id, 0) + sign
            if live[entry.worker_id] <= 0:
                del live[entry.worker_id]
                if not live:
                    del self._live_holders[block_hash]

    def held_by_live_requests(self, worker_id: str, block_hashes: Sequence[BlockHash]) -> int:
        """Leading blocks of `block_hashes` that a request dispatched to `worker_id` and not
        ended claims: the worker holds them for that request (pinned, in its table, or about
        to be computed by it), so a newcomer sharing them adds nothing for them there."""
        held = 0
        for block_hash in block_hashes:
            if worker_id not in self._live_holders.get(block_hash, ()):
                break
            held += 1
        return held

    def end_in_flight(self, token: int) -> None:
        """The request ended: keep its claim `linger_s` more (its STORED events are on the way)."""
        entry = self._in_flight.get(token)
        if entry is not None and entry.expires_at is None:
            self._count_live(entry, -1)
            entry.expires_at = self._clock() + self.linger_s
            heapq.heappush(self._expiries, (entry.expires_at, token))

    def shared_with_live_requests(self, token: int) -> int:
        """Leading blocks of in-flight request `token`'s prefix that another request still
        running on the same worker (its claim not ended) also claims: blocks that worker
        keeps pinned when this one ends (admission credits the rest of its cost)."""
        entry = self._in_flight.get(token)
        if entry is None:
            return 0
        others = [e.block_hashes for t, e in self._in_flight.items()
                  if t != token and e.worker_id == entry.worker_id and e.expires_at is None]
        shared = 0
        for i, block_hash in enumerate(entry.block_hashes):
            if not any(i < len(other) and other[i] == block_hash for other in others):
                break
            shared += 1
        return shared

    def remove_worker(self, worker_id: str) -> None:
        """Forget a dead or removed worker entirely; it is never reported as a match again."""
        self._drop_blocks(worker_id)
        for token in [t for t, e in self._in_flight.items() if e.worker_id == worker_id]:
            self._drop_in_flight(token)
        self._claimed_only.pop(worker_id, None)
        self._next_seq.pop(worker_id, None)
        self._last_applied_seq.pop(worker_id, None)

    # ---- queries ----------------------------------------------------------------------------

    def longest_prefix(self, block_hashes: Sequence[BlockHash], include_in_flight: bool = True) -> dict[str, int]:
        """Number of leading blocks of `block_hashes` each worker holds (absent = 0), counting
        the prefixes of requests dispatched there and not yet reported (see "In flight")."""
        matched: dict[str, int] = {}
        if not block_hashes:
            return matched
        if include_in_flight:
            self._expire_in_flight()

        empty: dict = {}
        holders, in_flight = self._holders, self._in_flight_holders if include_in_flight else empty
        first = block_hashes[0]
        candidates = set(holders.get(first, ())) | set(in_flight.get(first, ()))
        for i, block_hash in enumerate(block_hashes):
            if not candidates:
                break
            held, claimed = holders.get(block_hash, empty), in_flight.get(block_hash, empty)
            # The few workers still matching are tested, not the block's holder sets merged.
            dropped = [w for w in candidates if w not in held and w not in claimed]
            for worker_id in dropped:
                matched[worker_id] = i
                candidates.discard(worker_id)
        for worker_id in candidates:  # held the whole request's prefix
            matched[worker_id] = len(block_hashes)
        return {w: n for w, n in matched.items() if n > 0}

    def next_seq(self, worker_id: str) -> int:
        """The `since_seq` to pass to the worker's `prefix_events` next (0 for a new worker)."""
        return self._next_seq.get(worker_id, 0)

    def num_blocks(self, worker_id: str) -> int:
        return len(self._blocks.get(worker_id, ()))

    def num_blocks_known(self) -> dict[str, int]:
        """Per worker: distinct blocks reported there plus those claimed by requests
        dispatched there and not yet reported (see "In flight")."""
        self._expire_in_flight()
        known = {w: len(hashes) for w, hashes in self._blocks.items()}
        for worker_id, count in self._claimed_only.items():
            if count:
                known[worker_id] = known.get(worker_id, 0) + count
        return known

    def workers(self) -> list[str]:
        return sorted(self._blocks)

    def check_integrity(self) -> None:
        """Both views agree: every (hash, worker) pair is in both maps. For tests."""
        pairs_forward = {(h, w) for h, ws in self._holders.items() for w in ws}
        pairs_backward = {(h, w) for w, hs in self._blocks.items() for h in hs}
        assert pairs_forward == pairs_backward, "holders and blocks disagree"
        assert all(self._holders.values()), "empty holder set left behind"
        recount = Counter(w for h, claims in self._in_flight_holders.items() for w in claims
                          if h not in self._blocks.get(w, ()))
        assert +recount == +self._claimed_only, f"claimed-only counts {self._claimed_only} != {recount}"

    # ---- internals --------------------------------------------------------------------------

    def _add(self, worker_id: str, hashes: Sequence[BlockHash]) -> None:
        owned = self._blocks.setdefault(worker_id, set())
        for block_hash in hashes:
            if block_hash in owned:
                continue
            owned.add(block_hash)
            self._holders.setdefault(block_hash, set()).add(worker_id)
            if worker_id in self._in_flight_holders.get(block_hash, ()):
                self._claimed_only[worker_id] -= 1

    def _expire_in_flight(self) -> None:
        now = self._clock()
        while self._expiries and self._expiries[0][0] <= now:
            _, token = heapq.heappop(self._expiries)
            if token in self._in_flight:
                self._drop_in_flight(token)

    def _drop_in_flight(self, token: int) -> None:
        entry = self._in_flight.pop(token)
        if entry.expires_at is None:  # dropped while its request runs (its worker removed)
            self._count_live(entry, -1)
        for block_hash in entry.block_hashes:
            self._unclaim(block_hash, entry.worker_id, 1)

    def _unclaim(self, block_hash: BlockHash, worker_id: str, count: int | None) -> None:
        """Drop `count` in-flight claims of the block on the worker (None: all of them)."""
        claims = self._in_flight_holders.get(block_hash)
        if claims is None or worker_id not in claims:
            return
        claims[worker_id] = 0 if count is None else claims[worker_id] - count
        if claims[worker_id] <= 0:
            del claims[worker_id]
            if not claims:
                del self._in_flight_holders[block_hash]
            if block_hash not in self._blocks.get(worker_id, ()):
                self._claimed_only[worker_id] -= 1

    def _remove(self, worker_id: str, hashes: Sequence[BlockHash], evicted: bool = False) -> None:
        owned = self._blocks.get(worker_id, set())
        for block_hash in hashes:
            if evicted:  # the worker says it is gone: no in-flight claim keeps it alive
                self._unclaim(block_hash, worker_id, None)
            if block_hash in owned:
                owned.discard(block_hash)
                if worker_id in self._in_flight_holders.get(block_hash, ()):
                    self._claimed_only[worker_id] += 1  # still claimed, no longer reported
            holders = self._holders.get(block_hash)
            if holders is not None:
                holders.discard(worker_id)
                if not holders:
                    del self._holders[block_hash]

    def _drop_blocks(self, worker_id: str) -> None:
        self._remove(worker_id, tuple(self._blocks.get(worker_id, ())))
        self._blocks.pop(worker_id, None)
