"""A routing simulator for clusters we cannot run here: the real router policy, prefix index
and admission rule, and the real scheduler and KV-cache manager of every worker, driven by
simulated engines whose step time comes from a per-token cost model.

    python -m kvmesh.load_tests.routing_sim --workers 16 --families 150 --prefix-tokens 6000 \
        --question-tokens 1200 --qps 1 2 4 8 --policies prefix_aware round_robin

What is real and what is simulated:

    real       router/routing.py choose_worker (every policy), router/prefix_index.py (fed by
               each worker's real prefix events, polled every stats_refresh_s, with the
               in-flight claims of dispatched requests), the router's admission rule
               (committed + cost on a worker <= capacity, the cost less the prefix the index
               says is resident or claimed in flight, cached blocks no live request holds
               charged: router/admission.py cost_on_worker), the worker's
               scheduler (worker/engine_loop/scheduler.py: admission with pinned prefixes, chunked
               prefill, preemption) over kv/kv_cache_manager.py (block pool, prefix cache,
               LRU eviction, events)
    simulated  the forward pass: a step of P prefill tokens and D decoding sequences takes
               overhead + P x prefill_s_per_token + D x decode_s_per_token (CostModel);
               sampled tokens are a constant (routing never looks at them); the network and
               the router's own CPU time are zero

A worker that refuses a request (its exact admission disagrees with the router's stale view)
is left out until the next poll and the request is admitted afresh, as router_core does
(admission.note_refusal; a refuser holding its prefix is waited for until that poll; the
router gives up after two such refusals, the simulator never does); a request no worker can take waits in the router's queue, in order, stepping over
requests that hold out for their prefix's worker (the affinity wait, router/affinity_wait.py). Time is simulated (a heap of events), so a
run of thousands of requests on 64 workers takes seconds to minutes of CPU, not hours.

Figures per run (SimResult): prefix hit rate (cached prompt tokens / prompt tokens, as the
workers count them), TTFT P50/P90 (arrival at the router to first token), tokens computed per
worker (prefill actually run + decode) and max/min, spills (preferred worker full in the
router's view; worker refused), families per worker.
"""

from __future__ import annotations

# Function-level imports: torch and the engine load only to measure the cost model (the
# campaign module, imported for its workload and oracle, imports Ray only when it runs).

import argparse
import collections
import dataclasses
import heapq
import itertools
import json
import math
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvmesh.core.config import RouterConfig, SchedulerConfig
from kvmesh.kv.hashing import hash_full_blocks
from kvmesh.kv.kv_cache_manager import KVCacheManager
from kvmesh.load_tests.routing_campaign import family_workload, oracle_hit_rate
from kvmesh.router.admission import cost_on_worker, cost_with_cached_prefix
from kvmesh.router.affinity_wait import AffinityHold, AffinityWaitOutcome
from kvmesh.router.family_claims import claim_candidates, claim_proposal
from kvmesh.router.prefix_index import PrefixIndex
from kvmesh.router.latency import StepCostModel
from kvmesh.router.routing import (PREFIX_POLICIES, PredictedLatencyState, RequestSizeMeter, RoundRobinCursor, RouteRequest,
                                   choose_worker, family_key, is_spill)
from kvmesh.core.seams import SamplingParams
from kvmesh.worker.engine_loop.engine import worker_stats
from kvmesh.core.errors import OverloadedError
from kvmesh.worker.engine_loop.request import Request
from kvmesh.worker.engine_loop.scheduler import Scheduler

EXTRA_KEYS = ("model=sim",)
SAMPLED_TOKEN = 7  # the simulated model always says this; routing never reads outputs


# The simulated engines' step time is the router's own step-cost model (router/latency.py):
# the predicted-latency policy predicts with the same formula the simulator runs.
CostModel = StepCostModel


@dataclass(frozen=True)
class SimWorkload:
    num_families: int = 6
    family_weights: tuple[float, ...] | None = None  # None = Zipf(zipf_s) over num_families
    zipf_s: float = 1.0
    prefix_tokens: int = 528
    question_tokens: tuple[int, int] = (12, 24)  # uniform, unique per request
    max_tokens: int = 8
    num_requests: int = 64
    qps: float | None = None  # open loop (Poisson); None = closed loop
    concurrency: int = 4  # closed loop: requests in flight
    seed: int = 0
    # Exact (family, prompt ids) to send instead of generating them: the calibration replays
    # the very requests a real campaign run sent (routing_campaign.family_workload).
    prompts: tuple[tuple[int, tuple[int, ...]], ...] | None = None
    # Closed loop: the first `warm_up` requests go one at a time, each two polls after the
    # previous one ended (as the routing e2e test places each family's prompt first).
    warm_up: int = 0

    def weights(self) -> list[float]:
        if self.family_weights is not None:
            return list(self.family_weights)
        return [1.0 / (rank ** self.zipf_s) for rank in range(1, self.num_families + 1)]


@dataclass(frozen=True)
class SimCluster:
    num_workers: int = 2
    num_blocks: int = 128
    block_size: int = 16
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 512  # SchedulerConfig default (also the prefill chunk)
    stats_refresh_s: float = 0.1
    cost: CostModel = field(default_factory=CostModel)


