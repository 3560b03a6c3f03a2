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
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from kvmesh.kv.hashing import BlockHash
from kvmesh.core.seams import PrefixEventBatch, PrefixEventKind

logger = logging.getLogger(__name__)


class PrefixIndex:
    def __init__(self) -> None:
        self._holders: dict[BlockHash, set[str]] = {}
        self._blocks: dict[str, set[BlockHash]] = {}
        # Per worker: the seq to ask for next (`prefix_events(since_seq=...)`) and the last
        # event seq applied, so a batch delivered twice or late is not replayed.
        self._next_seq: dict[str, int] = {}
        self._last_applied_seq: dict[str, int] = {}

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
        for event in sorted(batch.events, key=lambda e: e.seq):
            if event.seq <= last:
                continue
            if event.kind is PrefixEventKind.STORED:
                self._add(worker_id, event.block_hashes)
            elif event.kind is PrefixEventKind.EVICTED:
                self._remove(worker_id, event.block_hashes)
            elif event.kind is PrefixEventKind.CLEARED:
                self._drop_blocks(worker_id)
                self._blocks[worker_id] = set()
            last = event.seq
        self._last_applied_seq[worker_id] = last
        self._next_seq[worker_id] = batch.next_seq

    def remove_worker(self, worker_id: str) -> None:
        """Forget a dead or removed worker entirely; it is never reported as a match again."""
        self._drop_blocks(worker_id)
        self._next_seq.pop(worker_id, None)
        self._last_applied_seq.pop(worker_id, None)

    # ---- queries ----------------------------------------------------------------------------

    def longest_prefix(self, block_hashes: Sequence[BlockHash]) -> dict[str, int]:
        """Number of leading blocks of `block_hashes` each worker holds (absent = 0)."""
        matched: dict[str, int] = {}
        if not block_hashes:
            return matched
        candidates = set(self._holders.get(block_hashes[0], ()))
        for i, block_hash in enumerate(block_hashes):
            if not candidates:
                break
            holders = self._holders.get(block_hash, set())
            for worker_id in candidates - holders:
                matched[worker_id] = i
            candidates &= holders
        for worker_id in candidates:  # held the whole request's prefix
            matched[worker_id] = len(block_hashes)
        return {w: n for w, n in matched.items() if n > 0}

    def next_seq(self, worker_id: str) -> int:
        """The `since_seq` to pass to the worker's `prefix_events` next (0 for a new worker)."""
        return self._next_seq.get(worker_id, 0)

    def num_blocks(self, worker_id: str) -> int:
        return len(self._blocks.get(worker_id, ()))

    def workers(self) -> list[str]:
        return sorted(self._blocks)

    def check_integrity(self) -> None:
        """Both views agree: every (hash, worker) pair is in both maps. For tests."""
        pairs_forward = {(h, w) for h, ws in self._holders.items() for w in ws}
        pairs_backward = {(h, w) for w, hs in self._blocks.items() for h in hs}
        assert pairs_forward == pairs_backward, "holders and blocks disagree"
        assert all(self._holders.values()), "empty holder set left behind"

    # ---- internals --------------------------------------------------------------------------

    def _add(self, worker_id: str, hashes: Sequence[BlockHash]) -> None:
        owned = self._blocks.setdefault(worker_id, set())
        for block_hash in hashes:
            owned.add(block_hash)
            self._holders.setdefault(block_hash, set()).add(worker_id)

    def _remove(self, worker_id: str, hashes: Sequence[BlockHash]) -> None:
        owned = self._blocks.get(worker_id, set())
        for block_hash in hashes:
            owned.discard(block_hash)
            holders = self._holders.get(block_hash)
            if holders is not None:
                holders.discard(worker_id)
                if not holders:
                    del self._holders[block_hash]

    def _drop_blocks(self, worker_id: str) -> None:
        owned = self._blocks.pop(worker_id, set())
        self._remove(worker_id, tuple(owned))
