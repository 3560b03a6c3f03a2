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
  counts a cached prefix the load leaves out, and would make the margin ~12 cache hits wide
  on the 16-worker llm-d-shaped workload (6k-token prefixes) instead of ~2 requests;
- request, state: the request's size and family and the policy's state (predicted_latency).

The absolute margin is `max(imbalance_abs_tokens, imbalance_margin_requests x mean request)`
(`imbalance_margin_tokens`). A fixed token count means different things for different
request mixes: 2,048 tokens is ~4 of the 2-worker campaign's 550-token requests but less than
one 7.2k-token request of the 16-worker table, where one queued request on a hot worker
would break affinity and spread families over up to 15 workers (simulated: hit rate 0.34
against 0.58 with a margin of ~2 requests at 8 QPS). In units of requests the guard says the same
thing for every mix: "spill when the hot worker is more than ~2 requests ahead", a request
counted at what it cost the worker it went to (a cache hit its tail, a miss its whole prompt),
as the load counts it.

A worker's load is `tokens_to_compute (+ extra)`: the forward-pass tokens its running and
waiting requests still need (prompt not yet computed, a cached prefix left out, plus output
to come; `WorkerStats.tokens_to_compute`), plus what the router sent since (charged
uncached: `cost_for` in admission). A cache hit costs a worker nothing to compute, so a hot
family's long prefix does not count against its worker at all, and affinity breaks only on
real overload. Not the KV held (`kv_tokens_used + queued_prompt_tokens`): a worker serving
cache hits holds as much KV as one computing misses but has far less to compute, so a KV load
calls it busy and moves work off it that it would finish first (simulated, skewed-mix shape:
computed tokens per worker more than 1.5x apart in 9 of 60 runs with the KV load, 5 of 60
with the tokens to compute).

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
    predicted_latency
                   the lowest predicted TTFT (router/latency.py: the work queued there, this
                   request's prompt tokens not cached there, the step-cost model) among the
                   family's workers: the workers holding its longest cached prefix, or, for a
                   spread family, its members (router/hot_spread.py). When the best of them
                   runs ahead of the mean load by the load guard's thresholds (a hot spot;
                   past capacity one worker idling for a moment is none), the
                   family grows by the first worker of its rendezvous order within the same
                   bound, if that one would serve the request sooner (path prefix_spread),
                   or when its workers' recent work runs spread_work_ratio ahead of the mean
                   because of the family itself (its own cache hits' work at least the excess);
                   a growth must move at least the prefix it costs (the family's recent work
                   per worker after it >= the prefix tokens the newcomer computes);
                   it gives the newest member back after router.spread_cooldown_s without
                   need. A prompt with no cached prefix goes to the worker with the lowest
                   prediction; workers within latency_tie_ratio of it are equal, and of those
                   the one sent the least recent work (WorkMeter) takes it, then the smaller
                   KV footprint, then the family's rendezvous order. With several router
                   replicas (router.num_replicas) each one's recent work is its own, and two
                   replicas sent a new family's first requests to two workers: there it goes
                   to the first worker of the family's rendezvous order within a bound read
                   from what every replica sees alike (`_place_by_rendezvous`), the rule
                   above only when none is within it; with the replicas' shared claims the
                   proposal is the rule above with recent work read from the blocks the
                   workers stored (`RouteRequest.proposing_claim`). Each replica counts its
                   own dispatches num_replicas times in its recent-work meters (it sees about
                   that share of the traffic), so the spreading bounds, absolute tokens,
                   read the cluster's work: counted once, the hot families of the 64-worker
                   table spread late and max/min was 2.01 / 1.81 at 16 / 32 qps with two
                   replicas against 1.49 / 1.43 with one. Needs a `PredictedLatencyState`
                   and a `RouteRequest`.
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
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from kvmesh.core.config import RouterConfig
from kvmesh.router.adapter_affinity import choose_for_adapter
from kvmesh.core.seams import WorkerStats
from kvmesh.core.errors import WorkerFailedError
from kvmesh.router.hot_spread import FamilySpread, SpreadAction, WorkMeter, preference_order
from kvmesh.router.live_families import LiveFamilies
from kvmesh.router.latency import StepCostModel, TtftCalibration, predict_ttft_s, uncached_prompt_tokens


# The policies that hash prompts and route on the prefix index (router/stages/admit_route.py, the simulator).
PREFIX_POLICIES = ("prefix_aware", "predicted_latency")


class RoutingPath(str, enum.Enum):
    PREFIX_MATCH = "prefix_match"  # longest cached prefix, load within bounds
    PREFIX_SPILL = "prefix_spill"  # its best worker is overloaded; another holding most of it takes it
    PREFIX_IMBALANCED = "prefix_imbalanced"  # a prefix matched but every holder is overloaded -> p2c
    PREFIX_SPREAD = "prefix_spread"  # its family's workers run ahead: one more joins it (predicted_latency)
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
    predicted_ttft_s: float | None = None  # predicted_latency: the chosen worker's predicted TTFT
    spread: SpreadAction | None = None  # predicted_latency: the family's spread state after it
    family_key: bytes | None = None  # predicted_latency: the request's family (`family_key`)


@dataclass(frozen=True)
class RouteRequest:
    """What the predicted-latency policy needs of a request besides its matched blocks."""

    num_prompt_tokens: int
    block_size: int
    family_key: bytes | None  # `family_key(...)`; None: no full block (no family)
    # With several router replicas: the worker a shared claim gives this new family
    # (router/family_claims.py); it takes a prompt nothing matched when it is among the workers.
    claimed_worker: str | None = None
    # This replica proposes the worker for a shared claim: the proposal weighs recent work as
    # every replica hears it (the blocks the workers stored) instead of its own dispatches.
    proposing_claim: bool = False


def family_key(block_hashes: Sequence[bytes], family_blocks: int) -> bytes | None:
    """The chain hash of the prompt's first `family_blocks` full blocks (fewer when shorter)."""
    return block_hashes[min(len(block_hashes), family_blocks) - 1] if block_hashes else None


class PredictedLatencyState:
    """The predicted-latency policy's state, one per router replica (the simulator keeps one
    the same way): the step-cost model, the spread families, the recent work per worker and
    per family, and the TTFT calibration. `commit(decision, cost_tokens)` after each dispatch.

    A family's recent work is kept twice: all its tickets (`family_work`: how much of its
    workers' work is the family's), and those of its requests that found their prefix cached
    where they went (`family_hit_work`: the work that would move if it spread; its prefix
    computations would not). Kept for the `max_families` most recently seen families."""

    def __init__(self, config: RouterConfig, max_num_batched_tokens: int,
                 clock: Callable[[], float] = time.monotonic, max_families: int = 4096) -> None:
        self.cost = StepCostModel(config.step_overhead_s, config.prefill_s_per_token, config.decode_s_per_token)
        self.max_num_batched_tokens = max_num_batched_tokens
        self.spread = FamilySpread(config.spread_cooldown_s, clock, max_families)
        self.work = WorkMeter(config.work_half_life_s, clock)
        self.family_work = WorkMeter(config.work_half_life_s, clock, max_keys=max_families)
        self.family_hit_work = WorkMeter(config.work_half_life_s, clock, max_keys=max_families)
        # Blocks each worker stored (computed), from the prefix events every replica hears alike
        # (PrefixIndex.on_stored): recent work as all the router replicas see it.
        self.stored_blocks = WorkMeter(config.work_half_life_s, clock)
        # The prefix blocks of the families routed to each worker within the work half-life
        # (router/live_families.py): the part of a full cache that new families must not evict.
        self.live = LiveFamilies(config.work_half_life_s, clock)
        self.calibration = TtftCalibration()
        # Each of several router replicas dispatches about 1 / num_replicas of the traffic:
        # its own work meters are scaled to the cluster's, so absolute bounds keep their sense.
        self.traffic_scale = max(1, config.num_replicas)

    def movable_work(self, key: bytes) -> float:
        """The family's recent cache-hit work (what would move if it spread), for a family
        younger than the meter's memory extrapolated to what it would read at the family's
        current rate (`WorkMeter.steady_value`): a hot family that has just appeared looked as
        cold as its few seconds of hits, and its home took every request until they had added
        up (the hottest family's home took 25 of its first 36 on the 64-worker table). The age
        counts from its first request, and at least one `spread_cooldown_s` (a newcomer stays
        that long), so a family seen for a moment is not judged on one or two hits."""
        value = self.family_hit_work.value(key)
        age_s = self.family_work.age_s(key)
        if value <= 0 or age_s is None:
            return value
        return self.family_hit_work.steady_value(value, max(age_s, self.spread.cooldown_s))

    def observe_stored(self, worker_id: str, num_blocks: int) -> None:
        """A worker reported `num_blocks` newly stored prefix blocks (PrefixIndex.on_stored)."""
        self.stored_blocks.observe(worker_id, num_blocks)

    def live_blocks(self, worker_id: str) -> float:
        """The cache the families in use hold on the worker: those this replica routed there
        recently (`live`), or, when more, the blocks it stored recently per the prefix events
        every replica hears (another replica's new families there, not yet routed by this one)."""
        return max(self.live.blocks(worker_id), self.stored_blocks.value(worker_id))

    def predict_s(self, stats: WorkerStats, extra_tokens: int, uncached_tokens: int) -> float:
        return predict_ttft_s(self.cost, stats, extra_tokens, uncached_tokens, self.max_num_batched_tokens)

    def commit(self, decision: RoutingDecision, cost_tokens: int, prompt_blocks: int = 0) -> None:
        """The request went where `decision` says, charged `cost_tokens` there; its prompt
        has `prompt_blocks` full blocks (its family's footprint there, `live`)."""
        scaled = cost_tokens * self.traffic_scale
        self.work.observe(decision.worker_id, scaled)
        if decision.family_key is not None:
            if prompt_blocks:
                self.live.note(decision.worker_id, decision.family_key, prompt_blocks)
            self.family_work.observe(decision.family_key, scaled)
            if decision.matched_blocks > 0:
                self.family_hit_work.observe(decision.family_key, scaled)
        self.spread.apply(decision.spread)


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
                  adapter: AdapterRouting | None = None,
                  request: RouteRequest | None = None,
                  state: PredictedLatencyState | None = None) -> RoutingDecision:
    """Pick the worker for one request (see the module docstring for the policies).
    `known_blocks`: blocks the router's prefix index places on each worker (reported, or
    claimed by a request dispatched there and not yet reported), a floor under the stats'
    footprint (`kv_footprint_tokens`). `adapter`: set for a LoRA request (the prefix policies:
    a request nothing matched goes by adapter affinity). `request` and `state`: for
    predicted_latency."""
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
    by_id = {w.worker_id: w for w in healthy}
    footprints = _LazyMap(lambda w: kv_footprint_tokens(by_id[w], extra.get(w, 0), known.get(w, 0)))
    margin = imbalance_margin_tokens(config, mean_request_tokens)
    if adapter is not None and not any(matched_blocks.get(w, 0) for w in ids):
        min_load = min(loads.values())
        chosen, held = choose_for_adapter(ids, loads, set(adapter.holders), adapter.num_adapters,
                                          adapter.load_cost_tokens,
                                          lambda w: is_imbalanced(loads[w], min_load, config, margin))
        return decide(chosen, RoutingPath.ADAPTER_HOLDER if held else RoutingPath.ADAPTER_LOAD)
    if config.policy == "predicted_latency":
        if request is None or state is None:
            raise ValueError("predicted_latency routing needs a RouteRequest and a PredictedLatencyState")
        return _predicted_latency(by_id, loads, footprints, matched_blocks, config, margin, request, state, extra)
    work = state.work.values(ids) if state is not None else {}
    if request is not None and request.claimed_worker in by_id and not any(matched_blocks.get(w, 0) for w in ids):
        return decide(request.claimed_worker, RoutingPath.NO_PREFIX)  # the replicas' shared claim
    return _prefix_aware(ids, loads, footprints, work, matched_blocks, config, margin, rng, decide)


