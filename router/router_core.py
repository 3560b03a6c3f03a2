"""The transport-agnostic request path of one router replica.

    gRPC servicer / OpenAI HTTP  ──InboundRequest──>  RouterCore.start()
        authenticate (API key -> Tenant)           router/auth.py
        validate sampling, tokenize, check length
        quota reserve                              router/quota.py
        admission (KV token budget, queue, lanes)  router/admission.py
          -> route (prefix index + worker stats)   router/routing.py (among workers with room)
    <──RequestStream── (request_id, worker_id)
        async for delta in stream:                 worker actor's Ray stream, deadline enforced
        settle quota, release admission, metrics  on every exit path, exactly once

Both ingresses call this one object, so auth, quotas, routing and error semantics cannot
drift apart between gRPC and HTTP. Errors are raised as `kvmesh.core.errors` types; the
edges map them with router/status_map.py.

Request ids: the client's id (or a generated one) is scoped by tenant on the worker
(`<tenant>/<id>`), so one tenant can never cancel another's request by guessing its id.
Cancel is broadcast to every worker, because the stream may live on another router
replica; each worker answers whether it knew the id.

A worker that dies mid-stream (RayActorError) is marked failed in the pool at once and the
stream ends with WorkerFailedError (UNAVAILABLE: the client retries, and the retry is
routed elsewhere). When it dies before the request's first delta, nothing was streamed, so
the router re-routes once by itself.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from kvmesh.core.config import KvmeshConfig
from kvmesh.kv.hashing import hash_full_blocks
from kvmesh.router import tracing
from kvmesh.router.admission import AdmissionController, AdmissionTicket, request_cost_tokens
from kvmesh.router.auth import Authenticator
from kvmesh.router.fairness import TenantBacklog, engine_priority
from kvmesh.router.metrics import RouterMetrics
from kvmesh.router.quota import QuotaStore, Reservation, check_request_fits
from kvmesh.router.routing import RoundRobinCursor, RoutingDecision, choose_worker
from kvmesh.router.tenants import Tenant
from kvmesh.router.worker_pool import WorkerPool
from kvmesh.worker.public_api import render_chat
from kvmesh.core.seams import (ErrorReport, FinishReason, GenerateRequest, RequestDelta, SamplingParams, WorkerStats,
                               check_fits_context)
from kvmesh.core.errors import (
    DeadlineExceededError,
    InvalidRequestError,
    OverloadedError,
    QuotaExceededError,
    UnauthenticatedError,
    WorkerFailedError,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class InboundRequest:
    """A request as an ingress decoded it; exactly one of prompt / messages / token ids."""

    api_key: str | None
    request_id: str = ""  # "" = the router assigns one
    prompt: str | None = None
    messages: tuple[dict, ...] | None = None  # chat: [{"role", "content"}]
    prompt_token_ids: tuple[int, ...] | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    priority: int = 0
    model: str = ""  # "" = the served model
    deadline_s: float | None = None  # absolute time.time()
    attempt: int = 1
    trace_context: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class ClusterView:
    """Workers as this replica sees them, plus its own in-flight count (GetStats, /health)."""

    workers: tuple[WorkerStats, ...]
    num_workers: int
    num_routable: int
    router_in_flight: int


class RouterCore:
    def __init__(self, config: KvmeshConfig, pool: WorkerPool, tokenizer, authenticator: Authenticator,
                 quota: QuotaStore, model_name: str, metrics: RouterMetrics | None = None,
                 tracer=None):
        self.config = config
        self.pool = pool
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.metrics = metrics or RouterMetrics(max_num_seqs=config.scheduler.max_num_seqs)
        self.admission = AdmissionController(config.router)
        self._auth = authenticator
        self._quota = quota
        self._tracer = tracer or tracing.get_tracer()  # the global provider: a no-op until set up
        self._rng = random.Random()
        self._cursor = RoundRobinCursor()
        self._extra_keys: dict[str | None, tuple[str, ...]] = {}  # cache salt -> block extra keys
        self.in_flight = 0
        self._backlog = TenantBacklog()  # per-tenant in-flight: the fair rank (router/fairness.py)
        pool.on_stats = self._on_worker_stats

    def _on_worker_stats(self, stats: list[WorkerStats], taken_at: float | None) -> None:
        self.admission.update_stats(stats, taken_at)
        self.metrics.update_worker_stats(stats)
        self.metrics.update_engine_snapshots(self.pool.engine_snapshots())

    # ---- admission of one request -------------------------------------------------------

    async def start(self, inbound: InboundRequest) -> "RequestStream":
        """Authenticate, validate, reserve quota, admit and route; raise a typed error or
        return the stream (nothing runs on a worker until the stream is iterated).

        Spans: kvmesh.request (ended by the stream) with auth, quota, admission and route
        children; the worker process records its own spans below kvmesh.stream, from the
        carrier in GenerateRequest.trace_context (worker/runtime/actor.py)."""
        root = self._tracer.start_span(tracing.SPAN_REQUEST, context=tracing.extract_context(inbound.trace_context),
                                       kind=tracing.SpanKind.SERVER)
        parent = tracing.trace.set_span_in_context(root)
        try:
            with self._tracer.start_as_current_span(tracing.SPAN_AUTH, context=parent):
                tenant = self._auth.authenticate(inbound.api_key)
            root.set_attributes({tracing.ATTR_TENANT: tenant.id, tracing.ATTR_ATTEMPT: inbound.attempt})
            stream = await self._start_as(tenant, inbound, root, parent)
        except BaseException as exc:
            if isinstance(exc, (UnauthenticatedError, InvalidRequestError, QuotaExceededError)):
                self.metrics.observe_rejection(_REJECTION_REASON[type(exc)])
            elif isinstance(exc, OverloadedError):
                self.metrics.observe_rejection("overload")
            root.record_exception(exc)
            root.set_status(tracing.Status(tracing.StatusCode.ERROR, type(exc).__name__))
            root.end()
            raise
        return stream

    async def _start_as(self, tenant: Tenant, inbound: InboundRequest, root, parent) -> "RequestStream":
        if inbound.attempt > 1:
            self.metrics.observe_retry()
        request = self._worker_request(inbound, tenant)
        root.set_attribute(tracing.ATTR_REQUEST_ID, request.request_id)
        sampling, num_prompt = request.sampling, len(request.prompt_token_ids)
        with self._tracer.start_as_current_span(tracing.SPAN_QUOTA, context=parent):
            check_request_fits(tenant.limits, tenant.id, num_prompt, sampling.max_tokens * sampling.n)
            reservation = await self._quota.reserve(tenant, num_prompt, sampling.max_tokens * sampling.n)
        # The tenant's class, refined by its backlog here, so a flooding tenant's queued
        # requests cannot starve another tenant's in the engine's priority queue.
        rank = self._backlog.enter(tenant.id)
        request = dataclasses.replace(request, priority=engine_priority(request.priority, rank))
        try:
            with self._tracer.start_as_current_span(tracing.SPAN_ADMISSION, context=parent):
                decision, ticket = await self._admit(request, exclude=frozenset(), parent=parent)
        except BaseException:
            self._backlog.leave(tenant.id)
            await self._quota.release(reservation)
            raise
        stream_span = self._tracer.start_span(tracing.SPAN_STREAM, context=parent)
        carrier = tracing.inject_context(tracing.trace.set_span_in_context(stream_span))
        request = dataclasses.replace(request, trace_context=carrier)
        return RequestStream(self, request, inbound.request_id or request.request_id.split("/", 1)[1],
                             decision, ticket, reservation, spans=(stream_span, root))

    def _worker_request(self, inbound: InboundRequest, tenant: Tenant) -> GenerateRequest:
        if inbound.model and inbound.model != self.model_name:
            raise InvalidRequestError(f"model {inbound.model!r} is not served here; this server serves "
                                      f"{self.model_name!r}")
        if inbound.deadline_s is not None and inbound.deadline_s <= time.time():
            raise DeadlineExceededError("the request's deadline passed before it was started")
        inbound.sampling.validate(self.config.scheduler.max_new_tokens)
        return GenerateRequest(
            request_id=scoped_request_id(tenant.id, inbound.request_id or uuid.uuid4().hex),
            prompt_token_ids=self._prompt_token_ids(inbound), sampling=inbound.sampling,
            priority=tenant.priority + inbound.priority, tenant_id=tenant.id, cache_salt=tenant.cache_salt,
            deadline_s=inbound.deadline_s, attempt=inbound.attempt, trace_context=dict(inbound.trace_context))

    async def _admit(self, request: GenerateRequest, exclude: frozenset[str],
                     parent=None) -> tuple[RoutingDecision, AdmissionTicket]:
        """Wait for KV budget on some worker; the routing policy picks among those with room."""
        matched = await self._matched_blocks(request)
        decisions: list[RoutingDecision] = []

        def route(eligible: list[WorkerStats], in_flight) -> str:
            eligible = [w for w in eligible if w.worker_id not in exclude]
            with self._tracer.start_as_current_span(tracing.SPAN_ROUTE, context=parent) as span:
                decision = choose_worker(matched, eligible, self.config.router, self._rng, self._cursor, in_flight)
                tracing.set_route_attributes(span, decision.worker_id, decision.matched_blocks,
                                             self.config.router.policy)
            decisions.append(decision)
            return decision.worker_id

        info = self.pool.any_info()
        block_size = info.block_size if info is not None else 1  # the workers' own rounding
        ticket = await self.admission.acquire(
            request_cost_tokens(len(request.prompt_token_ids), request.sampling, block_size=block_size),
            attempt=request.attempt,
            route=route, deadline_s=request.deadline_s)
        return decisions[-1], ticket

    async def _matched_blocks(self, request: GenerateRequest) -> dict[str, int]:
        info = self.pool.any_info()
        if self.config.router.policy != "prefix_aware" or info is None:
            return {}
        extra_keys = await self._block_extra_keys(request.cache_salt)
        hashes = hash_full_blocks(request.prompt_token_ids, info.block_size, extra_keys)
        return self.pool.prefix_index.longest_prefix(hashes)

    def _prompt_token_ids(self, inbound: InboundRequest) -> tuple[int, ...]:
        given = [x is not None for x in (inbound.prompt, inbound.messages, inbound.prompt_token_ids)]
        if sum(given) != 1:
            raise InvalidRequestError("send exactly one of prompt, messages (chat) or prompt_token_ids")
        if inbound.prompt_token_ids is not None:
            ids = tuple(int(t) for t in inbound.prompt_token_ids)
            vocab_size = len(self.tokenizer)
            if any(t < 0 or t >= vocab_size for t in ids):
                raise InvalidRequestError(f"prompt_token_ids must be in [0, {vocab_size})")
        else:
            text = inbound.prompt
            if inbound.messages is not None:
                text = render_chat(self.tokenizer, [dict(m) for m in inbound.messages])
            ids = tuple(self.tokenizer.encode(text, add_special_tokens=False))  # as the engine does
        if not ids:
            raise InvalidRequestError("the prompt is empty")
        if self.config.model.max_model_len is not None:
            check_fits_context(len(ids), inbound.sampling.max_tokens, self.config.model.max_model_len)
        return ids

    async def _block_extra_keys(self, cache_salt: str | None) -> tuple[str, ...]:
        """The workers' hashing keys for this salt, asked once (they are fixed per deployment)."""
        if cache_salt not in self._extra_keys:
            worker_id = next(iter(self.pool.routable_ids()), None)
            if worker_id is None:
                return ()
            self._extra_keys[cache_salt] = tuple(await self.pool.handle(worker_id).block_extra_keys.remote(cache_salt))
        return self._extra_keys[cache_salt]

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

    def cluster_view(self) -> ClusterView:
        workers = tuple(self.pool.stats_for_routing())
        return ClusterView(workers=workers, num_workers=len(self.pool.worker_ids),
                           num_routable=len(self.pool.routable_ids()), router_in_flight=self.in_flight)

    # ---- bookkeeping used by RequestStream ------------------------------------------------

    async def _settle(self, reservation: Reservation, completion_tokens: int | None) -> None:
        try:
            if completion_tokens is None:
                await self._quota.release(reservation)
            else:
                await self._quota.settle(reservation, completion_tokens)
        except Exception:  # quota bookkeeping must not turn a served request into an error
            logger.exception("settling reservation %s failed", reservation.reservation_id)