@dataclass
class SimResult:
    policy: str
    num_workers: int
    load: str
    num_requests: int
    hit_rate: float
    ttft_p50_ms: float
    ttft_p90_ms: float
    computed_max_over_min: float
    computed_tokens_per_worker: dict[str, int]
    spills_router: int
    spills_worker_refused: int
    families_on_more_than_one: int
    max_workers_per_family: int
    mean_families_per_worker: float
    sim_duration_s: float
    wall_s: float
    oracle_hit_rate: float = 0.0  # the best any router could do on these requests (routing_campaign.oracle_hit_rate)
    routing_paths: dict[str, int] = field(default_factory=dict)  # choose_worker's decisions by RoutingPath
    affinity_waits: int = 0  # requests that waited for room on their prefix's worker (router/affinity_wait.py)
    affinity_timeouts: int = 0  # of those, the ones whose wait ran out (then spilled)
    # predicted_latency: mean |actual - predicted| / actual TTFT at the worker, and the factor
    # actual / predicted the router's calibration learned (router/latency.py TtftCalibration)
    ttft_prediction_error: float = 0.0
    ttft_prediction_factor: float = 1.0
    spread_families_at_end: int = 0  # predicted_latency: families spread over > 1 worker when the run ended
    # Where the hit rate went: prompt tokens each request computed that the oracle would have
    # found cached (its longest prefix shared with any earlier request), summed by the routing
    # path that placed it (":queue" / ":work": a spread family's growth, by its cause; "+spill":
    # its prefix's worker had no budget; "+refused": a worker refused it first). The keys say which rule to look at when the hit rate misses the oracle.
    missed_vs_oracle_by_path: dict[str, int] = field(default_factory=dict)
    spread_growths: dict[str, int] = field(default_factory=dict)  # predicted_latency: families grown, by cause
    num_routers: int = 1  # router replicas simulated (each its own view and state)


class SimClock:
    """Simulated time, read by the policy state, the prefix index and the schedulers."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass
class _SimRequest:
    index: int
    family: int
    prompt: list[int]
    hashes: list
    arrival_s: float
    worker_id: str | None = None
    request: Request | None = None
    first_token_s: float | None = None
    in_flight_token: int | None = None
    sent_at: float = 0.0  # when it was dispatched, and what its worker was charged (the ticket)
    cost_tokens: int = 0
    load_tokens: int = 0  # what it computes there (its cost but for a cached prefix nobody held)
    affinity_hold: AffinityHold | None = None  # its affinity wait, from its first try on
    predicted_ttft_s: float | None = None  # predicted_latency: the prediction it was routed on
    oracle_cached_tokens: int = 0  # what the oracle would have found cached (`_oracle_cached_tokens`)
    path: str = ""  # the routing path that placed it, "+spill" / "+refused" as missed_vs_oracle_by_path
    refusals: int = 0
    refused_by: str | None = None  # the worker that last refused it (it waits for that one's next poll)
    route_request: RouteRequest | None = None  # as admitted (a claimed worker included), from its first try
    router: "_SimRouter | None" = None  # the router replica that dispatched it


class _SimWorker:
    """One engine: the real scheduler and KV manager; the forward pass is the cost model."""

    def __init__(self, worker_id: str, cluster: SimCluster, clock: SimClock):
        self.worker_id = worker_id
        self.clock = clock
        kv = KVCacheManager(cluster.num_blocks, cluster.block_size, worker_id=worker_id)
        config = SchedulerConfig(max_num_seqs=cluster.max_num_seqs,
                                 max_num_batched_tokens=cluster.max_num_batched_tokens,
                                 max_prefill_tokens_per_step=cluster.max_num_batched_tokens, max_queue_len=10**6,
                                 max_queue_time_s=10**9)
        self.scheduler = Scheduler(config, kv, clock=clock)
        self.cost = cluster.cost
        self.busy = False
        self.computed_tokens = 0
        self.families: set[int] = set()
        self._output = None

    def start_step(self) -> float | None:
        """Schedule one step; returns its duration (None when there is nothing to run)."""
        if self.busy or not self.scheduler.has_unfinished():
            return None
        output = self.scheduler.schedule()
        if not output.scheduled:
            return None
        prefill = sum(e.num_scheduled_tokens for e in output.scheduled if e.num_scheduled_tokens > 1)
        decode = sum(1 for e in output.scheduled if e.num_scheduled_tokens == 1)
        self.computed_tokens += prefill + decode
        self.busy, self._output = True, output
        return self.cost.step_s(prefill, decode)

    def finish_step(self) -> list[Request]:
        """Apply the step's results; returns the requests that produced their first token."""
        output, self._output, self.busy = self._output, None, False
        sampled = {e.request.request_id: SAMPLED_TOKEN for e in output.scheduled if e.sample}
        before = {e.request.request_id: e.request.first_token_time for e in output.scheduled}
        self.scheduler.update_from_output(output, sampled)
        first = [e.request for e in output.scheduled
                 if before[e.request.request_id] is None and e.request.first_token_time is not None]
        done = [r.request_id for r in self.scheduler.running if r.num_output_tokens >= r.sampling.max_tokens]
        self.scheduler.finish_requests(done)
        self.finished_ids = done
        return first


