"""Fair ordering between tenants of equal priority: a flooding tenant cannot starve another.

The engine's waiting queue is ordered by (priority, arrival) (worker/engine_loop/scheduler.py). With one
number per priority class, a tenant sending ten times the requests of another fills that
queue, and the other tenant's request waits behind the whole backlog (FIFO starvation). The
router therefore sends the engine a priority that also carries the request's *fair rank*:
how many of its own tenant's requests this replica already has in flight.

    engine priority = priority class x RANK_SPAN + rank        (lower = served first)

    heavy tenant, 9 in flight:  new request  -> class 0, rank 9  -> priority 9
    light tenant, 0 in flight:  new request  -> class 0, rank 0  -> priority 0   (served next)

That is round robin across tenants by backlog depth: every tenant's k-th outstanding request
is served in round k, before any tenant's (k+1)-th; within a tenant, arrival order holds
for requests of the same rank. The class still dominates (RANK_SPAN is larger than any
backlog), so priority classes keep their meaning, and preemption (which picks the newest
request of the largest priority value) takes the flooding tenant's deepest requests first.

Ranks are per router replica: with N replicas each sees about 1/N of every tenant's load,
so the ordering stays fair up to that sampling. Single-owner state on the replica's event
loop: no locks.
"""

from __future__ import annotations

import collections

# Ranks stop here: a backlog deeper than this is already served last within its class.
RANK_SPAN = 1_000_000


def engine_priority(priority_class: int, rank: int) -> int:
    """The priority the engine orders by; `priority_class` is the tenant's (plus the request's)."""
    if rank < 0:
        raise ValueError(f"rank must be >= 0, got {rank}")
    return priority_class * RANK_SPAN + min(rank, RANK_SPAN - 1)


class TenantBacklog:
    """In-flight requests per tenant at this replica: `enter` gives the new request's rank."""

    def __init__(self):
        self._in_flight: collections.Counter[str] = collections.Counter()

    def enter(self, tenant_id: str) -> int:
        rank = self._in_flight[tenant_id]
        self._in_flight[tenant_id] += 1
        return rank

    def leave(self, tenant_id: str) -> None:
        if self._in_flight[tenant_id] <= 0:
            raise AssertionError(f"tenant {tenant_id!r} left more requests than it entered")
        self._in_flight[tenant_id] -= 1
        if not self._in_flight[tenant_id]:
            del self._in_flight[tenant_id]

    def in_flight(self, tenant_id: str) -> int:
        return self._in_flight[tenant_id]
