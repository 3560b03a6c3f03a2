"""Routing policy: which worker serves a request. Pure functions of their inputs.

`choose_worker(matched_blocks, workers, config, rng, ...)` decides from

- matched_blocks: {worker_id: leading prompt blocks that worker has cached}, from
  `PrefixIndex.longest_prefix(block_hashes)`;
- workers: the latest `WorkerStats` of every worker (unhealthy ones are never chosen);
- config: `RouterConfig` (policy, imbalance_ratio, imbalance_abs_tokens, imbalance_margin_requests);
- rng: a `random.Random` the caller owns (seeded in tests);
- extra_load_tokens: tokens the router sent a worker since its stats were taken
  (admission's in-flight accounting), so a burst between refreshes is not all sent to the
  one worker that looked idle;
- mean_request_tokens: the mean tokens the router's recent admissions added to their
  workers' load (each one's uncached cost where it went: `RouterAdmission.
  mean_admitted_tokens`, a `RequestSizeMeter`), which scales the absolute imbalance margin.
  It must be in the load's unit (below): a request's whole KV size (prompt + max_tokens)
  counts a cached prefix the load leaves out, and made the margin ~12 cache hits wide on the
  16-worker table (6k-token prefixes) instead of ~2 requests (docs/routing.md).

The absolute margin is `max(imbalance_abs_tokens, imbalance_margin_requests x mean request)`
(`imbalance_margin_tokens`). A fixed token count means different things for different
request mixes: 2,048 tokens is ~4 of the 2-worker campaign's 550-token requests but less than
one 7.2k-token request of the 16-worker table, where one queued request on a hot worker then
broke affinity and families spread over up to 15 workers (simulated: hit rate 0.34 against
0.58 with a margin of ~2 requests at 8 QPS). In units of requests the guard says the same
thing for every mix: "spill when the hot worker is more than ~2 requests ahead", a request
counted at what it cost the worker it went to (a cache hit its tail, a miss its whole prompt),
as the load counts it.

A worker's load is `tokens_to_compute (+ extra)`: the forward-pass tokens its running and
waiting requests still need (prompt not yet computed, a cached prefix left out, plus output
to come; `WorkerStats.tokens_to_compute`), plus what the router sent since (charged
uncached: `cost_for` in admission). A cache hit costs a worker nothing to compute, so a hot
family's long prefix does not count against its worker at all, and affinity breaks only on
real overload. (Until #16 the load was the KV held, `kv_tokens_used + queued_prompt_tokens`:
a worker serving cache hits looked as loaded as one computing misses, and in the skewed-mix
shape the simulator put computed tokens per worker over 1.5x in 9 of 60 runs, against 5 of
60 with the tokens to compute: docs/routing.md.)

Policies (RouterConfig.policy):

    prefix_aware   the worker with the longest cached prefix (ties: lower load, then rng), unless its
                   load exceeds the least loaded worker's by BOTH imbalance_ratio (x) and
                   the absolute margin (+, imbalance_margin_tokens); then another worker already holding at
                   least half of that prefix and not itself overloaded (sticky spill: a
                   family's set of workers grows only when all of them are overloaded);
                   else, or when nothing matched, power of two choices by load. Both
                   thresholds must trip so that small absolute differences on an idle
                   cluster (10 vs 40 tokens) do not break affinity, and large ones at
                   high load do.
                   A prompt nothing matched starts a new prefix: of the two sampled
                   workers, when their loads are within those same thresholds, the one
                   with the smaller KV footprint (blocks used + cached, plus router
                   in-flight tokens) takes it, so new prefixes spread over the caches
                   instead of piling onto whichever idle worker the coin picked (SGLang's
                   cache-aware router places unmatched prompts by tree size for the same
                   reason). Measured on the cluster: with equal idle loads the coin put
                   3 of 4 families on one worker half the time, and that worker's cache
                   then thrashed.
    least_loaded   the lowest load (ties broken by rng).
    round_robin    the next healthy worker in id order; the position lives in a
                   `RoundRobinCursor` the caller keeps (no module state).

The decision records the path taken, for metrics and traces.
"""

from __future__ import annotations

import collections
import enum
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvmesh.core.config import RouterConfig
from kvmesh.router.adapter_affinity import choose_for_adapter
from kvmesh.core.seams import WorkerStats
from kvmesh.core.errors import WorkerFailedError


class RoutingPath(str, enum.Enum):
    PREFIX_MATCH = "prefix_match"  # longest cached prefix, load within bounds
    PREFIX_SPILL = "prefix_spill"  # its best worker is overloaded; another holding most of it takes it
    PREFIX_IMBALANCED = "prefix_imbalanced"  # a prefix matched but every holder is overloaded -> p2c
    NO_PREFIX = "no_prefix"  # nothing cached anywhere -> p2c
    ADAPTER_HOLDER = "adapter_holder"  # no prefix; a worker with the request's LoRA adapter loaded
    ADAPTER_LOAD = "adapter_load"  # no prefix, no holder within a load's cost: the adapter is loaded there
    LEAST_LOADED = "least_loaded"
    ROUND_ROBIN = "round_robin"


