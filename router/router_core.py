"""The transport-agnostic request path of one router replica.

    gRPC servicer / OpenAI HTTP  ──InboundRequest──>  RouterCore.start()
        authenticate (API key -> Tenant)           router/auth.py
        validate sampling (a structured-output constraint must compile), tokenize, check length
        quota reserve                              router/quota.py
        admission (KV token budget, queue, lanes)  router/admission.py
          -> route (prefix index + worker stats)   router/routing.py (among workers with room)
    <──RequestStream── (request_id, worker_id)
        async for delta in stream:                 the worker's channel (worker_channels.py), deadline enforced
        settle quota, release admission, metrics  on every exit path, exactly once

Both ingresses call this one object, so auth, quotas, routing and error semantics cannot
drift apart between gRPC and HTTP. Errors are raised as `kvmesh.core.errors` types; the
edges map them with router/status_map.py.

Request ids: the client's id (or a generated one) is scoped by tenant on the worker
(`<tenant>/<id>`), so one tenant can never cancel another's request by guessing its id.
Cancel is broadcast to every worker, because the stream may live on another router
replica; each worker answers whether it knew the id.

A worker that dies mid-stream (RayActorError) is marked failed in the pool at once. When it
dies before the request's first delta, nothing was streamed, so the router re-routes once by
itself. When output had already reached the client, the router resumes the stream on a
survivor (router.max_stream_resumptions times at most): the request goes out again with the
tokens and the number of text characters streamed so far (GenerateRequest.resume_*), the
survivor recomputes or finds in its caches (pool, host tier) the prompt + those tokens and
streams only what follows, so the client sees one stream, with no token missing or twice
(greedy: the same text as without the failure). When it cannot (resumption off or spent,
n > 1, no survivor), the stream ends with WorkerFailedError (UNAVAILABLE: the client retries).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import sys
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from kvmesh.core import telemetry
from kvmesh.core.config import KvmeshConfig
from kvmesh.kv.hashing import hash_full_blocks
from kvmesh.kv.output_estimate import OutputLengthEstimator
from kvmesh.router import affinity_wait, degradation, request_rules, tracing
from kvmesh.router.admission import RouterAdmission, AdmissionTicket, cost_with_cached_prefix, request_cost_tokens
from kvmesh.router.auth import Authenticator
from kvmesh.router.adapters import AdapterRegistry
from kvmesh.router.convert import InboundRequest, ModelInfo
from kvmesh.router.fairness import TenantBacklog, engine_priority
from kvmesh.router.metrics import FINISH_TIMEOUT, RouterMetrics
from kvmesh.router.quota import QuotaStore, Reservation, check_request_fits
from kvmesh.router.adapter_affinity import AdapterPlacement
from kvmesh.router.routing import (PREFIX_POLICIES, AdapterRouting, PredictedLatencyState, RoundRobinCursor,
                                   RouteRequest, RoutingDecision, choose_worker, family_key, is_spill)
from kvmesh.router.tenants import Tenant
from kvmesh.router.worker_channels import ChannelFailure, ReplicaStopping, WorkerChannels
from kvmesh.router.worker_pool import WorkerPool
from kvmesh.worker.public_api import check_structured_output, render_chat
from kvmesh.core.seams import (AdapterRef, ErrorReport, FinishReason, GenerateRequest, RequestDelta, SamplingParams,
                               Usage, WorkerStats, check_fits_context, merge_deltas, request_usage)
from kvmesh.core.errors import (
    AdapterNotFoundError,
    DeadlineExceededError,
    DeadlineUnmeetableError,
    InvalidRequestError,
    OverloadedError,
    PermissionDeniedError,
    QueueSlotTakenError,
    QuotaExceededError,
    RouterReplicaStoppingError,
    UnauthenticatedError,
    WorkerFailedError,
)

logger = logging.getLogger(__name__)

# GetStats reads every worker's figures live; one slower than this is shown as last polled.
LIVE_STATS_TIMEOUT_S = 1.0
MAX_STREAM_PACE_S = 1.0  # a paced stream still gets a message at least this often


@dataclass(frozen=True)
class ClusterView:
    """Workers as this replica sees them, plus its own in-flight count (GetStats, /health)."""

    workers: tuple[WorkerStats, ...]
    num_workers: int
    num_routable: int
    router_in_flight: int
    ages_s: tuple[float, ...] = ()  # per worker: seconds since its figures were read (live views)


class RouterCore:
    def __init__(self, config: KvmeshConfig, pool: WorkerPool, tokenizer, authenticator: Authenticator,
                 quota: QuotaStore, model_name: str, metrics: RouterMetrics | None = None,
                 tracer=None):
        self.config = config
        self.pool = pool
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.metrics = metrics or RouterMetrics(max_num_seqs=config.scheduler.max_num_seqs)
        self.admission = RouterAdmission(config.router, kv_reserved_fraction=config.scheduler.kv_reserved_fraction,
                                             kv_reserved_below_class=config.scheduler.kv_reserved_below_class,
                                             workers_preempt_kv_reservations=(
                                                 config.scheduler.priority_preemption
                                                 and config.scheduler.priority_preempts_kv_reservations))
        self._auth = authenticator
        self._quota = quota
        self._tracer = tracer or tracing.get_tracer()  # the global provider: a no-op until set up
        self._rng = random.Random()
        self._cursor = RoundRobinCursor()
        # The predicted-latency policy's step-cost model, spread families and recent work.
        self.latency = PredictedLatencyState(config.router, config.scheduler.max_num_batched_tokens)
        self._extra_keys: dict[tuple, tuple[str, ...]] = {}  # (cache salt, adapter) -> block extra keys
        self.adapters = AdapterRegistry(config.lora, config.tenants.tenant_refresh_s)
        self.adapter_placement = AdapterPlacement()  # which workers hold which adapters (affinity)
        self.in_flight = 0
        self.live_request_ids: set[str] = set()  # scoped ids of this replica's admitted requests
        self._backlog = TenantBacklog()  # per-tenant in-flight: the fair rank (router/fairness.py)
        # Workers that reserve on expected output: the router costs requests the same way,
        # with its own estimate learned per tenant from the usage of finished requests.
        s = config.scheduler
        self.output_estimate = (OutputLengthEstimator(s.expected_output_floor_tokens, s.expected_output_quantile)
                                if s.admission_reserve == "expected" else None)
        # One channel per worker for every request of this replica (router/worker_channels.py).
        self.channels = WorkerChannels(pool)
        pool.on_stats = self._on_worker_stats
        # Polls answered before this point (the replica waits for a routable worker before it
        # builds its core) found no listener: start from them, not from nothing until the next
        # poll (a stats_refresh_s later), when admission would see fewer workers than the pool.
        if pool.stats_for_routing():
            self._on_worker_stats(pool.stats_for_routing(), None)

    def _on_worker_stats(self, stats: list[WorkerStats], taken_at: float | None) -> None:
        self.admission.update_stats(stats, taken_at)
        self.adapter_placement.update(stats)
        self.metrics.update_worker_stats(stats)
        self.metrics.update_engine_snapshots(self.pool.engine_snapshots())

    # ---- admission of one request -------------------------------------------------------

    async def start(self, inbound: InboundRequest) -> "RequestStream":
        """Authenticate, validate, reserve quota, admit and route; raise a typed error or
        return the stream (nothing runs on a worker until the stream is iterated).

        Spans: kvmesh.request (ended by the stream) with auth, quota, admission and route
        children; the worker process records its own spans below kvmesh.stream, from the
        carrier in GenerateRequest.trace_context (worker/runtime/actor.py)."""
        if self.channels.handing_off:  # stopping: the client's next connection reaches another replica
            raise RouterReplicaStoppingError("the router replica is stopping; retry on another replica")
        arrived_s = time.time()  # TTFT and e2e latency start here, not at the worker
        root = self._tracer.start_span(tracing.SPAN_REQUEST, context=tracing.extract_context(inbound.trace_context),
                                       kind=tracing.SpanKind.SERVER)
        parent = tracing.trace.set_span_in_context(root)
        tenant_id = ""
        try:
            with self._tracer.start_as_current_span(tracing.SPAN_AUTH, context=parent):
                tenant = self._auth.authenticate(inbound.api_key)
            tenant_id = tenant.id
            root.set_attributes({tracing.ATTR_TENANT: tenant.id, tracing.ATTR_ATTEMPT: inbound.attempt})
            stream = await self._start_as(tenant, inbound, root, parent, arrived_s)
        except BaseException as exc:
            if isinstance(exc, tuple(_REJECTION_REASON)):
                self.metrics.observe_rejection(_REJECTION_REASON[type(exc)])
            elif isinstance(exc, OverloadedError):
                self.metrics.observe_rejection(_overload_reason(exc))
            elif isinstance(exc, DeadlineExceededError):
                self.metrics.observe_timeout(tenant_id, "admission")
            root.record_exception(exc)
            root.set_status(tracing.Status(tracing.StatusCode.ERROR, type(exc).__name__))
            root.end()
            raise
        return stream

    async def _start_as(self, tenant: Tenant, inbound: InboundRequest, root, parent,
                        arrived_s: float) -> "RequestStream":
        if inbound.attempt > 1:
            self.metrics.observe_retry()
        request = self._worker_request(inbound, tenant)
        if request.request_id in self.live_request_ids:
            # Refused here, before anything is reserved or sent: the running request with
            # this id is untouched (a worker also refuses a duplicate it is streaming).
            raise InvalidRequestError(f"request id {inbound.request_id!r} is already in flight")
        self.live_request_ids.add(request.request_id)  # until the stream ends (RequestStream)
        try:
            return await self._reserve_and_admit(tenant, inbound, request, root, parent, arrived_s)
        except BaseException:
            self.live_request_ids.discard(request.request_id)
            raise

    async def _reserve_and_admit(self, tenant: Tenant, inbound: InboundRequest, request: GenerateRequest,
                                 root, parent, arrived_s: float) -> "RequestStream":
        root.set_attribute(tracing.ATTR_REQUEST_ID, request.request_id)
        sampling, num_prompt = request.sampling, len(request.prompt_token_ids)
        with self._tracer.start_as_current_span(tracing.SPAN_QUOTA, context=parent):
            check_request_fits(tenant.limits, tenant.id, num_prompt, sampling.max_tokens * sampling.n)
            reservation = await self._quota.reserve(tenant, num_prompt, sampling.max_tokens * sampling.n)
        # The tenant's class, refined by its backlog here, so a flooding tenant's queued
        # requests cannot starve another tenant's in the engine's priority queue.
        rank = self._backlog.enter(tenant.id)
        request = dataclasses.replace(request, priority=engine_priority(request.priority, rank),
                                      priority_class=request.priority)
        try:
            with self._tracer.start_as_current_span(tracing.SPAN_ADMISSION, context=parent) as admission_span:
                admission_started = time.time()
                decision, ticket, request, degraded = await self._admit_degrading(request, parent)
                dispatched_s = time.time()
                admission_span.set_attribute(tracing.ATTR_ADMISSION_WAIT_S, dispatched_s - admission_started)
        except BaseException:
            self._backlog.leave(tenant.id)
            await self._quota.release(reservation)
            raise
        stream_span = self._tracer.start_span(tracing.SPAN_STREAM, context=parent)
        carrier = tracing.inject_context(tracing.trace.set_span_in_context(stream_span))
        request = dataclasses.replace(request, trace_context=carrier)
        self.metrics.observe_dispatch(arrived_s, dispatched_s)
        return RequestStream(self, request, inbound.request_id or request.request_id.split("/", 1)[1],
                             decision, ticket, reservation, spans=(stream_span, root), arrived_s=arrived_s,
                             degraded=degraded)

    def _worker_request(self, inbound: InboundRequest, tenant: Tenant) -> GenerateRequest:
        request_rules.check_request_id(inbound.request_id)
        request_rules.check_model_name(inbound.model)
        request_rules.check_model_name(inbound.adapter)
        adapter = self.adapters.resolve(inbound.model, inbound.adapter, self.model_name, tenant.id)
        if inbound.deadline_s is not None and inbound.deadline_s <= time.time():
            raise DeadlineExceededError("the request's deadline passed before it was started")
        inbound.sampling.validate(self.config.scheduler.max_new_tokens, self.config.scheduler.max_n)
        request_rules.check_stop_strings(inbound.sampling.stop)
        check_structured_output(inbound.sampling.structured)  # compiles? answered before any reservation
        return GenerateRequest(
            request_id=scoped_request_id(tenant.id, inbound.request_id or uuid.uuid4().hex),
            prompt_token_ids=self._prompt_token_ids(inbound), sampling=inbound.sampling,
            priority=tenant.priority + inbound.priority, tenant_id=tenant.id, cache_salt=tenant.cache_salt,
            deadline_s=inbound.deadline_s, attempt=inbound.attempt, trace_context=dict(inbound.trace_context),
            resume_token_ids=self._resume_token_ids(inbound), resume_text_chars=inbound.resume_text_chars,
            adapter=adapter)

    @staticmethod
    def _resume_token_ids(inbound: InboundRequest) -> tuple[int, ...]:
        """A client's resumption, checked where the router can (the engine checks the ids
        against its vocabulary): one sample, something left to generate."""
        ids = inbound.resume_token_ids
        if ids and inbound.sampling.n != 1:
            raise InvalidRequestError("only a single-sample request (n = 1) can be resumed")
        if ids and len(ids) >= inbound.sampling.max_tokens:
            raise InvalidRequestError(f"{len(ids)} resume_token_ids leave nothing of max_tokens "
                                      f"({inbound.sampling.max_tokens})")
        if inbound.resume_text_chars and not ids:
            raise InvalidRequestError("resume_text_chars without resume_token_ids")
        return ids

    async def _admit_degrading(self, request: GenerateRequest,
                               parent) -> tuple[RoutingDecision, AdmissionTicket, GenerateRequest, str | None]:
        """Admission with the degradation ladder of the request's class (router/degradation.py):
        the decision, the ticket, the request as admitted (capped or not, with its transfer
        hint) and the step taken (None: admitted as sent). Raises the main pool's
        OverloadedError when every step fails."""
        rule = degradation.rule_for(self.config, request.priority_class)
        if rule is None:
            return *await self._admit(request, exclude=frozenset(), parent=parent), None
        place = self.admission.now()  # every step keeps the request's place in the queue
        try:
            return *await self._admit(request, exclude=frozenset(), parent=parent,
                                      max_wait_s=rule.queue_wait_s, queued_since=place), None
        except OverloadedError as exc:
            refused = exc
        steps: list[tuple[str, GenerateRequest, bool]] = []
        if rule.cap_max_tokens is not None and request.sampling.max_tokens > rule.cap_max_tokens:
            capped = dataclasses.replace(request, sampling=dataclasses.replace(
                request.sampling, max_tokens=rule.cap_max_tokens))
            steps.append((degradation.STEP_CAP, capped, False))
        if rule.fallback and self.pool.fallback_ids:
            steps.append((degradation.STEP_FALLBACK, request, True))
        for step, degraded_request, on_fallback in steps:
            try:
                decision, ticket, admitted = await self._admit(degraded_request, exclude=frozenset(), parent=parent,
                                                               max_wait_s=0.0, fallback=on_fallback,
                                                               queued_since=place)
            except (OverloadedError, WorkerFailedError):
                continue
            self.metrics.observe_degraded(step)
            return decision, ticket, admitted, step
        self.metrics.observe_degraded(degradation.STEP_REJECT)
        raise refused

    async def _admit(self, request: GenerateRequest, exclude: frozenset[str], parent=None,
                     max_wait_s: float | None = None, fallback: bool = False,
                     queued_since: float | None = None) -> tuple[RoutingDecision, AdmissionTicket, GenerateRequest]:
        """Wait for KV budget on some worker of the main pool (of the fallback pool when
        `fallback`); the routing policy picks among those with room. The third value is the
        request with the chosen worker's transfer hint set (`kv_source`, see transfer_source)."""
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
        info = self.pool.any_info()
        block_size = info.block_size if info is not None else 1  # the workers' own rounding
        num_prompt, sampling = len(request.prompt_token_ids), request.sampling
        output = None if self.output_estimate is None else self.output_estimate.estimate(
            request.tenant_id, sampling.max_tokens)
        whole_cost = request_cost_tokens(num_prompt, sampling, block_size=block_size, output_tokens=output)

        route_request = RouteRequest(num_prompt, block_size, family_key(hashes, self.config.router.spread_family_blocks))
        affinity = affinity_wait.AffinityHold(matched, self.config.router, exclude, deadline_s=request.deadline_s,
                                              request=route_request, state=self.latency)

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
            if is_spill(matched, eligible, decision.worker_id):
                self.metrics.observe_spill("preferred_full")
            waited = affinity.outcome(decision.worker_id)
            if waited is not None:
                self.metrics.observe_affinity_wait(waited.value, time.monotonic() - affinity.started_at)
            self.metrics.observe_route(decision.path.value)
            # Every policy's recent work is kept: prefix_aware breaks new-prefix ties by it.
            self.latency.commit(decision, cost_for(decision.worker_id))
            decisions.append(decision)
            return decision.worker_id

        priority_class = request.priority if request.priority_class is None else request.priority_class

        def cost_for(worker_id: str) -> int:
            return cost_with_cached_prefix(num_prompt, sampling, block_size, matched.get(worker_id, 0), output)

        ticket = await self.admission.acquire(
            whole_cost, attempt=request.attempt,
            route=route, deadline_s=request.deadline_s, exclude=exclude, priority_class=priority_class,
            max_wait_s=max_wait_s, queued_since=queued_since, cost_for=cost_for, hold=hold)
        if hashes:  # the family's next request follows this one before the worker reports it
            token = index.add_in_flight(ticket.worker_id, hashes)
            # Its worker frees its blocks less those other requests running there still hold.
            ticket.freed_on_release = lambda: cost_with_cached_prefix(
                num_prompt, sampling, block_size, index.shared_with_live_requests(token), output)
            ticket.on_release(lambda: index.end_in_flight(token))
        holder = transfer_source(resident, ticket.worker_id, set(self.pool.routable_ids()) - exclude)
        info = self.pool.info(holder) if holder is not None else None
        kv_source = (info.actor_name or None) if info is not None else None
        return decisions[-1], ticket, dataclasses.replace(request, kv_source=kv_source)

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

    def _prompt_token_ids(self, inbound: InboundRequest) -> tuple[int, ...]:
        given = [x is not None for x in (inbound.prompt, inbound.messages, inbound.prompt_token_ids)]
        if sum(given) != 1:
            raise InvalidRequestError("send exactly one of prompt, messages (chat) or prompt_token_ids")
        if inbound.prompt_token_ids is not None:
            ids = tuple(inbound.prompt_token_ids)
            request_rules.check_prompt_token_ids(ids, len(self.tokenizer))
        else:
            text = inbound.prompt
            if inbound.messages is not None:
                for message in inbound.messages:
                    request_rules.check_text(message.content, "message content")
                text = render_chat(self.tokenizer, [m.to_dict() for m in inbound.messages])
            request_rules.check_text(text, "prompt")
            ids = tuple(self.tokenizer.encode(text, add_special_tokens=False))  # as the engine does
        if not ids:
            raise InvalidRequestError("the prompt is empty")
        max_model_len = self.max_model_len()
        if max_model_len is not None:
            check_fits_context(len(ids), inbound.sampling.max_tokens, max_model_len)
        return ids

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

    def list_models(self, api_key: str | None) -> list[ModelInfo]:
        """The base model and the adapters the caller may use (an adapter's id is
        "<base>:<name>", its parent the base). Without a valid key: the unbound adapters."""
        try:
            tenant_id = self._auth.authenticate(api_key).id
        except UnauthenticatedError:
            tenant_id = None
        info = self.pool.any_info()
        common = dict(max_model_len=self.max_model_len() or 0,
                      block_size=info.block_size if info else self.config.cache.block_size)
        base = ModelInfo(id=self.model_name, **common)
        adapters = [a for a in self.adapters.visible_to(tenant_id or "") if tenant_id or a.tenant is None]
        return [base] + [ModelInfo(id=f"{self.model_name}:{a.name}", parent=self.model_name, **common)
                         for a in adapters]

    # ---- cancel and views ---------------------------------------------------------------

    async def cancel(self, request_id: str, api_key: str | None) -> bool:
        """Abort the caller's request wherever it runs; True when some worker knew it."""
        tenant = self._auth.authenticate(api_key)
        if not request_id:
            raise InvalidRequestError("request_id is required")
        scoped = scoped_request_id(tenant.id, request_id)
        refs = [self.pool.handle(w).abort.remote(scoped) for w in self.pool.routable_ids()]
        results = await asyncio.gather(*refs, return_exceptions=True)
        return any(r is True for r in results)

    def _others_routable(self, worker_id: str, fallback: bool) -> bool:
        """Another routable worker of the same pool: where a re-route could go (with none, it
        would only queue for the worker that just refused or failed)."""
        pool = self.pool.fallback_ids if fallback else frozenset(self.pool.worker_ids) - self.pool.fallback_ids
        return any(w in pool and w != worker_id for w in self.pool.routable_ids())

    def max_model_len(self) -> int | None:
        """The context length requests are checked against: the workers' own (which the
        config's model.max_model_len sets when given), None before any worker answered."""
        info = self.pool.any_info()
        if info is not None and info.max_model_len:
            return info.max_model_len
        return self.config.model.max_model_len

    def stream_pace_s(self) -> float:
        """How long a stream waits after a message: its share of router.stream_messages_per_s."""
        budget = self.config.router.stream_messages_per_s
        return 0.0 if budget <= 0 else min(MAX_STREAM_PACE_S, self.in_flight / budget)

    def cluster_view(self) -> ClusterView:
        """As of the last polls (cheap: /health, metrics)."""
        workers = tuple(self.pool.stats_for_routing())
        return ClusterView(workers=workers, num_workers=len(self.pool.worker_ids),
                           num_routable=len(self.pool.routable_ids()), router_in_flight=self.in_flight)

    async def live_cluster_view(self) -> ClusterView:
        """Worker figures read from the engines now (GetStats), each with its age."""
        read = await self.pool.read_stats_now(LIVE_STATS_TIMEOUT_S)
        return ClusterView(workers=tuple(s for s, _ in read), num_workers=len(self.pool.worker_ids),
                           num_routable=len(self.pool.routable_ids()), router_in_flight=self.in_flight,
                           ages_s=tuple(age for _, age in read))

    # ---- bookkeeping used by RequestStream ------------------------------------------------

    async def _settle(self, reservation: Reservation, completion_tokens: int | None) -> None:
        try:
            if completion_tokens is None:
                await self._quota.release(reservation)
            else:
                await self._quota.settle(reservation, completion_tokens)
        except Exception:  # quota bookkeeping must not turn a served request into an error
            logger.exception("settling reservation %s failed", reservation.reservation_id)