class _LazyMap(dict):
    """A dict that computes a missing value once, on first use (a figure per worker that a
    decision may need for only a few of them: at 64 workers that is most of its cost)."""

    def __init__(self, compute: Callable[[str], object]) -> None:
        super().__init__()
        self._compute = compute

    def __missing__(self, key: str):
        value = self[key] = self._compute(key)
        return value


def kv_footprint_tokens(stats: WorkerStats, extra_tokens: int = 0, known_blocks: int = 0) -> int:
    """KV the worker's cache holds, running or reusable (plus router in-flight): how much a
    new prefix placed there would compete with. `known_blocks` (the prefix index's count) is a
    floor: a request that ended after the worker's last poll is no longer in flight, and its
    blocks are not yet in the stats; without the floor the worker briefly looked a family
    lighter, and on a slow machine two new families followed one another onto it."""
    from_stats = (stats.num_blocks_used + stats.num_blocks_cached) * stats.block_size + extra_tokens
    return max(from_stats, known_blocks * stats.block_size)


def _prefix_aware(ids: list[str], loads: dict[str, int], footprints: dict[str, int], work: Mapping[str, float],
                  matched_blocks: Mapping[str, int], config: RouterConfig, margin: int, rng: random.Random,
                  decide) -> RoutingDecision:
    matching = [w for w in ids if matched_blocks.get(w, 0) > 0]
    if not matching:
        return decide(_place_new_prefix(ids, loads, footprints, work, config, margin, rng), RoutingPath.NO_PREFIX)
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