_REJECTION_REASON = {UnauthenticatedError: "unauthenticated", InvalidRequestError: "invalid",
                     QuotaExceededError: "quota"}


def scoped_request_id(tenant_id: str, request_id: str) -> str:
    return f"{tenant_id}/{request_id}"


class RequestStream:
    """One admitted request. Iterate it once for its deltas (request ids as the client sent
    them); leaving the iteration early (client gone, error) aborts the worker's request."""

    def __init__(self, core: RouterCore, request: GenerateRequest, request_id: str,
                 decision: RoutingDecision, ticket: AdmissionTicket, reservation: Reservation,
                 spans: tuple = ()):
        self._core = core
        self._spans = spans  # (kvmesh.stream, kvmesh.request): ended, in that order, at the end
        self._request = request
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
        streamed_tokens = 0
        final: RequestDelta | None = None
        try:
            for attempt in (1, 2):
                try:
                    async for delta in self._worker_deltas():
                        streamed_tokens += len(delta.token_ids)
                        if delta.finished:
                            final = delta
                        yield dataclasses.replace(delta, request_id=self.request_id)
                    return
                except WorkerFailedError:
                    if streamed_tokens or attempt == 2 or not core.pool.routable_ids():
                        raise
                    # Nothing reached the client: re-route once rather than fail it.
                    logger.warning("worker %s failed before request %s produced output; re-routing",
                                   self.worker_id, self.request_id)
                    self._ticket.release()
                    self.decision, self._ticket = await core._admit(self._request, frozenset({self.worker_id}))
        finally:
            # Everything synchronous first: a client that goes away cancels this task, and a
            # second cancel arriving during the await below must not skip the metrics or spans.
            core.in_flight -= 1
            core._backlog.leave(self._request.tenant_id)
            self._ticket.release()
            usage = final.usage if final is not None else None
            used = usage.completion_tokens if usage is not None else streamed_tokens
            reason = final.finish_reason if final else FinishReason.ERROR
            core.metrics.observe_request_end(self._request.tenant_id, final.timings if final else None, usage,
                                             reason)
            for span in self._spans:
                span.set_attribute(tracing.ATTR_FINISH_REASON, reason.value)
                if reason is FinishReason.ERROR:
                    span.set_status(tracing.Status(tracing.StatusCode.ERROR))
                span.end()
            # Failed before any token: refund everything; otherwise pay for what was made.
            # Shielded: if this task is cancelled meanwhile the settlement still completes
            # (else the tenant's slot would stay taken until its lease expires).
            await asyncio.shield(core._settle(self._reservation, used if (used or final is not None) else None))

    async def _worker_deltas(self) -> AsyncIterator[RequestDelta]:
        """The chosen worker's stream, flattened, with the deadline enforced; always leaves
        the worker with nothing running for this request."""
        import ray.exceptions

        core, worker_id, request = self._core, self.worker_id, self._request
        handle = core.pool.handle(worker_id)
        stream = handle.generate.options(num_returns="streaming").remote(request)
        finished = False
        try:
            async for ref in _with_deadline(stream, request.deadline_s):
                for delta in await _await_before(ref, request.deadline_s):
                    if delta.finish_reason is FinishReason.ERROR and delta.error_type:
                        finished = True  # the worker ended it (refused or failed); surface the typed error
                        raise ErrorReport.from_delta(delta).to_exception()
                    finished = finished or (delta.finished and delta.sample_index >= request.sampling.n - 1)
                    yield delta
            if not finished:  # the stream ended without a final delta: the engine aborted it
                yield RequestDelta(request_id=request.request_id, finished=True, finish_reason=FinishReason.ABORT)
                finished = True
        except ray.exceptions.RayActorError as exc:
            core.pool.mark_failed(worker_id, type(exc).__name__)
            raise WorkerFailedError(f"worker {worker_id} failed while serving the request; retry") from None
        except ray.exceptions.RayTaskError as exc:
            logger.error("worker %s stream raised: %s", worker_id, exc)
            raise WorkerFailedError(f"worker {worker_id} failed while serving the request; retry") from None
        finally:
            if not finished:
                _abort_on_worker(stream, handle, request.request_id)