# Re-admissions of one request after workers' own admission refused it (each refusal makes
# the router's view of that worker fresh before it is tried again, see note_refusal).
WORKER_REFUSAL_REROUTES = 2

_REJECTION_REASON = {UnauthenticatedError: "unauthenticated", InvalidRequestError: "invalid",
                     QuotaExceededError: "quota", AdapterNotFoundError: "adapter_not_found",
                     PermissionDeniedError: "permission_denied"}


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
def _overload_reason(exc: OverloadedError) -> str:
    if isinstance(exc, DeadlineUnmeetableError):
        return "deadline"
    return "evicted" if isinstance(exc, QueueSlotTakenError) else "overload"


def scoped_request_id(tenant_id: str, request_id: str) -> str:
    return f"{tenant_id}/{request_id}"


class RequestStream:
    """One admitted request. Iterate it once for its deltas (request ids as the client sent
    them); leaving the iteration early (client gone, error) aborts the worker's request."""

    def __init__(self, core: RouterCore, request: GenerateRequest, request_id: str,
                 decision: RoutingDecision, ticket: AdmissionTicket, reservation: Reservation,
                 spans: tuple = (), arrived_s: float | None = None, degraded: str | None = None):
        self._core = core
        # The ladder step this request was admitted by ("cap", "fallback"), None = as sent.
        self.degraded = degraded
        self._on_fallback = degraded == degradation.STEP_FALLBACK
        self._arrived_s = arrived_s  # time.time() at the router: the start of TTFT
        self._spans = spans  # (kvmesh.stream, kvmesh.request): ended, in that order, at the end
        self._request = request
        self.adapter = request.adapter  # the LoRA adapter it runs with (None = base model)
        self.request_id = request_id
        self.decision = decision
        self._ticket = ticket
        self._reservation = reservation
        self.prompt_tokens = len(request.prompt_token_ids)

    @property
    def worker_id(self) -> str:
        return self.decision.worker_id

    async def __aiter__(self) -> AsyncIterator[RequestDelta]:
        core = self._core
        core.in_flight += 1
        streamed_tokens = 0  # by this router, in this request
        # n = 1: the output so far (a client's resumption included), what a resumption starts from
        streamed_ids: list[int] = list(self._request.resume_token_ids)
        streamed_chars = self._request.resume_text_chars
        client_resumed_tokens = len(streamed_ids)  # received before this request: not charged again
        reroutes_left, resumptions_left = 1, core.config.router.max_stream_resumptions
        refusals_left = WORKER_REFUSAL_REROUTES
        final: RequestDelta | None = None
        sample_usages: dict[int, Usage] = {}  # n > 1: each sample's final reports its own
        try:
            while True:
                try:
                    async for delta in self._worker_deltas():
                        streamed_tokens += len(delta.token_ids)
                        streamed_ids.extend(delta.token_ids)
                        streamed_chars += len(delta.text)
                        if delta.finished:
                            final = delta
                            if delta.usage is not None:
                                sample_usages[delta.sample_index] = delta.usage
                        yield dataclasses.replace(delta, request_id=self.request_id,
                                                  degraded=self.degraded if delta.finished else None)
                    return
                except (WorkerFailedError, OverloadedError) as exc:
                    others = core._others_routable(self.worker_id, self._on_fallback)
                    refused = isinstance(exc, OverloadedError) and not streamed_tokens
                    if streamed_tokens:
                        resumable = (isinstance(exc, WorkerFailedError) and resumptions_left > 0
                                     and self._request.sampling.n == 1 and others
                                     and len(streamed_ids) < self._request.sampling.max_tokens)
                        core.metrics.observe_stream_resumption(resumable)
                        if not resumable:
                            raise
                        resumptions_left -= 1
                        logger.warning("worker %s failed after %d tokens of request %s; resuming elsewhere",
                                       self.worker_id, len(streamed_ids), self.request_id)
                        self._request = dataclasses.replace(self._request, resume_token_ids=tuple(streamed_ids),
                                                            resume_text_chars=streamed_chars)
                        if self._spans:
                            self._spans[0].add_event(telemetry.EVENT_STREAM_RESUMED, {
                                telemetry.ATTR_RESUMED_FROM_WORKER: self.worker_id,
                                telemetry.ATTR_RESUMED_TOKENS: len(streamed_ids)})
                    else:
                        # With no other routable worker of its pool a re-route would only queue
                        # for the worker that just refused or failed: the error goes back now.
                        if (refusals_left if refused else reroutes_left) == 0 or not others:
                            raise
                        # Nothing reached the client: re-route rather than fail it. A failed
                        # worker is left out. A worker whose own admission refused (the router's
                        # view of it was behind: its budget filled, or a prefix the router counted
                        # as cached there was evicted) is left out only until its next report:
                        # the request goes to another worker with room, or waits at the router
                        # for one (that worker included, once its report shows room), instead of
                        # bouncing to the client when the other worker is full too.
                        if refused:
                            refusals_left -= 1
                            core.admission.note_refusal(self.worker_id)
                            core.metrics.observe_spill("worker_refused")
                        else:
                            reroutes_left -= 1
                        logger.warning("worker %s %s before request %s produced output; re-routing", self.worker_id,
                                       "refused" if refused else "failed", self.request_id)
                    self._ticket.release()
                    self.decision, self._ticket, self._request = await core._admit(
                        self._request, frozenset() if refused else frozenset({self.worker_id}),
                        fallback=self._on_fallback)
        finally:
            # Everything synchronous first: a client that goes away cancels this task, and a
            # second cancel arriving during the await below must not skip the metrics or spans.
            failure = sys.exc_info()[1]
            core.in_flight -= 1
            core.live_request_ids.discard(self._request.request_id)
            core._backlog.leave(self._request.tenant_id)
            self._ticket.release()
            usage = request_usage(list(sample_usages.values()))
            # A sample that failed after streaming has no final usage: what reached the client counts.
            used = max((usage.completion_tokens if usage is not None else 0) - client_resumed_tokens, streamed_tokens)
            reason = final.finish_reason if final else FinishReason.ERROR
            timed_out = isinstance(failure, DeadlineExceededError)
            if timed_out:
                core.metrics.observe_timeout(self._request.tenant_id, "stream")
            core.metrics.observe_request_end(self._request.tenant_id, final.timings if final else None, usage,
                                             FINISH_TIMEOUT if timed_out else reason, self._arrived_s)
            if self.adapter is not None:
                core.metrics.observe_adapter_request(self.adapter.name, usage)
            self._record_route_truth(usage)
            self._record_ttft_truth(final.timings if final is not None else None)
            self._learn_output_length(reason, usage)
            for span in self._spans:
                span.set_attribute(tracing.ATTR_FINISH_REASON, FINISH_TIMEOUT if timed_out else reason.value)
                if reason is FinishReason.ERROR:
                    span.set_status(tracing.Status(tracing.StatusCode.ERROR))
                span.end()
            # Failed before any token: refund everything; otherwise pay for what was made.
            # Shielded: if this task is cancelled meanwhile the settlement still completes
            # (else the tenant's slot would stay taken until its lease expires).
            await asyncio.shield(core._settle(self._reservation, used if (used or final is not None) else None))

    def _learn_output_length(self, reason: FinishReason, usage) -> None:
        """A request that ended by itself teaches the expected-output estimate, as on the worker."""
        estimate = self._core.output_estimate
        if (estimate is not None and usage is not None and self._request.sampling.n == 1
                and reason in (FinishReason.STOP, FinishReason.LENGTH) and not self.degraded):
            estimate.observe(self._request.tenant_id, usage.completion_tokens)

    def _record_route_truth(self, usage) -> None:
        """Predicted vs actually hit prefix blocks: a metric, and attributes of kvmesh.stream."""
        info = self._core.pool.any_info()
        if usage is None or info is None:
            return
        predicted, hit = self.decision.matched_blocks, usage.cached_tokens // info.block_size
        self._core.metrics.observe_route_truth(predicted, hit)
        if self._spans:
            self._spans[0].set_attributes({tracing.ATTR_ROUTE_PREDICTED_BLOCKS: predicted,
                                           tracing.ATTR_PREFIX_HIT_BLOCKS: hit})

    def _record_ttft_truth(self, timings) -> None:
        """Predicted vs actual TTFT at the worker (predicted_latency): a metric, and the
        policy's calibration."""
        predicted = self.decision.predicted_ttft_s
        actual = timings.ttft_s if timings is not None else None
        if predicted is None or actual is None:
            return
        self._core.latency.calibration.observe(predicted, actual)
        self._core.metrics.observe_ttft_prediction(predicted, actual)

    async def _worker_deltas(self) -> AsyncIterator[RequestDelta]:
        """The request's deltas from its worker's channel (router/worker_channels.py), with
        the deadline enforced; always leaves the worker with nothing running for this request."""
        core, worker_id, request = self._core, self.worker_id, self._request
        channels = core.channels
        subscription = channels.subscribe(worker_id, request.request_id)
        submitted = channels.submit(worker_id, request)
        finished = False
        try:
            while True:
                for delta in _merged(await _next_batch(subscription.queue, request.deadline_s)):
                    if isinstance(delta, ReplicaStopping):  # this replica is stopping: the client resumes elsewhere
                        raise RouterReplicaStoppingError("the router replica is stopping; resume on another replica")
                    if isinstance(delta, ChannelFailure):
                        finished = delta.actor_failed  # a dead actor runs nothing: no abort to send
                        if delta.actor_failed:
                            core.pool.mark_failed(worker_id, delta.reason, delta.incarnation)
                        else:
                            logger.error("worker %s failed request %s: %s", worker_id, request.request_id, delta.reason)
                        raise WorkerFailedError(f"worker {worker_id} failed while serving the request; retry")
                    if delta.finish_reason is FinishReason.ERROR and delta.error_type:
                        finished = True  # the worker ended it (refused or failed); surface the typed error
                        raise ErrorReport.from_delta(delta).to_exception()
                    finished = finished or (delta.finished and delta.sample_index >= request.sampling.n - 1)
                    yield delta
                if finished:
                    return
                await _pace(subscription, core.stream_pace_s(), request.deadline_s)
        finally:
            channels.unsubscribe(worker_id, request.request_id)
            submitted.cancel()
            if not finished:  # client gone, deadline, error: the engine must stop and free its blocks
                _abort_on_worker(core.pool.handle(worker_id), request.request_id, channels.replica_id)


