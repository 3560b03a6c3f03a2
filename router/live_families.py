"""The prefix blocks of the families each worker served recently: how much of its cache the
families still in use hold, which the reported footprint cannot tell once caches are full.

Why: a worker's reported footprint (blocks used + cached) is its whole pool as soon as its
cache has filled, with live families and stale ones (an earlier workload's, evictable) alike.
New-family placement then had no cache signal, and on the 2-worker routing campaign (128
blocks a worker, 33-block prefixes, three fit) a fourth live family landed on one worker:
each of its requests evicted another family's prefix there, and the family lived on both
workers as its next request was placed anew (docs/routing.md). Counting only the families
routed there within the last `window_s`, a new family goes where its prefix fits beside them.

    live.note("worker-0", family_key, 34)   # a request of the family was routed there (its prompt's blocks)
    live.blocks("worker-0")                 # the families routed there within window_s, each counted once
    live.latest_worker(family_key)          # where its latest request within window_s went

A family on two workers (spread) counts on both. Kept incrementally (per worker, families in
order of their last request, a running sum): reading is O(1) amortized, as routing needs.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Hashable


class LiveFamilies:
    def __init__(self, window_s: float, clock: Callable[[], float] = time.monotonic, max_per_worker: int = 4096):
        self._window_s = window_s
        self._clock = clock
        self._max_per_worker = max_per_worker
        # worker -> family key -> (its blocks, its last request's time), oldest first
        self._by_worker: dict[str, collections.OrderedDict[Hashable, tuple[int, float]]] = {}
        self._sum: dict[str, int] = {}

    def note(self, worker_id: str, key: Hashable, num_blocks: int) -> None:
        families = self._by_worker.setdefault(worker_id, collections.OrderedDict())
        old = families.pop(key, None)
        self._sum[worker_id] = self._sum.get(worker_id, 0) - (old[0] if old else 0) + num_blocks
        families[key] = (num_blocks, self._clock())
        while len(families) > self._max_per_worker:
            _, (blocks, _) = families.popitem(last=False)
            self._sum[worker_id] -= blocks

    def latest_worker(self, key: Hashable) -> str | None:
        """The worker the family's latest request within window_s was routed to (None: none)."""
        expired_before = self._clock() - self._window_s
        latest = max(((families[key][1], worker_id) for worker_id, families in self._by_worker.items()
                      if key in families and families[key][1] >= expired_before), default=None)
        return latest[1] if latest is not None else None

    def blocks(self, worker_id: str) -> int:
        families = self._by_worker.get(worker_id)
        if not families:
            return 0
        expired_before = self._clock() - self._window_s
        while families:
            key, (blocks, last_s) = next(iter(families.items()))
            if last_s >= expired_before:
                break
            del families[key]
            self._sum[worker_id] -= blocks
        return self._sum[worker_id]
