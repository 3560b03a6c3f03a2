"""Adapter affinity: send a LoRA request where its adapter already sits in a slot.

A worker holds lora.max_loras adapters at once; a request for any other costs a load (read
the PEFT files, copy into a slot, often evicting another adapter that a later request then
loads again). Round robin spreads every adapter over every worker, so with more adapters
than one worker's slots each worker keeps evicting; affinity gives each adapter a home:

    workers   w0 [a b c d]   w1 [e f g h]        8 adapters, 4 slots each
    request for c   -> w0 (holder), unless w0's load exceeds the least loaded worker's by
                       more than a load is worth (lora.load_cost_requests mean requests)
                       AND by the imbalance guard; then the load is cheaper than queueing
    request for x   -> nobody holds x: among the workers not overloaded, the one with the
                       fewest adapters (a free slot, no eviction), then the lower load

`AdapterPlacement` is what one router replica knows: the adapters each worker reported in its
last stats, plus those it sent there since (the worker loads an adapter on arrival, before the
next stats poll shows it). A request whose prompt prefix is cached somewhere is routed by the
prefix first (router/routing.py): its blocks are keyed by adapter, so a prefix match is a
worker that ran this adapter recently.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence

from kvmesh.core.seams import WorkerStats


class AdapterPlacement:
    def __init__(self, memory_s: float = 30.0, clock=time.monotonic):
        self._memory_s = memory_s  # how long a send counts as "loaded there" without a report
        self._clock = clock
        self._reported: dict[str, frozenset[str]] = {}
        self._sent: dict[str, dict[str, float]] = {}  # worker -> {adapter: monotonic time sent}

    def update(self, stats: Sequence[WorkerStats]) -> None:
        for s in stats:
            self._reported[s.worker_id] = frozenset(s.resident_adapters)

    def note_routed(self, worker_id: str, adapter: str) -> None:
        self._sent.setdefault(worker_id, {})[adapter] = self._clock()

    def _recent(self, worker_id: str) -> set[str]:
        now = self._clock()
        sent = self._sent.get(worker_id, {})
        for name in [n for n, t in sent.items() if now - t > self._memory_s]:
            del sent[name]
        return set(sent)

    def adapters_on(self, worker_id: str) -> set[str]:
        return set(self._reported.get(worker_id, ())) | self._recent(worker_id)

    def holders(self, adapter: str, worker_ids: Sequence[str]) -> set[str]:
        return {w for w in worker_ids if adapter in self.adapters_on(w)}


def choose_for_adapter(ids: Sequence[str], loads: Mapping[str, int], holders: set[str],
                       num_adapters: Mapping[str, int], load_cost_tokens: int,
                       overloaded: Callable[[str], bool]) -> tuple[str, bool]:
    """(worker, whether it holds the adapter) for a request no worker has a cached prefix of
    (see the module docstring). `loads`: tokens to compute per worker, as routing measures
    them; `overloaded(w)`: routing's imbalance guard against the least loaded worker."""
    min_load = min(loads[w] for w in ids)
    holding = [w for w in ids if w in holders]
    if holding:
        best = min(holding, key=lambda w: (loads[w], w))
        if loads[best] - min_load <= load_cost_tokens or not overloaded(best):
            return best, True
    calm = [w for w in ids if not overloaded(w)]
    return min(calm, key=lambda w: (num_adapters.get(w, 0), loads[w], w)), False