def _place_new_prefix(ids: list[str], loads: dict[str, int], footprints: dict[str, int], work: Mapping[str, float],
                      config: RouterConfig, margin: int, rng: random.Random) -> str:
    """Power of two choices; between loads within the imbalance thresholds, the smaller KV
    footprint wins, then the less recent work (`work`: WorkMeter values, empty without a
    state), then the lower load; else the lower load. Recent work matters once both caches
    are full: every footprint is then the pool's size, and the coin alone put 3 of 4 new
    families on one worker."""
    if len(ids) == 1:
        return ids[0]
    pair = rng.sample(ids, 2)
    low, high = sorted(loads[w] for w in pair)
    if is_imbalanced(high, low, config, margin):
        return min(pair, key=lambda w: loads[w])
    return min(pair, key=lambda w: (footprints[w], work.get(w, 0.0), loads[w]))


def _power_of_two(ids: list[str], loads: dict[str, int], rng: random.Random) -> str:
    """Two random workers, the less loaded wins: near least-loaded balance without every
    router replica stampeding onto the same 'least loaded' worker between refreshes."""
    if len(ids) == 1:
        return ids[0]
    first, second = rng.sample(ids, 2)
    return first if loads[first] <= loads[second] else second


def _predicted_latency(by_id: dict[str, WorkerStats], loads: dict[str, int], footprints: dict[str, int],
                       matched_blocks: Mapping[str, int], config: RouterConfig, margin: int,
                       request: RouteRequest, state: PredictedLatencyState,
                       extra: Mapping[str, int]) -> RoutingDecision:
    ids = list(by_id)
    predicted = _LazyMap(lambda w: state.predict_s(by_id[w], extra.get(w, 0), uncached_prompt_tokens(
        request.num_prompt_tokens, matched_blocks.get(w, 0), request.block_size)))
    key = request.family_key
    members = [w for w in state.spread.members(key) if w in loads]

    def decide(worker_id: str, path: RoutingPath, spread: SpreadAction | None = None) -> RoutingDecision:
        return RoutingDecision(worker_id, matched_blocks.get(worker_id, 0), path, loads[worker_id],
                               predicted[worker_id], spread, key)

    top = max((matched_blocks.get(w, 0) for w in ids), default=0)
    family = members or ([w for w in ids if matched_blocks.get(w, 0) == top] if top else [])
    if not family:
        if request.claimed_worker in by_id:  # the replicas' shared claim: every one places it there
            return decide(request.claimed_worker, RoutingPath.NO_PREFIX)
        chosen = _place_by_rendezvous(by_id, config, margin, state, request) if config.num_replicas > 1 else None
        return decide(chosen or _place_by_latency(by_id, predicted, footprints, config, request, state, extra),
                      RoutingPath.NO_PREFIX)
    work = state.work.values(ids)
    # Among the family's workers, those within latency_tie_ratio of the soonest are equal and
    # the one sent the least recent work takes it, as for a new prefix: the soonest alone sent
    # the hottest family's requests by small queue differences, 20 % of them to its home of 9
    # members (the 64-worker table's hottest worker).
    soonest = min(family, key=lambda w: (predicted[w], work[w], w))
    best = min((w for w in family if predicted[w] <= predicted[soonest] * (1 + config.latency_tie_ratio)),
               key=lambda w: (work[w], predicted[w], w))
    min_load = min(loads.values())
    mean_load = sum(loads.values()) / len(ids)
    mean_work = sum(work.values()) / len(ids)
    family_work = state.family_work.value(key) if key is not None else 0.0
    if key is not None:
        held_tokens = matched_blocks.get(soonest, 0) * request.block_size
        grown = _grow(key, family, members, soonest, ids, loads, min_load, mean_load, work, mean_work, family_work,
                      state.movable_work(key), predicted, config, margin,
                      lambda w: held_tokens - matched_blocks.get(w, 0) * request.block_size)
        if grown is not None:
            return decide(grown.members[-1], RoutingPath.PREFIX_SPREAD, grown)
    if len(members) < 2:
        return decide(best, RoutingPath.PREFIX_MATCH)
    # Hysteresis: the newest member stays while the others still run ahead, by half the
    # thresholds, in queue or (because of the family) in recent work.
    core = members[:-1]
    core_best = min(core, key=lambda w: (predicted[w], w))
    def half(ratio: float) -> float:
        return 1 + (ratio - 1) / 2

    queue_ahead = loads[core_best] - min_load > margin / 2 and loads[core_best] > min_load * half(config.imbalance_ratio)
    work_ahead = _work_ahead(min(work[w] for w in core), family_work / len(core), mean_work,
                             half(config.spread_work_ratio), config.imbalance_abs_tokens / 2)
    return decide(best, RoutingPath.PREFIX_MATCH, SpreadAction(key, tuple(members), False, queue_ahead or work_ahead))


