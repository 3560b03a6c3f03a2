"""Stage 5: admission and routing. The request waits for KV budget on some worker
(router/admission.py: `RouterAdmission.acquire`, the request costed from its budget), and the
routing policy (router/routing.py) picks among the workers with room; the affinity wait
(router/affinity_wait.py) may hold it for room on its prefix's worker. The product is the
routing decision, the admission ticket (released when the request ends) and the request with
the chosen worker's transfer hint (`kv_source`).

The stream calls `Admitter.admit` again to re-route a request no token of which reached the
client (its worker refused or failed) and to resume one on a survivor.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time

from kvmesh.core.config import KvmeshConfig
from kvmesh.core.seams import AdapterRef, GenerateRequest, WorkerStats
from kvmesh.kv.hashing import hash_full_blocks
from kvmesh.kv.kv_cost import request_kv_tokens
from kvmesh.kv.output_estimate import OutputLengthEstimator
from kvmesh.router import affinity_wait, tracing
from kvmesh.router.adapter_affinity import AdapterPlacement
from kvmesh.router.admission import RouterAdmission
from kvmesh.router.admission_budget import AdmissionTicket, cost_on_worker, cost_with_cached_prefix
from kvmesh.router.family_claims import FamilyClaims, claim_candidates, claim_proposal
from kvmesh.router.fairness import TenantBacklog, engine_priority
from kvmesh.router.metrics import RouterMetrics
from kvmesh.router.routing import (PREFIX_POLICIES, AdapterRouting, PredictedLatencyState, RoundRobinCursor,
                                   RouteRequest, RoutingDecision, choose_worker, family_key, is_spill)
from kvmesh.router.stages.context import RequestContext
from kvmesh.router.worker_pool import WorkerPool

logger = logging.getLogger(__name__)


def enter_fair_rank(ctx: RequestContext, backlog: TenantBacklog) -> None:
    """The tenant's class, refined by its backlog here, so a flooding tenant's queued requests
    cannot starve another tenant's in the engine's priority queue (router/fairness.py). The
    stream leaves the backlog when the request ends; RouterCore.start when a stage refuses."""
    rank = backlog.enter(ctx.tenant.id)
    request = ctx.request
    ctx.request = dataclasses.replace(request, priority=engine_priority(request.priority, rank),
                                      priority_class=request.priority)


class Admitter:
    """The replica's admission + routing of one request at a time (single event loop)."""

    def __init__(self, config: KvmeshConfig, pool: WorkerPool, admission: RouterAdmission, metrics: RouterMetrics,
                 tracer, latency: PredictedLatencyState, adapter_placement: AdapterPlacement,
                 output_estimate: OutputLengthEstimator | None, claims: FamilyClaims | None = None):
        self.config = config
        # Several router replicas with a shared Redis: new families go where the first replica
        # to place them did (router/family_claims.py); None: each replica's own rule.
        self.claims = claims if config.router.policy in PREFIX_POLICIES else None
        # What this replica proposes for a claim: the one-replica rule (its own recent work and
        # tickets balance its share of a burst); the claim, not the rule, makes replicas agree.
        self._proposal_config = dataclasses.replace(config.router, num_replicas=1)
        self.pool = pool
        self.admission = admission
        self.metrics = metrics
        self.latency = latency
        self.adapter_placement = adapter_placement
        self.output_estimate = output_estimate
        self._tracer = tracer
        self._rng = random.Random()
        self._cursor = RoundRobinCursor()
        self._extra_keys: dict[tuple, tuple[str, ...]] = {}  # (cache salt, adapter) -> block extra keys

    async def admit(self, request: GenerateRequest, exclude: frozenset[str], parent=None,
                    max_wait_s: float | None = None, fallback: bool = False,
                    queued_since: float | None = None,
                    refused_by: str | None = None) -> tuple[RoutingDecision, AdmissionTicket, GenerateRequest]:
        """Wait for KV budget on some worker of the main pool (of the fallback pool when
        `fallback`); the routing policy picks among those with room. The third value is the
        request with the chosen worker's transfer hint set (`kv_source`, see transfer_source).
        `refused_by`: the worker whose own admission refused this request (a re-admission):
        when it holds the prompt's prefix the request waits for its next report first
        (router/affinity_wait.py)."""
        other_pool = (frozenset(self.pool.worker_ids) - self.pool.fallback_ids) if fallback else self.pool.fallback_ids
        exclude = exclude | other_pool
        hashes = await self._prefix_hashes(request)
        index = self.pool.prefix_index
        # Routing and cost: what each worker holds or was just sent. A prefix claimed by a
        # request in flight there is charged as cached, as the worker's own admission counts a
        # prefix an admitted request will compute (else a family's followers are charged
        # whole prompts and spill: docs/routing.md, "Prefix index").
        matched = index.longest_prefix(hashes)
        resident = index.longest_prefix(hashes, include_in_flight=False)  # transfer hints: surely there
        decisions: list[RoutingDecision] = []
        budget, sampling = request.budget, request.sampling
        num_prompt, block_size = budget.prompt_tokens, budget.block_size  # the workers' own rounding
        output = None if self.output_estimate is None else self.output_estimate.estimate(
            request.tenant_id, sampling.max_tokens)
        whole_cost = budget.kv_tokens if output is None else request_kv_tokens(num_prompt, output, block_size,
                                                                               n=budget.n)

        route_request = RouteRequest(num_prompt, block_size, family_key(hashes, self.config.router.spread_family_blocks))
        if self.claims is not None and route_request.family_key is not None and not any(matched.values()):
            route_request = await self._claimed(route_request, matched, exclude)
        affinity = affinity_wait.AffinityHold(matched, self.config.router, exclude, deadline_s=request.deadline_s,
                                              request=route_request, state=self.latency, refused_by=refused_by,
                                              awaiting_report=self.admission.awaiting_report)

        def hold(eligible: list[WorkerStats]) -> bool:  # wait in the queue for room on the prefix's worker
            return affinity.holds(eligible, self.admission.cluster_load, self._rng)

        def route(eligible: list[WorkerStats], in_flight) -> str:
            with self._tracer.start_as_current_span(tracing.SPAN_ROUTE, context=parent) as span:
                # The margin's mean request in the load's unit: what admissions cost their
                # workers (a cache hit its tail), not the request's whole KV size.
                decision = choose_worker(matched, eligible, self.config.router, self._rng, self._cursor, in_flight,
                                         self.admission.mean_admitted_tokens(),
                                         index.num_blocks_known() if not matched else None,
                                         self._adapter_routing(request, eligible),
                                         request=route_request, state=self.latency)
                tracing.set_route_attributes(span, decision.worker_id, decision.matched_blocks,
                                             self.config.router.policy)
                tracing.set_route_candidates(span, decision, matched, eligible, in_flight)
            if request.adapter is not None:
                placement = self.adapter_placement
                held = request.adapter.name in placement.adapters_on(decision.worker_id)
                self.metrics.observe_adapter_routed(request.adapter.name, held)
                placement.note_routed(decision.worker_id, request.adapter.name)
            waited = affinity.outcome(decision.worker_id)
            spilled = is_spill(matched, eligible, decision.worker_id)
            if spilled:
                self.metrics.observe_spill("preferred_full")
            if spilled or waited is affinity_wait.AffinityWaitOutcome.TIMED_OUT:
                # Each may give a family a second worker (a new family's placement is no spill):
                # say how its hold went.
                logger.warning("%s to %s: prefix blocks per worker %s, claimed %s, room on %s, %s",
                               "preferred_full spill" if spilled else "timed-out hold", decision.worker_id,
                               dict(matched), route_request.claimed_worker, sorted(w.worker_id for w in eligible),
                               affinity.describe())
            if waited is not None:
                self.metrics.observe_affinity_wait(waited.value, time.monotonic() - affinity.started_at)
            self.metrics.observe_route(decision.path.value)
            # Every policy's recent work is kept: prefix_aware breaks new-prefix ties by it.
            self.latency.commit(decision, load_for(decision.worker_id), num_prompt // block_size)
            if self.claims is not None and route_request.family_key is not None:
                self.claims.keep_alive(route_request.family_key)  # the family is live: its claim stays
            decisions.append(decision)
            return decision.worker_id

        priority_class = request.priority if request.priority_class is None else request.priority_class

        def load_for(worker_id: str) -> int:  # what it computes there: its cached prefix is not work
            return cost_with_cached_prefix(num_prompt, sampling, block_size, matched.get(worker_id, 0), output)

        def cost_for(worker_id: str) -> int:
            # Cached blocks no live request holds there the request pins, and the worker adds
            # them to its committed total (router/admission_budget.py, "Cached but not held").
            cached = matched.get(worker_id, 0)
            held = 0 if not cached else max(index.held_by_live_requests(worker_id, hashes[:cached]),
                                            self.admission.held_blocks(worker_id, hashes[:cached]))
            return cost_on_worker(num_prompt, sampling, block_size, cached, held, output)

        ticket = await self.admission.acquire(
            whole_cost, attempt=request.attempt,
            route=route, deadline_s=request.deadline_s, exclude=exclude, priority_class=priority_class,
            max_wait_s=max_wait_s, queued_since=queued_since, cost_for=cost_for, hold=hold, load_for=load_for)
        if hashes:  # the family's next request follows this one before the worker reports it
            ticket.block_hashes = tuple(hashes)
            token = index.add_in_flight(ticket.worker_id, hashes)
            # Its worker frees its blocks less those other requests running there still hold.
            ticket.freed_on_release = lambda: cost_with_cached_prefix(
                num_prompt, sampling, block_size, index.shared_with_live_requests(token), output)
            ticket.on_release(lambda: index.end_in_flight(token))
        holder = transfer_source(resident, ticket.worker_id, set(self.pool.routable_ids()) - exclude)
        info = self.pool.info(holder) if holder is not None else None
        kv_source = (info.actor_name or None) if info is not None else None
        return decisions[-1], ticket, dataclasses.replace(request, kv_source=kv_source)

    async def _claimed(self, route_request: RouteRequest, matched: dict[str, int],
                       exclude: frozenset[str]) -> RouteRequest:
        """A prompt nothing matched here: the worker the replicas' shared claim gives its family
        (router/family_claims.py). This replica proposes what the one-replica rule picks from
        every healthy worker, room or not (as the affinity wait places a new family), counting
        what it sent itself; the first proposal stands. The several-replica rule (rendezvous
        within a bound) is for agreeing without a claim: from the empty views of a burst it
        placed by hash alone (5 of 6 families on one worker, simulated). Unchanged when Redis
        is away or the claimed worker is not routable here."""
        healthy, in_flight, mean_request_tokens = self.admission.cluster_load()
        candidates = [w for w in healthy if w.worker_id not in exclude]
        if not candidates:
            return route_request
        # A family this replica sent somewhere lately, its prefix since evicted (or not yet
        # reported) and its claim expired: it proposes that worker again (see claim_proposal).
        home = self.latency.live.latest_worker(route_request.family_key)
        pick = claim_proposal(home, candidates, lambda: choose_worker(
            matched, candidates, self._proposal_config, self._rng, self._cursor, in_flight, mean_request_tokens,
            request=dataclasses.replace(route_request, proposing_claim=True), state=self.latency).worker_id)
        owner = await self.claims.claim(route_request.family_key, claim_candidates(pick, candidates, route_request))
        if owner is None or owner not in {w.worker_id for w in candidates}:
            return route_request
        if home is not None and owner != home:
            logger.warning("family %s, sent to %s lately, claimed for %s", route_request.family_key.hex()[:12],
                           home, owner)
        return dataclasses.replace(route_request, claimed_worker=owner)

    def _adapter_routing(self, request: GenerateRequest, eligible: list[WorkerStats]) -> AdapterRouting | None:
        """A LoRA request's affinity inputs (router/adapter_affinity.py); a load is worth
        lora.load_cost_requests mean admitted requests of load."""
        if request.adapter is None:
            return None
        placement = self.adapter_placement
        ids = [w.worker_id for w in eligible]
        cost = int(self.config.lora.load_cost_requests * self.admission.mean_admitted_tokens())
        return AdapterRouting(frozenset(placement.holders(request.adapter.name, ids)),
                              {w: len(placement.adapters_on(w)) for w in ids}, cost)

    async def _prefix_hashes(self, request: GenerateRequest) -> list:
        """The prompt's full-block chain hashes as the workers compute them ([] when routing
        ignores prefixes)."""
        info = self.pool.any_info()
        if self.config.router.policy not in PREFIX_POLICIES or info is None:
            return []
        extra_keys = await self._block_extra_keys(request.cache_salt, request.adapter)
        # A resumed request's KV covers its streamed tokens too (GenerateRequest.resume_token_ids).
        return hash_full_blocks(request.prompt_token_ids + request.resume_token_ids, info.block_size, extra_keys)

    async def _block_extra_keys(self, cache_salt: str | None, adapter: AdapterRef | None) -> tuple[str, ...]:
        """The workers' hashing keys for this salt and adapter, asked once (they are fixed per
        deployment)."""
        key = (cache_salt, adapter)
        if key not in self._extra_keys:
            worker_id = next(iter(self.pool.routable_ids()), None)
            if worker_id is None:
                return ()
            self._extra_keys[key] = tuple(await self.pool.handle(worker_id).block_extra_keys.remote(cache_salt,
                                                                                                     adapter))
        return self._extra_keys[key]


def transfer_source(resident_blocks: dict[str, int], chosen: str, candidates: set[str]) -> str | None:
    """The transfer hint for a request routed to `chosen`: the candidate worker holding the
    most of its prompt's prefix blocks (as the workers' events reported: pool or host tier),
    when that is more than `chosen` holds. The chosen worker may then pull those blocks
    instead of recomputing them (worker/runtime/prefix_pull.py). Ties go to the lower id.

        resident {w0: 62, w1: 0}, chosen w1  -> w0      (w0 was too loaded to take it)
        resident {w0: 62, w1: 62}, chosen w1 -> None    (w1 has it all)
    """
    holders = sorted(w for w in candidates if w != chosen and resident_blocks.get(w, 0))
    if not holders:
        return None
    holder = max(holders, key=lambda w: resident_blocks[w])
    return holder if resident_blocks[holder] > resident_blocks.get(chosen, 0) else None