def _abort_on_worker(stream, handle, worker_request_id: str) -> None:
    """Cancel the Ray stream (the actor's generator closes, aborting the engine request) and,
    in case the cancel races the task's start, ask the engine to abort by id as well."""
    import ray

    try:
        ray.cancel(stream)
    except Exception as exc:  # already finished or the actor is gone: nothing left to stop
        logger.debug("cancel of %s: %s", worker_request_id, exc)
    try:
        handle.abort.remote(worker_request_id)
    except Exception as exc:
        logger.debug("abort of %s: %s", worker_request_id, exc)


async def _with_deadline(stream, deadline_s: float | None):
    """Iterate a Ray ObjectRefGenerator, raising DeadlineExceededError at `deadline_s`."""
    iterator = stream.__aiter__()
    while True:
        try:
            ref = await _await_before(iterator.__anext__(), deadline_s)
        except StopAsyncIteration:
            return
        yield ref


async def _await_before(awaitable, deadline_s: float | None):
    if deadline_s is None:
        return await awaitable
    remaining = deadline_s - time.time()
    try:
        return await asyncio.wait_for(_as_coroutine(awaitable), timeout=max(0.0, remaining))
    except asyncio.TimeoutError:
        raise DeadlineExceededError("the request's deadline passed") from None


async def _as_coroutine(awaitable):
    return await awaitable