def _merged(items: list) -> list:
    """Consecutive deltas of a sample as one (what a paced wait let pile up); a ChannelFailure
    stays where it is."""
    out: list = []
    run: list[RequestDelta] = []
    for item in items:
        if isinstance(item, RequestDelta):
            run.append(item)
            continue
        out += merge_deltas(run) + [item]
        run = []
    return out + merge_deltas(run)


async def _pace(subscription, pace_s: float, deadline_s: float | None) -> None:
    """Wait a stream's share of the replica's message budget before its next message, unless
    its last delta (or a failure) is already queued; the deadline is left to _next_batch."""
    if pace_s <= 0 or subscription.ended.is_set():
        return
    if deadline_s is not None:
        pace_s = min(pace_s, max(0.0, deadline_s - time.time()))
    try:  # a timer, not wait_for's task: this runs once per message
        async with asyncio.timeout(pace_s):
            await subscription.ended.wait()
    except TimeoutError:
        pass


def _abort_on_worker(handle, worker_request_id: str, replica_id: str) -> None:
    try:  # scoped to this replica's channel: a client's resumption elsewhere may hold the id by now
        handle.abort.remote(worker_request_id, replica_id)
    except Exception as exc:  # the actor is gone: nothing left to stop
        logger.debug("abort of %s: %s", worker_request_id, exc)


async def _next_batch(queue: asyncio.Queue, deadline_s: float | None) -> list:
    """Everything on the request's queue (at least one item: deltas, or a ChannelFailure),
    DeadlineExceededError at `deadline_s`. One timer per wait, not asyncio.wait_for's task:
    this runs once per message."""
    try:
        if deadline_s is None:
            batch = [await queue.get()]
        else:
            async with asyncio.timeout(max(0.0, deadline_s - time.time())):
                batch = [await queue.get()]
    except TimeoutError:
        raise DeadlineExceededError("the request's deadline passed") from None
    while not queue.empty():
        batch.append(queue.get_nowait())
    return batch
