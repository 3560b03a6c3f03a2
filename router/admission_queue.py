"""The router admission queue's entries and their order (router/admission.py runs the queue):
one `Waiter` per request waiting for KV budget, kept per lane by priority class, then by
the place it first asked.
"""

from __future__ import annotations

import asyncio
import collections
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from kvmesh.core.seams import WorkerStats
from kvmesh.router.admission_budget import CostFn

# route(eligible workers, in-flight tokens per worker) -> chosen worker id (one of eligible)
RouteFn = Callable[[list[WorkerStats], Mapping[str, int]], str]
# hold(eligible workers) -> True to hold out: none of them suits the request yet
# (router/affinity_wait.py), so it waits in the queue without holding up those behind it
HoldFn = Callable[[list[WorkerStats]], bool]


def excluding(cost_for: CostFn, exclude: frozenset[str]) -> CostFn:
    """A cost no worker can hold on the excluded workers, so they are never eligible."""
    return lambda worker_id: math.inf if worker_id in exclude else cost_for(worker_id)


@dataclass
class Waiter:
    cost_tokens: int
    attempt: int
    route: RouteFn | None
    enqueued_at: float  # its place in the lane: when it first asked (see acquire's queued_since)
    future: asyncio.Future
    cost_for: CostFn | None = None
    priority_class: int = 0
    exclude: frozenset[str] = frozenset()  # workers it may not go to (the other pool, a refuser)
    # A ladder step that fits but for admissions the workers' reports may already count: it
    # waits for those to settle, and is refused as soon as it would not fit even without them.
    until_settled: bool = False
    hold: HoldFn | None = None
    holding: bool = False  # it held out at the last try: it does not hold up those behind it
    load_for: CostFn | None = None  # what it adds to a worker's load, when not its KV cost (acquire)


class Held:
    """What _try_admit returns when the request fits somewhere but held out."""


HELD = Held()


def enqueue(lane: collections.deque, waiter: Waiter) -> None:
    """By class, then by place: behind every waiter of a more important class and every one
    of its own class that asked before it, ahead of the rest. (A newcomer asked last: it goes
    behind its whole class; a request stepping down the ladder keeps its place.)"""
    for index, other in enumerate(lane):
        if (other.priority_class, other.enqueued_at) > (waiter.priority_class, waiter.enqueued_at):
            lane.insert(index, waiter)
            return
    lane.append(waiter)