def make_requests(workload: SimWorkload, block_size: int) -> list[_SimRequest]:
    if workload.prompts is not None:
        return [_SimRequest(i, family, list(prompt), hash_full_blocks(prompt, block_size, EXTRA_KEYS), 0.0)
                for i, (family, prompt) in enumerate(workload.prompts)]
    rng = random.Random(workload.seed)
    prefixes = [[rng.randrange(1000, 40000) for _ in range(workload.prefix_tokens)]
                for _ in range(workload.num_families)]
    picks = rng.choices(range(workload.num_families), weights=workload.weights(), k=workload.num_requests)
    low, high = workload.question_tokens
    requests = []
    for i, family in enumerate(picks):
        prompt = prefixes[family] + [rng.randrange(1000, 40000) for _ in range(rng.randint(low, high))]
        requests.append(_SimRequest(i, family, prompt, hash_full_blocks(prompt, block_size, EXTRA_KEYS), 0.0))
    return requests


def _oracle_cached_tokens(requests: Sequence[_SimRequest], block_size: int) -> list[int]:
    """Per request, in arrival order, what `oracle_hit_rate` counts cached for it."""
    seen: set = set()
    cached = []
    for r in requests:
        cacheable, blocks = (len(r.prompt) - 1) // block_size, 0
        while blocks < cacheable and r.hashes[blocks] in seen:
            blocks += 1
        cached.append(blocks * block_size)
        seen.update(r.hashes)
    return cached


class SimClaims:
    """The router replicas' shared new-family claims (router/family_claims.py) in simulated
    time: an existing claim is renewed and returned, else the first candidate whose live
    families (claims not expired) leave room for one more is claimed; renewed by each request."""

    def __init__(self, ttl_s: float, clock: SimClock):
        self.ttl_s, self._clock = ttl_s, clock
        self._owners: dict[bytes, tuple[str, float]] = {}  # family key -> (worker, expires at)

    def _live(self, worker_id: str) -> int:
        now = self._clock()
        return sum(1 for owner, expires in self._owners.values() if owner == worker_id and expires > now)

    def claim(self, key: bytes, candidates: Sequence[tuple[str, int]]) -> str:
        owner = self._owners.get(key)
        if owner is None or owner[1] <= self._clock():
            chosen = next((w for w, room in candidates if self._live(w) < room), candidates[0][0])
            owner = (chosen, 0.0)
        self._owners[key] = (owner[0], self._clock() + self.ttl_s)
        return owner[0]

    def keep_alive(self, key: bytes) -> None:
        owner = self._owners.get(key)
        if owner is not None and owner[1] > self._clock():
            self._owners[key] = (owner[0], self._clock() + self.ttl_s)


@dataclass
class _SimRun:
    """What every simulated router replica shares: the workers, the clock, the event heap and
    the run's tallies."""

    policy: str
    cluster: SimCluster
    workload: SimWorkload
    router: RouterConfig
    clock: SimClock
    workers: dict[str, _SimWorker]
    in_flight_claims: bool
    claims: SimClaims | None
    events: list = field(default_factory=list)  # (time, seq, kind, payload)
    seq: itertools.count = field(default_factory=itertools.count)
    by_id: dict[str, _SimRequest] = field(default_factory=dict)
    finished: list[_SimRequest] = field(default_factory=list)
    spills: collections.Counter = field(default_factory=collections.Counter)
    paths: collections.Counter = field(default_factory=collections.Counter)  # RoutingPath values
    growths: collections.Counter = field(default_factory=collections.Counter)

    def push(self, at: float, kind: str, payload=None) -> None:
        heapq.heappush(self.events, (at, next(self.seq), kind, payload))

    def kick(self, worker_id: str) -> None:
        duration = self.workers[worker_id].start_step()
        if duration is not None:
            self.push(self.clock.now + duration, "step_done", worker_id)