def _work_ahead(lightest: float, family_share: float, mean_work: float, ratio: float, margin: float) -> bool:
    """A family's workers run ahead in recent work, and the family itself is why: its least
    busy worker exceeds the mean by `ratio` and `margin`, and the family's own recent work per
    worker (`family_share`, all its tickets) is at least that excess: without it they would not
    run ahead. A worker busy with other families' prefixes is left to new-prefix
    placement (which steers around its recent work): spreading a family that is not the cause
    only recomputes its prefix elsewhere."""
    excess = lightest - mean_work
    return lightest > mean_work * ratio and excess > margin and family_share >= excess


def _grow(key: bytes, family: list[str], members: list[str], best: str, ids: list[str], loads: dict[str, int],
          min_load: int, mean_load: float, work: dict[str, float], mean_work: float, family_work: float,
          family_hit_work: float, predicted: dict[str, float],
          config: RouterConfig, margin: int, recompute_tokens: Callable[[str], int]) -> SpreadAction | None:
    """One more worker for the family when its best worker runs ahead, by the load guard's
    thresholds, of the mean load (a hot spot: against the least loaded worker, past capacity
    the moment one worker emptied spread the hot families, each copy a whole prefix's prefill
    more for a saturated cluster), and the newcomer would serve this request sooner; or when
    its workers run ahead of the mean recent work because of the family itself (`_work_ahead`:
    a hot family computing far more than the others while nobody queues yet): the first worker of the family's rendezvous order within the bound (neither
    its queue nor its recent work, counting the prefix it would compute, ahead by those
    thresholds: a newcomer near the bound went past it with the prefix, and the family grew
    again at once, five times in a second on the 64-worker table). The work test takes the family's
    least busy worker, so a growth that has just taken effect (a newcomer with little work yet)
    is not followed by another while its members' past work decays.

    Either way a growth must pay for itself: the newcomer's share of the family's recent work
    that would move (`family_hit_work`, its cache hits' tickets, over one more worker; a young
    family's extrapolated to its current rate, `PredictedLatencyState.movable_work`) at least
    the prefix it would compute
    (`recompute_tokens`). A family with little traffic gains nothing from a second copy of its
    prefix; its request waits out the queue at home."""
    queue_ahead = is_imbalanced(loads[best], mean_load, config, margin)
    work_ahead = _work_ahead(min(work[w] for w in family), family_work / len(family), mean_work,
                             config.spread_work_ratio, config.imbalance_abs_tokens)
    if not (queue_ahead or work_ahead):
        return None
    for candidate in preference_order(key, ids):
        if candidate in family or is_imbalanced(loads[candidate], min_load, config, margin):
            continue
        after = work[candidate] + recompute_tokens(candidate)
        if after > mean_work * config.spread_work_ratio and after - mean_work > config.imbalance_abs_tokens:
            continue  # its recent work, with the prefix it would compute, is ahead: past the bound
        if queue_ahead and not predicted[candidate] < predicted[best]:
            return None  # the first worker within the bound is no sooner: spreading would not help
        if family_hit_work / (len(family) + 1) < recompute_tokens(candidate):
            return None
        home = tuple(members) if members else tuple(sorted(family, key=lambda w: (predicted[w], w)))
        return SpreadAction(key, home + (candidate,), True, False, cause="queue" if queue_ahead else "work")
    return None