@dataclass(frozen=True)
class AdapterRouting:
    """A LoRA request's routing inputs (router/adapter_affinity.py): the workers holding its
    adapter, each worker's adapter count, and a load's cost in the load's unit (tokens)."""

    holders: frozenset[str]
    num_adapters: Mapping[str, int]
    load_cost_tokens: int


@dataclass(frozen=True)
class RoutingDecision:
    worker_id: str
    matched_blocks: int  # prompt blocks already cached on the chosen worker
    path: RoutingPath
    load_tokens: int  # the chosen worker's load when it was chosen


class RoundRobinCursor:
    """The round-robin position: one per router replica, passed to `choose_worker`."""

    def __init__(self) -> None:
        self._count = 0

    def take(self, worker_ids: Sequence[str]) -> str:
        chosen = worker_ids[self._count % len(worker_ids)]
        self._count += 1
        return chosen


class RequestSizeMeter:
    """Mean tokens of the last `window` admissions, each the cost its worker's load was
    charged (`AdmissionTicket.cost_tokens`: the prompt blocks not cached there + output): the
    unit of the imbalance margin, the same unit as the load it is compared with. One per
    router replica (no module state)."""

    def __init__(self, window: int = 256) -> None:
        self._sizes: collections.deque[int] = collections.deque(maxlen=window)
        self._sum = 0

    def observe(self, admitted_tokens: int) -> None:
        if len(self._sizes) == self._sizes.maxlen:
            self._sum -= self._sizes[0]
        self._sizes.append(admitted_tokens)
        self._sum += admitted_tokens

    def mean_tokens(self) -> float:
        """0.0 before any request."""
        return self._sum / len(self._sizes) if self._sizes else 0.0


def imbalance_margin_tokens(config: RouterConfig, mean_request_tokens: float = 0.0) -> int:
    """The absolute margin of the load guard: imbalance_abs_tokens, raised to
    imbalance_margin_requests mean requests when requests are large."""
    return max(config.imbalance_abs_tokens, math.ceil(config.imbalance_margin_requests * mean_request_tokens))


def worker_load_tokens(stats: WorkerStats, extra_tokens: int = 0) -> int:
    """Tokens the worker still has to compute (plus router in-flight, charged uncached)."""
    return stats.tokens_to_compute + extra_tokens


def is_imbalanced(load_tokens: int, min_load_tokens: int, config: RouterConfig,
                  margin_tokens: int | None = None) -> bool:
    """True when `load_tokens` exceeds the minimum by both the ratio and the absolute margin
    (`margin_tokens`, default config.imbalance_abs_tokens: see `imbalance_margin_tokens`)."""
    margin = config.imbalance_abs_tokens if margin_tokens is None else margin_tokens
    return load_tokens > min_load_tokens * config.imbalance_ratio and load_tokens - min_load_tokens > margin


def choose_worker(matched_blocks: Mapping[str, int], workers: Sequence[WorkerStats], config: RouterConfig,
                  rng: random.Random, cursor: RoundRobinCursor | None = None,
                  extra_load_tokens: Mapping[str, int] | None = None,
                  mean_request_tokens: float = 0.0,
                  known_blocks: Mapping[str, int] | None = None,
                  adapter: AdapterRouting | None = None) -> RoutingDecision:
    """Pick the worker for one request (see the module docstring for the policies).
    `known_blocks`: blocks the router's prefix index places on each worker (reported, or
    claimed by a request dispatched there and not yet reported), a floor under the stats'
    footprint (`kv_footprint_tokens`). `adapter`: set for a LoRA request (prefix_aware: a
    request nothing matched goes by adapter affinity)."""
    healthy = sorted((w for w in workers if w.healthy), key=lambda w: w.worker_id)
    if not healthy:
        raise WorkerFailedError(f"no healthy worker among {len(workers)}")
    extra = extra_load_tokens or {}
    loads = {w.worker_id: worker_load_tokens(w, extra.get(w.worker_id, 0)) for w in healthy}
    ids = [w.worker_id for w in healthy]

    def decide(worker_id: str, path: RoutingPath) -> RoutingDecision:
        return RoutingDecision(worker_id, matched_blocks.get(worker_id, 0), path, loads[worker_id])

    if config.policy == "round_robin":
        if cursor is None:
            raise ValueError("round_robin routing needs a RoundRobinCursor")
        return decide(cursor.take(ids), RoutingPath.ROUND_ROBIN)
    if config.policy == "least_loaded":
        return decide(_least_loaded(ids, loads, rng), RoutingPath.LEAST_LOADED)
    known = known_blocks or {}
    footprints = {w.worker_id: kv_footprint_tokens(w, extra.get(w.worker_id, 0), known.get(w.worker_id, 0))
                  for w in healthy}
    margin = imbalance_margin_tokens(config, mean_request_tokens)
    if adapter is not None and not any(matched_blocks.get(w, 0) for w in ids):
        min_load = min(loads.values())
        chosen, held = choose_for_adapter(ids, loads, set(adapter.holders), adapter.num_adapters,
                                          adapter.load_cost_tokens,
                                          lambda w: is_imbalanced(loads[w], min_load, config, margin))
        return decide(chosen, RoutingPath.ADAPTER_HOLDER if held else RoutingPath.ADAPTER_LOAD)
    return _prefix_aware(ids, loads, footprints, matched_blocks, config, margin, rng, decide)