class _SimRouter:
    """One router replica: its own prefix index (fed by its own polls of the workers' events),
    admission view (stats, pending tickets, credits, refusals), policy state and queue, as
    router_core keeps them per replica."""

    def __init__(self, run: _SimRun, number: int):
        self.run, self.number = run, number
        router, cluster = run.router, run.cluster
        self.latency_state = PredictedLatencyState(router, cluster.max_num_batched_tokens, run.clock)
        self.proposal_config = dataclasses.replace(router, num_replicas=1)  # as Admitter proposes a claim
        self.index = PrefixIndex(linger_s=4 * cluster.stats_refresh_s, clock=run.clock)
        self.index.on_stored = self.latency_state.observe_stored  # as router_core
        self.rng = random.Random(run.workload.seed + 1 + number)
        self.cursor, self.sizes = RoundRobinCursor(), RequestSizeMeter()
        self.stats = {w: worker_stats(sim.scheduler, w) for w, sim in run.workers.items()}
        self.sent_since_poll: dict[str, int] = collections.Counter()  # pending tickets per worker (KV)
        self.load_since_poll: dict[str, int] = collections.Counter()  # their load (in_flight_tokens)
        self.released_since_poll: dict[str, int] = collections.Counter()  # credited tickets ("Released requests")
        # Blocks of those credited tickets: the report no longer proves them held ("Cached but not held")
        self.let_go_since_poll: dict[str, set] = collections.defaultdict(set)
        self.refused_since_poll: set[str] = set()  # workers whose own admission refused since the last poll
        self.last_poll_s = -math.inf
        self.queue: collections.deque[_SimRequest] = collections.deque()

    def poll(self) -> None:
        for worker_id, sim in self.run.workers.items():
            self.index.apply(sim.scheduler.kv.events_since(self.index.next_seq(worker_id)))
            self.stats[worker_id] = worker_stats(sim.scheduler, worker_id)
        self.sent_since_poll.clear()
        self.load_since_poll.clear()
        self.released_since_poll.clear()
        self.let_go_since_poll.clear()
        self.refused_since_poll.clear()
        self.last_poll_s = self.run.clock.now
        self.pump()

    def release(self, done: _SimRequest, worker_id: str) -> None:
        """As admission releases the ticket: from the pending ones, or credited against the
        report that counts it (the simulated polls are exact: sent before = counted) with what
        the worker frees, as router_core reckons it."""
        if done.sent_at < self.last_poll_s:
            self.let_go_since_poll[worker_id].update(done.hashes)
            self.released_since_poll[worker_id] += done.cost_tokens if done.in_flight_token is None else \
                cost_with_cached_prefix(len(done.prompt), done.request.sampling, self.run.cluster.block_size,
                                        self.index.shared_with_live_requests(done.in_flight_token))
        else:
            self.sent_since_poll[worker_id] -= done.cost_tokens
            self.load_since_poll[worker_id] -= done.load_tokens
        if done.in_flight_token is not None:
            self.index.end_in_flight(done.in_flight_token)

    def _held_blocks(self, worker_id: str, hashes) -> int:
        """As admission: held by a request of this replica in flight there, or per the last
        poll and not of a request credited since (router/admission_budget.py)."""
        reported, let_go = self.stats[worker_id].held_block_hashes, self.let_go_since_poll.get(worker_id, ())
        held = 0
        for block_hash in hashes:
            if block_hash not in reported or block_hash in let_go:
                break
            held += 1
        return max(held, self.index.held_by_live_requests(worker_id, hashes))

    def _claimed(self, route_request: RouteRequest, matched: dict[str, int]) -> RouteRequest:
        """As Admitter._claimed: this replica proposes its own rule's pick from every worker;
        the family's first proposal stands."""
        candidates = list(self.stats.values())
        pick = claim_proposal(self.latency_state.live.latest_worker(route_request.family_key), candidates,
                              lambda: choose_worker(matched, candidates, self.proposal_config, self.rng, self.cursor,
                                                    dict(self.load_since_poll), self.sizes.mean_tokens(),
                                                    request=dataclasses.replace(route_request, proposing_claim=True),
                                                    state=self.latency_state).worker_id)
        owner = self.run.claims.claim(route_request.family_key, claim_candidates(pick, candidates, route_request))
        return dataclasses.replace(route_request, claimed_worker=owner)

    def try_dispatch(self, sim_request: _SimRequest) -> bool | None:
        """True: dispatched; False: no worker has room (it queues); None: it holds out for room
        on its prefix's worker (router/affinity_wait.py; it keeps its place in the queue)."""
        run, router, cluster, clock = self.run, self.run.router, self.run.cluster, self.run.clock
        prompt_len = len(sim_request.prompt)
        sampling = SamplingParams(max_tokens=run.workload.max_tokens, ignore_eos=True)
        # As router_core: only the prefix policies hash prompts; the cost counts the matched
        # prefix (resident or claimed by a request in flight on that worker) as cached.
        matched = self.index.longest_prefix(sim_request.hashes, include_in_flight=run.in_flight_claims) \
            if run.policy in PREFIX_POLICIES else {}
        eligible = []
        for worker_id, s in self.stats.items():
            cached = matched.get(worker_id, 0)
            cost = cost_on_worker(prompt_len, sampling, cluster.block_size, cached,
                                  self._held_blocks(worker_id, sim_request.hashes[:cached]) if cached else 0)
            committed = max(0, s.kv_tokens_reserved - self.released_since_poll[worker_id]) \
                + self.sent_since_poll[worker_id]
            if worker_id not in self.refused_since_poll and committed + cost <= s.kv_tokens_capacity:
                eligible.append((s, cost))
        if not eligible:
            return False
        if sim_request.affinity_hold is None:  # as router_core: one per admission, from its first try
            route_request = RouteRequest(prompt_len, cluster.block_size,
                                         family_key(sim_request.hashes, router.spread_family_blocks))
            if run.claims is not None and route_request.family_key is not None and not any(matched.values()):
                route_request = self._claimed(route_request, matched)
            sim_request.route_request = route_request
            sim_request.affinity_hold = AffinityHold(matched, router, clock=clock, request=route_request,
                                                     state=self.latency_state, refused_by=sim_request.refused_by,
                                                     awaiting_report=self.refused_since_poll.__contains__)
        route_request = sim_request.route_request
        if sim_request.affinity_hold.holds(
                [s for s, _ in eligible],
                lambda: (list(self.stats.values()), dict(self.load_since_poll), self.sizes.mean_tokens()), self.rng):
            return None
        costs = {s.worker_id: cost for s, cost in eligible}
        decision = choose_worker(matched, [s for s, _ in eligible], router, self.rng, self.cursor,
                                 dict(self.load_since_poll), self.sizes.mean_tokens(), request=route_request,
                                 state=self.latency_state)
        spilled = is_spill(matched, [s for s, _ in eligible], decision.worker_id)
        if spilled:
            run.spills["preferred_full"] += 1
        waited = sim_request.affinity_hold.outcome(decision.worker_id)
        if waited is not None:
            run.spills["affinity_waits"] += 1
            run.spills["affinity_timeouts"] += waited is AffinityWaitOutcome.TIMED_OUT
        run.paths[decision.path.value] += 1
        grown = decision.spread.cause if decision.spread is not None and decision.spread.grown else ""
        sim_request.path = (decision.path.value + (f":{grown}" if grown else "") + ("+spill" if spilled else "")
                            + ("+refused" if sim_request.refusals else ""))
        worker_id = decision.worker_id
        request = Request(f"r{sim_request.index}", sim_request.prompt, sampling, arrival_time=clock.now,
                          extra_keys=EXTRA_KEYS)
        try:
            run.workers[worker_id].scheduler.add_request(request)
        except OverloadedError:
            run.spills["worker_refused"] += 1
            # As router_core: the refuser is left out until its next report (admission.note_refusal)
            # and the request is admitted afresh (a fresh hold; it may wait for the refuser).
            self.refused_since_poll.add(worker_id)
            sim_request.affinity_hold = None
            sim_request.refusals += 1
            sim_request.refused_by = worker_id
            return self.try_dispatch(sim_request)
        load = cost_with_cached_prefix(prompt_len, sampling, cluster.block_size, matched.get(worker_id, 0))
        self.sent_since_poll[worker_id] += costs[worker_id]
        self.load_since_poll[worker_id] += load
        sim_request.sent_at, sim_request.cost_tokens, sim_request.load_tokens = clock.now, costs[worker_id], load
        self.sizes.observe(load)  # as admission: the margin's unit is what each dispatch adds to its worker's load
        # As router_core: the state learns what was sent where.
        self.latency_state.commit(decision, load, prompt_len // cluster.block_size)
        if run.claims is not None and route_request.family_key is not None:
            run.claims.keep_alive(route_request.family_key)
        if grown:
            run.growths[grown] += 1
        if run.policy == "predicted_latency":
            sim_request.predicted_ttft_s = decision.predicted_ttft_s
        sim_request.worker_id, sim_request.request, sim_request.router = worker_id, request, self
        run.by_id[request.request_id] = sim_request
        if run.in_flight_claims and run.policy in PREFIX_POLICIES and sim_request.hashes:
            sim_request.in_flight_token = self.index.add_in_flight(worker_id, sim_request.hashes)
        run.workers[worker_id].families.add(sim_request.family)
        run.kick(worker_id)
        return True

    def pump(self) -> None:
        """In order, as the router's queue: a request holding out is stepped over, the first that
        fits nowhere stops it."""
        index = 0
        while index < len(self.queue):
            outcome = self.try_dispatch(self.queue[index])
            if outcome is False:
                break
            if outcome is None:
                index += 1
                continue
            del self.queue[index]

    def arrive(self, sim_request: _SimRequest) -> None:
        sim_request.arrival_s = self.run.clock.now
        self.queue.append(sim_request)
        self.pump()


def simulate(policy: str, cluster: SimCluster, workload: SimWorkload, router: RouterConfig | None = None,
             in_flight_claims: bool = True, trace: list | None = None, num_routers: int = 1,
             claims_ttl_s: float | None = None) -> SimResult:
    """One run. `in_flight_claims=False` routes on the workers' events alone (the behaviour
    before dispatched prefixes were counted), for comparison. `trace`: a list that gets one
    dict per request (family, worker, path, times, cached vs oracle tokens) to study a run.

    `num_routers` > 1: that many router replicas, each its own index, admission view, policy
    state and queue (router.num_replicas set to match), polling the workers out of phase
    (replica r at r / num_routers of a refresh period), the requests dealt to them in turn as
    clients' connections are spread; `claims_ttl_s`: with the replicas' shared new-family
    claims (router/family_claims.py), expiring after that; None: without (Redis down)."""
    started_wall = time.perf_counter()
    router = dataclasses.replace(router or RouterConfig(), policy=policy, stats_refresh_s=cluster.stats_refresh_s)
    if num_routers > 1:
        router = dataclasses.replace(router, num_replicas=num_routers)
    clock = SimClock()
    # The router predicts with the step-cost model the engines run (as a real router is given
    # the model measured on its engines): its error is then the formula's, not the constants'.
    router = dataclasses.replace(router, step_overhead_s=cluster.cost.step_overhead_s,
                                 prefill_s_per_token=cluster.cost.prefill_s_per_token,
                                 decode_s_per_token=cluster.cost.decode_s_per_token)
    workers = {f"worker-{i}": _SimWorker(f"worker-{i}", cluster, clock) for i in range(cluster.num_workers)}
    claims = SimClaims(claims_ttl_s, clock) if claims_ttl_s is not None and num_routers > 1 else None
    run = _SimRun(policy, cluster, workload, router, clock, workers, in_flight_claims, claims)
    routers = [_SimRouter(run, r) for r in range(num_routers)]
    requests = make_requests(workload, cluster.block_size)
    for sim_request, oracle in zip(requests, _oracle_cached_tokens(requests, cluster.block_size)):
        sim_request.oracle_cached_tokens = oracle
    dealt = itertools.cycle(routers)  # each request to the next replica, as connections spread

    pending = collections.deque(requests)
    warm_up_left = workload.warm_up if workload.qps is None else 0
    if warm_up_left:
        run.push(0.0, "arrive", pending.popleft())
    elif workload.qps is None:
        for _ in range(min(workload.concurrency, len(pending))):
            run.push(0.0, "arrive", pending.popleft())
    else:
        arrival_rng, at = random.Random(workload.seed + 2), 0.0
        while pending:
            at += arrival_rng.expovariate(workload.qps)
            run.push(at, "arrive", pending.popleft())
    for r in routers:
        run.push(r.number * cluster.stats_refresh_s / num_routers, "poll", r)
    while run.events and len(run.finished) < len(requests):
        at, _, kind, payload = heapq.heappop(run.events)
        clock.now = at
        if kind == "arrive":
            next(dealt).arrive(payload)
        elif kind == "poll":
            payload.poll()
            run.push(at + cluster.stats_refresh_s, "poll", payload)
        elif kind == "step_done":
            sim = workers[payload]
            for request in sim.finish_step():
                first = run.by_id[request.request_id]
                first.first_token_s = clock.now
                if first.predicted_ttft_s is not None:  # at the worker, as the engine's timings count it
                    first.router.latency_state.calibration.observe(first.predicted_ttft_s, clock.now - first.sent_at)
            for request_id in sim.finished_ids:
                done = run.by_id.pop(request_id)
                done.router.release(done, payload)
                run.finished.append(done)
                if warm_up_left:
                    warm_up_left -= 1
                    settled = clock.now + 2 * cluster.stats_refresh_s
                    for _ in range(min(1 if warm_up_left else workload.concurrency, len(pending))):
                        run.push(settled, "arrive", pending.popleft())
                elif workload.qps is None and pending:
                    run.push(clock.now, "arrive", pending.popleft())
            run.kick(payload)
            for r in routers:
                r.pump()
    result = _result(policy, cluster, workload, workers, run.finished, run.spills, clock.now,
                     time.perf_counter() - started_wall, run.paths)
    states = [r.latency_state for r in routers]
    result.ttft_prediction_error = statistics.mean(s.calibration.mean_abs_relative_error() for s in states)
    result.ttft_prediction_factor = statistics.mean(s.calibration.factor for s in states)
    result.spread_families_at_end = sum(s.spread.num_spread() for s in states)
    result.spread_growths = dict(run.growths)
    result.num_routers = num_routers
    if trace is not None:
        trace.extend(dict(index=r.index, family=r.family, worker=r.worker_id, path=r.path, arrival_s=r.arrival_s,
                          sent_s=r.sent_at, first_token_s=r.first_token_s, prompt_tokens=len(r.prompt),
                          cached_tokens=r.request.num_cached_tokens, oracle_cached_tokens=r.oracle_cached_tokens,
                          cost_tokens=r.cost_tokens, predicted_ttft_s=r.predicted_ttft_s, router=r.router.number)
                     for r in sorted(run.finished, key=lambda r: r.index))
    return result


def _result(policy, cluster, workload, workers, finished, spills, sim_s, wall_s, paths) -> SimResult:
    ttfts = sorted(r.first_token_s - r.arrival_s for r in finished if r.first_token_s is not None)
    prompt = sum(r.request.num_prompt_tokens for r in finished)
    cached = sum(r.request.num_cached_tokens for r in finished)
    computed = {w: sim.computed_tokens for w, sim in workers.items()}
    family_workers = collections.defaultdict(set)
    missed = collections.Counter()
    for r in finished:
        if r.oracle_cached_tokens > r.request.num_cached_tokens:
            missed[r.path] += r.oracle_cached_tokens - r.request.num_cached_tokens
        family_workers[r.family].add(r.worker_id)
    load = f"{workload.qps:g} qps" if workload.qps is not None else f"{workload.concurrency} in flight"
    return SimResult(
        policy=policy, num_workers=cluster.num_workers, load=load, num_requests=len(finished),
        hit_rate=cached / max(1, prompt),
        ttft_p50_ms=1000 * statistics.median(ttfts) if ttfts else math.nan,
        ttft_p90_ms=1000 * ttfts[min(len(ttfts) - 1, int(0.9 * len(ttfts)))] if ttfts else math.nan,
        computed_max_over_min=max(computed.values()) / max(1, min(computed.values())),
        computed_tokens_per_worker=computed, spills_router=spills["preferred_full"],
        spills_worker_refused=spills["worker_refused"],
        families_on_more_than_one=sum(len(ws) > 1 for ws in family_workers.values()),
        max_workers_per_family=max((len(ws) for ws in family_workers.values()), default=0),
        mean_families_per_worker=statistics.mean(len(sim.families) for sim in workers.values()),
        sim_duration_s=sim_s, wall_s=wall_s,
        oracle_hit_rate=oracle_hit_rate([r.prompt for r in sorted(finished, key=lambda r: r.arrival_s)],
                                        cluster.block_size),
        routing_paths=dict(paths), affinity_waits=spills["affinity_waits"], missed_vs_oracle_by_path=dict(missed),
        affinity_timeouts=spills["affinity_timeouts"])


def measure_cost_model(model: dict | None = None, prefill_tokens: int = 512, decode_batch: int = 8,
                       repeats: int = 3) -> CostModel:
    """Time the real engine (the embedded SmolLM2 unless `model` says otherwise, one torch
    thread as a worker with under one CPU runs) and fit the cost model: a prefill step of
    `prefill_tokens` and one of 16 give the per-token prefill cost and the overhead; decode
    steps of 1 and `decode_batch` sequences give the per-sequence decode cost."""
    import torch

    from kvmesh.core.config import KvmeshConfig
    from kvmesh.core.seams import GenerateRequest
    from kvmesh.worker.engine_api import Engine

    torch.set_num_threads(1)
    engine = Engine.from_config(KvmeshConfig.from_dict({"model": model or {}, "parallel": {"device": "cpu"},
                                                        "cache": {"enable_prefix_caching": False}}))
    torch.set_num_threads(1)
    rng = random.Random(0)
    ids = itertools.count()

    def timed_steps(prompt_len: int, batch: int, max_tokens: int) -> list[float]:
        for _ in range(batch):
            engine.add_request(GenerateRequest(f"m{next(ids)}", prompt_token_ids=tuple(
                rng.randrange(1000, 40000) for _ in range(prompt_len)),
                sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)))
        times = []
        while engine.has_unfinished():
            started = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - started)
        return times

    timed_steps(64, 1, 2)  # warm-up
    long = statistics.median(timed_steps(prefill_tokens, 1, 1)[0] for _ in range(repeats))
    short = statistics.median(timed_steps(16, 1, 1)[0] for _ in range(repeats))
    one = statistics.median(t for _ in range(repeats) for t in timed_steps(16, 1, 9)[1:])
    many = statistics.median(t for _ in range(repeats) for t in timed_steps(16, decode_batch, 9)[1:])
    prefill_per_token = max(0.0, (long - short) / (prefill_tokens - 16))
    decode_per_seq = max(0.0, (many - one) / (decode_batch - 1))
    overhead = max(0.0, min(short - 16 * prefill_per_token, one - decode_per_seq))
    return CostModel(overhead, prefill_per_token, decode_per_seq)