def _place_by_latency(by_id: dict[str, WorkerStats], predicted: dict[str, float], footprints: dict[str, int],
                      config: RouterConfig, request: RouteRequest, state: PredictedLatencyState,
                      extra: Mapping[str, int]) -> str:
    """A new prefix, among the workers where its prompt fits in the cache beside the
    families in use there (`PredictedLatencyState.live_blocks`; all workers when it fits
    nowhere): the lowest predicted TTFT; within latency_tie_ratio of it, the least recent
    work, then the smaller KV footprint, then the family's rendezvous order. Without the fit
    a full cache (the footprint then says nothing) took a fourth family in use where three
    fit, and each of its requests evicted another's prefix (the one-replica routing campaign,
    docs/routing.md): a recomputed prefix costs more than the queue it avoided."""
    key, prompt_blocks = request.family_key, request.num_prompt_tokens // request.block_size
    ids = [w for w in by_id if state.live_blocks(w) + prompt_blocks <= by_id[w].num_blocks_total] or list(by_id)
    lowest = min(predicted[w] for w in ids)
    near = [w for w in ids if predicted[w] <= lowest * (1 + config.latency_tie_ratio)]
    if request.proposing_claim:
        # A claim proposal: the blocks each worker stored (every replica's work, as all hear
        # it) plus what this replica sent there that its report does not hold yet.
        work = {w: blocks * request.block_size + extra.get(w, 0)
                for w, blocks in state.stored_blocks.values(near).items()}
    else:
        work = state.work.values(near)
    least = min((work[w], footprints[w]) for w in near)
    tied = [w for w in near if (work[w], footprints[w]) == least]
    if len(tied) == 1 or key is None:
        return tied[0]
    return preference_order(key, tied)[0]