def kv_footprint_tokens(stats: WorkerStats, extra_tokens: int = 0, known_blocks: int = 0) -> int:
    """KV the worker's cache holds, running or reusable (plus router in-flight): how much a
    new prefix placed there would compete with. `known_blocks` (the prefix index's count) is a
    floor: a request that ended after the worker's last poll is no longer in flight, and its
    blocks are not yet in the stats; without the floor the worker briefly looked a family
    lighter, and on a slow machine two new families followed one another onto it."""
    from_stats = (stats.num_blocks_used + stats.num_blocks_cached) * stats.block_size + extra_tokens
    return max(from_stats, known_blocks * stats.block_size)


def _prefix_aware(ids: list[str], loads: dict[str, int], footprints: dict[str, int],
                  matched_blocks: Mapping[str, int], config: RouterConfig, margin: int, rng: random.Random,
                  decide) -> RoutingDecision:
    matching = [w for w in ids if matched_blocks.get(w, 0) > 0]
    if not matching:
        return decide(_place_new_prefix(ids, loads, footprints, config, margin, rng), RoutingPath.NO_PREFIX)
    # Longest match first; among equal matches the less loaded one keeps affinity cheaper,
    # and a full tie is a coin toss: breaking it by worker id sent the hot family's requests
    # to worker-0 whenever both held it idle (measured: 1.67x the other's tokens).
    top = max(matched_blocks[w] for w in matching)
    lowest = min(loads[w] for w in matching if matched_blocks[w] == top)
    best = rng.choice([w for w in matching if matched_blocks[w] == top and loads[w] == lowest])
    min_load = min(loads.values())
    if not is_imbalanced(loads[best], min_load, config, margin):
        return decide(best, RoutingPath.PREFIX_MATCH)
    # Sticky spill: a worker that already holds most of this prefix (where the family spilled
    # before) takes it while it is not overloaded itself, so a hot family grows onto a second
    # worker once and stays on those two, instead of landing on a random one each time.
    holders = [w for w in matching if w != best and 2 * matched_blocks[w] >= top
               and not is_imbalanced(loads[w], min_load, config, margin)]
    if holders:
        return decide(min(holders, key=lambda w: (loads[w], -matched_blocks[w], w)), RoutingPath.PREFIX_SPILL)
    return decide(_power_of_two(ids, loads, rng), RoutingPath.PREFIX_IMBALANCED)


def preferred_workers(matched_blocks: Mapping[str, int], exclude: frozenset[str] = frozenset()) -> set[str]:
    """The workers holding the request's longest cached prefix (none when nothing matched)."""
    matching = {w: n for w, n in matched_blocks.items() if n > 0 and w not in exclude}
    if not matching:
        return set()
    top = max(matching.values())
    return {w for w, n in matching.items() if n == top}


def is_spill(matched_blocks: Mapping[str, int], eligible: Sequence[WorkerStats], chosen: str) -> bool:
    """The request went elsewhere because the worker with its longest cached prefix had no
    budget left (it was not among the workers with room)."""
    preferred = preferred_workers(matched_blocks)
    if not preferred:
        return False
    return chosen not in preferred and not (preferred & {w.worker_id for w in eligible})


def _least_loaded(ids: list[str], loads: dict[str, int], rng: random.Random) -> str:
    lowest = min(loads[w] for w in ids)
    return rng.choice([w for w in ids if loads[w] == lowest])


def _place_new_prefix(ids: list[str], loads: dict[str, int], footprints: dict[str, int], config: RouterConfig,
                      margin: int, rng: random.Random) -> str:
    """Power of two choices; between loads within the imbalance thresholds, the smaller KV
    footprint wins (then the lower load), else the lower load."""
    if len(ids) == 1:
        return ids[0]
    pair = rng.sample(ids, 2)
    low, high = sorted(loads[w] for w in pair)
    if is_imbalanced(high, low, config, margin):
        return min(pair, key=lambda w: loads[w])
    return min(pair, key=lambda w: (footprints[w], loads[w]))


def _power_of_two(ids: list[str], loads: dict[str, int], rng: random.Random) -> str:
    """Two random workers, the less loaded wins: near least-loaded balance without every
    router replica stampeding onto the same 'least loaded' worker between refreshes."""
    if len(ids) == 1:
        return ids[0]
    first, second = rng.sample(ids, 2)
    return first if loads[first] <= loads[second] else second