def replay_campaign(spec_path: str, cost: CostModel, router: RouterConfig,
                    concurrency: Sequence[int] | None = None, num_requests: int | None = None,
                    num_routers: int = 1, claims_ttl_s: float | None = None) -> list[SimResult]:
    """The routing campaign's runs, simulated with the same requests (same seeds, in the same
    order of runs) on a simulated cluster of the campaign's shape. `concurrency` and
    `num_requests` override the spec as the campaign's command-line flags do, so pass the
    ones the real run was started with."""
    import yaml

    with open(spec_path) as f:
        spec = yaml.safe_load(f)
    if num_requests:
        spec["num_requests"] = num_requests
    cluster = SimCluster(spec["num_workers"], spec["num_blocks_per_worker"], spec["block_size"], spec["max_num_seqs"],
                         SchedulerConfig.max_num_batched_tokens, spec["stats_refresh_s"], cost=cost)
    results, seed = [], 0
    for level in concurrency or spec["concurrency"]:  # as the campaign's --concurrency overrides it
        for policy in spec["policies"]:
            seed += 1  # as routing_campaign.run_campaign numbers its runs
            prompts = tuple((f, tuple(p)) for f, p in family_workload(spec, seed))
            workload = SimWorkload(num_requests=len(prompts), max_tokens=spec["max_tokens"], concurrency=level,
                                   prompts=prompts, num_families=len(spec["family_weights"]), seed=seed)
            results.append(simulate(policy, cluster, workload, router, num_routers=num_routers,
                                    claims_ttl_s=claims_ttl_s))
    return results


