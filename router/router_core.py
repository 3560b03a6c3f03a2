"""One router replica's request path, whichever edge a request came in by.

    gRPC servicer / OpenAI HTTP  ──InboundRequest──>  RouterCore.start()
        authenticate -> validate -> quota -> degrade -> admit/route     router/stages/
    <──RequestStream── (request_id, worker_id)                         router/stages/stream.py

Both ingresses call this one object, so auth, quotas, routing and error semantics cannot
drift apart between gRPC and HTTP. RouterCore holds what the replica shares across requests
(pool, admission, quota store, metrics, the in-flight set) and runs the stages in order on
one `RequestContext` (router/stages/__init__.py has the picture); when a stage refuses, it
gives back what the stages before it took. Errors are raised as `kvmesh.core.errors` types;
the edges map them with router/status_map.py.

Cancel is broadcast to every worker, because the stream may live on another router replica;
each worker answers whether it knew the id.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvmesh.core.config import KvmeshConfig
from kvmesh.kv.output_estimate import OutputLengthEstimator
from kvmesh.router import tracing
from kvmesh.router.admission import RouterAdmission
from kvmesh.router.auth import Authenticator
from kvmesh.router.adapters import AdapterRegistry
from kvmesh.router.convert import InboundRequest, ModelInfo
from kvmesh.router.family_claims import FamilyClaims
from kvmesh.router.fairness import TenantBacklog
from kvmesh.router.metrics import RouterMetrics
from kvmesh.router.quota import QuotaStore, Reservation
from kvmesh.router.adapter_affinity import AdapterPlacement
from kvmesh.router.routing import PredictedLatencyState
from kvmesh.router.stages.admit_route import Admitter, enter_fair_rank
from kvmesh.router.stages.authenticate import authenticate
from kvmesh.router.stages.context import RequestContext
from kvmesh.router.stages.degrade import admit_degrading
from kvmesh.router.stages.quota import reserve_quota
from kvmesh.router.stages.stream import RequestStream
from kvmesh.router.stages.validate import RequestValidator, scoped_request_id
from kvmesh.router.starting_requests import StartingRequests
from kvmesh.router.stream_pacer import StreamPacer
from kvmesh.router.worker_channels import WorkerChannels
from kvmesh.router.worker_pool import WorkerPool
from kvmesh.core.seams import WorkerStats
from kvmesh.core.errors import (
    AdapterNotFoundError,
    DeadlineExceededError,
    DeadlineUnmeetableError,
    InvalidRequestError,
    OverloadedError,
    PermissionDeniedError,
    QueueSlotTakenError,
    QuotaExceededError,
    UnauthenticatedError,
)

logger = logging.getLogger(__name__)

__all__ = ["ClusterView", "RequestStream", "RouterCore"]

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
                 tracer=None, claims: FamilyClaims | None = None,
                 on_streams_changed: Callable[[int], None] | None = None):
        """`claims`: the replicas' shared new-family claims (router/family_claims.py), with
        several replicas and a Redis; None: each replica places new families by its own rule.
        `on_streams_changed(streams)`: told each time the replica's stream count changes (the
        replica's thread priority follows it: router/thread_priority.py)."""
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
        # The predicted-latency policy's step-cost model, spread families and recent work.
        self.latency = PredictedLatencyState(config.router, config.scheduler.max_num_batched_tokens)
        pool.prefix_index.on_stored = self.latency.observe_stored  # recent work as every replica hears it
        self.adapters = AdapterRegistry(config.lora, config.tenants.tenant_refresh_s)
        self.adapter_placement = AdapterPlacement()  # which workers hold which adapters (affinity)
        self.in_flight = 0  # streams open (count_stream)
        self._on_streams_changed = on_streams_changed
        self.live_request_ids: set[str] = set()  # scoped ids of this replica's admitted requests
        self.backlog = TenantBacklog()  # per-tenant in-flight: the fair rank (router/fairness.py)
        # Workers that reserve on expected output: the router costs requests the same way,
        # with its own estimate learned per tenant from the usage of finished requests.
        s = config.scheduler
        self.output_estimate = (OutputLengthEstimator(s.expected_output_floor_tokens, s.expected_output_quantile)
                                if s.admission_reserve == "expected" else None)
        self.validator = RequestValidator(config, tokenizer, self.adapters, model_name)
        self.admitter = Admitter(config, pool, self.admission, self.metrics, self._tracer, self.latency,
                                 self.adapter_placement, self.output_estimate, claims)
        # One channel per worker for every request of this replica (router/worker_channels.py).
        self.channels = WorkerChannels(pool)
        self.starting = StartingRequests()  # refused at once when the replica stops (router/replica_drain.py)
        self.pacer = StreamPacer()  # paced streams' holds end together (router/stream_pacer.py)
        pool.on_stats = self._on_worker_stats
        # Polls answered before this point (the replica waits for a routable worker before it
        # builds its core) found no listener: start from them, not from nothing until the next
        # poll (a stats_refresh_s later), when admission would see fewer workers than the pool.
        if pool.stats_for_routing():
            self._on_worker_stats(pool.stats_for_routing(), None)

    def _on_worker_stats(self, stats: list[WorkerStats], taken_at: float | None) -> None:
        replica_id = self.channels.replica_id
        self.admission.update_stats(stats, taken_at, self.pool.dispatches_seen_by(replica_id),
                                    self.pool.replicas_sharing(replica_id))
        self.adapter_placement.update(stats)
        self.metrics.update_worker_stats(stats)
        self.metrics.update_engine_snapshots(self.pool.engine_snapshots())

    # ---- one request through the stages -------------------------------------------------

    async def start(self, inbound: InboundRequest) -> RequestStream:
        """Run the stages (router/stages/); raise a typed error or return the stream
        (nothing runs on a worker until the stream is iterated).

        Spans: kvmesh.request (ended by the stream) with auth, quota, admission and route
        children; the worker process records its own spans below kvmesh.stream, from the
        carrier in GenerateRequest.trace_context (worker/runtime/actor.py).

        A replica that stops refuses the requests still here, and every later one, with
        RouterReplicaStoppingError (router/starting_requests.py)."""
        return await self.starting.run(self._run_stages(inbound))

    async def _run_stages(self, inbound: InboundRequest) -> RequestStream:
        arrived_s = time.time()  # TTFT and e2e latency start here, not at the worker
        root = self._tracer.start_span(tracing.SPAN_REQUEST, context=tracing.extract_context(inbound.trace_context),
                                       kind=tracing.SpanKind.SERVER)
        ctx = RequestContext(inbound, arrived_s=arrived_s, root_span=root,
                             parent=tracing.trace.set_span_in_context(root))
        try:
            authenticate(ctx, self._auth, self._tracer)
            if inbound.attempt > 1:
                self.metrics.observe_retry()
            self.validator.validate(ctx, self.max_model_len(), self.block_size())
            return await self._reserve_and_admit(ctx)
        except BaseException as exc:
            if isinstance(exc, tuple(_REJECTION_REASON)):
                self.metrics.observe_rejection(_REJECTION_REASON[type(exc)])
            elif isinstance(exc, OverloadedError):
                self.metrics.observe_rejection(_overload_reason(exc))
            elif isinstance(exc, DeadlineExceededError):
                self.metrics.observe_timeout(ctx.tenant_id, "admission")
            root.record_exception(exc)
            root.set_status(tracing.Status(tracing.StatusCode.ERROR, type(exc).__name__))
            root.end()
            raise

    async def _reserve_and_admit(self, ctx: RequestContext) -> RequestStream:
        """quota -> degrade -> admit/route, each taken back if a later one refuses."""
        request_id = ctx.request.request_id
        if request_id in self.live_request_ids:
            # Refused here, before anything is reserved or sent: the running request with
            # this id is untouched (a worker also refuses a duplicate it is streaming).
            raise InvalidRequestError(f"request id {ctx.inbound.request_id!r} is already in flight")
        self.live_request_ids.add(request_id)  # until the stream ends (RequestStream)
        try:
            ctx.root_span.set_attribute(tracing.ATTR_REQUEST_ID, request_id)
            await reserve_quota(ctx, self._quota, self._tracer)
            enter_fair_rank(ctx, self.backlog)
            try:
                with self._tracer.start_as_current_span(tracing.SPAN_ADMISSION, context=ctx.parent) as span:
                    admission_started = time.time()
                    await admit_degrading(ctx, self.admitter, self.config, self.pool, self.metrics)
                    ctx.dispatched_s = time.time()
                    span.set_attribute(tracing.ATTR_ADMISSION_WAIT_S, ctx.dispatched_s - admission_started)
            except BaseException:
                self.backlog.leave(ctx.tenant.id)
                await self._quota.release(ctx.reservation)
                raise
        except BaseException:
            self.live_request_ids.discard(request_id)
            raise
        return self._open_stream(ctx)

    def _open_stream(self, ctx: RequestContext) -> RequestStream:
        stream_span = self._tracer.start_span(tracing.SPAN_STREAM, context=ctx.parent)
        carrier = tracing.inject_context(tracing.trace.set_span_in_context(stream_span))
        ctx.request = dataclasses.replace(ctx.request, trace_context=carrier)
        ctx.spans = (stream_span, ctx.root_span)
        self.metrics.observe_dispatch(ctx.arrived_s, ctx.dispatched_s)
        return RequestStream(self, ctx)

    def list_models(self, api_key: str | None) -> list[ModelInfo]:
        """The base model and the adapters the caller may use (an adapter's id is
        "<base>:<name>", its parent the base). Without a valid key: the unbound adapters."""
        try:
            tenant_id = self._auth.authenticate(api_key).id
        except UnauthenticatedError:
            tenant_id = None
        common = dict(max_model_len=self.max_model_len() or 0, block_size=self.block_size())
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

    def others_routable(self, worker_id: str, fallback: bool) -> bool:
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

    def block_size(self) -> int:
        """The workers' KV block size (the config's before any worker answered: the same
        field configures them), what request budgets are rounded to."""
        info = self.pool.any_info()
        return info.block_size if info is not None else self.config.cache.block_size

    def count_stream(self, change: int) -> None:
        """A stream opened (+1) or ended (-1)."""
        self.in_flight += change
        if self._on_streams_changed is not None:
            self._on_streams_changed(self.in_flight)

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

    # ---- bookkeeping used by RequestStream (router/stages/stream.py) -----------------------

    async def settle(self, reservation: Reservation, completion_tokens: int | None) -> None:
        try:
            if completion_tokens is None:
                await self._quota.release(reservation)
            else:
                await self._quota.settle(reservation, completion_tokens)
        except Exception:  # quota bookkeeping must not turn a served request into an error
            logger.exception("settling reservation %s failed", reservation.reservation_id)


_REJECTION_REASON = {UnauthenticatedError: "unauthenticated", InvalidRequestError: "invalid",
                     QuotaExceededError: "quota", AdapterNotFoundError: "adapter_not_found",
                     PermissionDeniedError: "permission_denied"}


def _overload_reason(exc: OverloadedError) -> str:
    if isinstance(exc, DeadlineUnmeetableError):
        return "deadline"
    return "evicted" if isinstance(exc, QueueSlotTakenError) else "overload"