def _place_by_rendezvous(by_id: dict[str, WorkerStats], config: RouterConfig, margin: int,
                         state: PredictedLatencyState, request: RouteRequest) -> str | None:
    """A new family with several router replicas: the first worker of its rendezvous order
    (`preference_order`) within the bound, so replicas that have not yet heard of each other's
    first requests of the family send them to the same worker (each one's least recent work,
    the rule with one replica, sent them to two: one family of six split on the two-replica
    campaign). None: no family key, or none within the bound.

    The bound reads what every replica sees alike, the workers' reports and prefix events;
    what each replica sent since is its own, and told them apart:
    - the prompt's predicted TTFT within latency_tie_ratio of the lowest (reports taken at
      different moments must not tell the replicas apart either);
    - its queue not ahead of the least loaded worker's by the load guard's thresholds (with
      each replica's own in-flight tokens, at 16 in flight on the two-replica campaign one
      replica's burst tripped the guard there only, and the other sent the same new family
      to the other worker);
    - its recent work within spread_work_ratio, or the smaller of imbalance_abs_tokens and
      half the prompt, of the least busy worker's: the blocks each worker stored, from the
      prefix events (`PredictedLatencyState.stored_blocks`). A deadband around the least, not
      a cap over the mean: a cap alone (consistent hashing with bounded loads) left the
      workers no family hashes to first idle (16 workers: computed max/min 1.8);
    - its reported KV footprint with the prompt within spread_work_ratio or one prompt of the
      mean, so new prefixes spread over caches that still have room."""
    key, prompt_tokens = request.family_key, request.num_prompt_tokens
    if key is None:
        return None
    ids = list(by_id)
    reported = {w: state.predict_s(s, 0, prompt_tokens) for w, s in by_id.items()}
    fastest = min(reported.values()) * (1 + config.latency_tie_ratio)
    loads = {w: worker_load_tokens(s) for w, s in by_id.items()}
    min_load = min(loads.values())
    footprints = {w: kv_footprint_tokens(s) for w, s in by_id.items()}
    mean_footprint = sum(footprints.values()) / len(ids)
    work = {w: blocks * request.block_size for w, blocks in state.stored_blocks.values(ids).items()}
    least_work = min(work.values())
    deadband = min(config.imbalance_abs_tokens, prompt_tokens / 2)
    ratio = config.spread_work_ratio
    for worker_id in preference_order(key, ids):
        if reported[worker_id] > fastest or is_imbalanced(loads[worker_id], min_load, config, margin):
            continue
        if work[worker_id] > least_work * ratio and work[worker_id] - least_work > deadband:
            continue
        held = footprints[worker_id] + prompt_tokens
        if held > mean_footprint * ratio and held - mean_footprint > prompt_tokens:
            continue
        return worker_id
    return None