def markdown_table(results: Sequence[SimResult]) -> str:
    lines = ["| workers | routers | load | policy | hit rate (oracle) | TTFT P50 (ms) | TTFT P90 (ms) | computed max/min "
             "| spills (router / worker) | affinity waits (timed out) | families on >1 worker "
             "| max workers per family |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r.num_workers} | {r.num_routers} | {r.load} | {r.policy} | {r.hit_rate:.3f} ({r.oracle_hit_rate:.3f}) "
                     f"| {r.ttft_p50_ms:.0f} "
                     f"| {r.ttft_p90_ms:.0f} | {r.computed_max_over_min:.2f} | {r.spills_router} / "
                     f"{r.spills_worker_refused} | {r.affinity_waits} ({r.affinity_timeouts}) "
                     f"| {r.families_on_more_than_one} | {r.max_workers_per_family} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[2])
    parser.add_argument("--num-blocks", type=int, default=128, help="KV blocks per worker")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--stats-refresh-s", type=float, default=SimCluster.stats_refresh_s)
    parser.add_argument("--families", type=int, default=6)
    parser.add_argument("--family-weights", type=float, nargs="+", help="default: Zipf(--zipf-s)")
    parser.add_argument("--zipf-s", type=float, default=1.0)
    parser.add_argument("--prefix-tokens", type=int, default=528)
    parser.add_argument("--question-tokens", type=int, nargs=2, default=[12, 24])
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--num-requests", type=int,
                        help="default 64; with --replay-campaign the spec's (pass what the real run was given)")
    parser.add_argument("--concurrency", type=int, nargs="+", help="closed loop: requests in flight (a sweep)")
    parser.add_argument("--qps", type=float, nargs="+", help="open loop Poisson rates (a sweep)")
    parser.add_argument("--policies", nargs="+", default=["prefix_aware", "round_robin"])
    parser.add_argument("--events-only", action="store_true", help="also run prefix_aware without in-flight claims")
    parser.add_argument("--step-overhead-s", type=float, default=CostModel.step_overhead_s)
    parser.add_argument("--prefill-s-per-token", type=float, default=CostModel.prefill_s_per_token)
    parser.add_argument("--decode-s-per-token", type=float, default=CostModel.decode_s_per_token)
    parser.add_argument("--imbalance-abs-tokens", type=int, default=RouterConfig.imbalance_abs_tokens)
    parser.add_argument("--imbalance-margin-requests", type=float, default=RouterConfig.imbalance_margin_requests,
                        help="the margin is at least this many mean requests (0: abs tokens only)")
    parser.add_argument("--affinity-wait-s", type=float, default=RouterConfig.affinity_wait_s,
                        help="router.affinity_wait_s (0: spill at once)")
    parser.add_argument("--measure", action="store_true",
                        help="measure the cost model on the real engine (embedded SmolLM2) first and use it")
    parser.add_argument("--router-replicas-rule", type=int, default=1,
                        help="router.num_replicas of the one simulated router: > 1 runs the rules the "
                             "replicas of a several-replica router use (new-family placement), not a second router")
    parser.add_argument("--routers", type=int, default=1,
                        help="router replicas, each its own index, admission view, policy state and queue, "
                             "polling out of phase (router.num_replicas follows)")
    parser.add_argument("--claims-ttl-s", type=float, default=RouterConfig.family_claim_ttl_s,
                        help="with --routers > 1: the replicas' shared new-family claims, this expiry")
    parser.add_argument("--no-claims", action="store_true", help="with --routers > 1: no shared claims (Redis down)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--replay-campaign", metavar="SPEC",
                        help="replay a routing campaign's requests (load_tests/campaigns/routing-under-load.yaml): "
                             "its families, prompts, seeds and order, one run per (concurrency, policy) as it ran")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    cost = CostModel(args.step_overhead_s, args.prefill_s_per_token, args.decode_s_per_token)
    if args.measure:
        cost = measure_cost_model()
        print(f"measured cost model: {cost}", flush=True)
    loads = [dict(qps=q) for q in args.qps] if args.qps else [dict(concurrency=c) for c in (args.concurrency or [4])]
    router = RouterConfig(imbalance_abs_tokens=args.imbalance_abs_tokens,
                          imbalance_margin_requests=args.imbalance_margin_requests,
                          affinity_wait_s=args.affinity_wait_s, num_replicas=args.router_replicas_rule)
    claims_ttl_s = None if args.no_claims else args.claims_ttl_s
    results = replay_campaign(args.replay_campaign, cost, router, args.concurrency, args.num_requests,
                              args.routers, claims_ttl_s) if args.replay_campaign else []
    for num_workers in ([] if args.replay_campaign else args.workers):
        cluster = SimCluster(num_workers, args.num_blocks, args.block_size, args.max_num_seqs,
                             args.max_num_batched_tokens, args.stats_refresh_s, cost=cost)
        for load in loads:
            workload = SimWorkload(num_families=args.families, zipf_s=args.zipf_s,
                                   family_weights=tuple(args.family_weights) if args.family_weights else None,
                                   prefix_tokens=args.prefix_tokens, question_tokens=tuple(args.question_tokens),
                                   max_tokens=args.max_tokens, num_requests=args.num_requests or 64, seed=args.seed,
                                   **load)
            for policy in args.policies:
                results.append(simulate(policy, cluster, workload, router, num_routers=args.routers,
                                        claims_ttl_s=claims_ttl_s))
                print(json.dumps(dataclasses.asdict(results[-1])), flush=True)
            if args.events_only:
                result = simulate("prefix_aware", cluster, workload, router, in_flight_claims=False)
                result.policy = "prefix_aware (events only)"
                results.append(result)
                print(json.dumps(dataclasses.asdict(result)), flush=True)
    print(markdown_table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([dataclasses.asdict(r) for r in results], f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
