"""The Ray actor that wraps one AsyncEngine: what the router sees of a worker.

One actor per GPU (later: per tensor-parallel group). The router reaches it only through
the public async methods below; everything crosses Ray as the plain dataclasses of
`core/seams.py` plus the two small records defined here.

Why these choices:

* Named, detached actors (`kvmesh-<app>-worker-<i>` in the `kvmesh` namespace) created
  with `get_if_exists=True`: every router replica finds the *same* workers, so N router
  replicas agree on who holds which prefix without any router-side global state. Detached,
  because a router replica restart must not kill the engines; `kvmesh serve` (and the test
  fixtures) kill them explicitly on shutdown (`kill_workers`).
* `max_restarts=-1`: Ray restarts a killed or crashed worker; the router learns of the
  outage from `RayActorError` and from failed stats polls, and of the new incarnation from
  `WorkerInfo.incarnation` (which resets what it knew of that worker's prefix cache).
* `max_task_retries=0`: Ray must not replay a `generate` on the restarted actor; only the
  client knows whether a retry is wanted (it gets UNAVAILABLE and retries, possibly on
  another worker).
* `generate` is an async generator, called with `num_returns="streaming"`: Ray ships each
  yielded item as it is produced. Each item is a *list* of deltas: whatever the engine
  produced while the previous item was in flight, so a slow consumer costs fewer Ray
  objects, not more latency.
* Errors cross the actor boundary as values on the one delta channel: a refusal or failure
  is the request's final delta with finish_reason ERROR and the error's type, message and
  retry-after (`ErrorReport.as_delta`), never a raised exception: Ray wraps raised exceptions
  in RayTaskError and kvmesh's errors carry constructor arguments (`retry_after_s`) that
  Ray's exception re-creation drops. An exception from a Ray stream therefore always means
  "the worker itself failed".
* Cancelling the consumer (`ray.cancel` on the stream, which cancels the actor task) and
  `abort(request_id)` both end the request in the engine and free its KV blocks.
* Telemetry lives in this process: the actor sets up its own TracerProvider from
  `config.observability` and records the kvmesh.worker.* spans as children of the router's
  span carried in `GenerateRequest.trace_context` (one trace across processes), with one
  span per prefill chunk from the engine's step reports (a StepPhaseClock observer, no
  wrapping of engine methods); the same reports feed an EngineMetrics (step phases, batch
  mix, per-tenant compute, memory probes) whose snapshot rides along in each WorkerPoll.
* Prefix KV moves between workers by actor call (`export_prefix`, pulled by the worker the
  router sends a request to with `kv_source`: worker/runtime/prefix_pull.py), never through
  the router: the router only names the holder (docs/kv-tiers.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from kvmesh.core.config import KvmeshConfig
from kvmesh.core.resources import resolve_worker_num_cpus
from kvmesh.core import errors
from kvmesh.core import telemetry
from kvmesh.core.kv_tier_metrics import KVTierCollector, KVTierFigures
from kvmesh.core.channel_frames import ChannelAddress
from kvmesh.worker.runtime.channel_server import ChannelServer
from kvmesh.worker.runtime.delta_channel import DeltaChannel
from kvmesh.core.structured_output_metrics import StructuredOutputCollector
from kvmesh.worker.parallel.placement import (actor_resource_options, engine_placement_group, engine_runtime_env,
                                              rank_bundle, remove_engine_placement_group)
from kvmesh.core.seams import (DispatchReport, ErrorReport, FinishReason, GenerateRequest, PrefixEventBatch, RequestDelta,
                               RequestTimings, WorkerStats)

logger = logging.getLogger(__name__)

WORKER_NAMESPACE = "kvmesh"
DRAIN_POLL_S = 0.05  # how often a draining worker checks whether its requests have finished
DRAIN_RETRY_AFTER_S = 0.05  # a request sent to a draining worker: re-routed about at once
# A client's retry or resumption may reach this worker while the attempt it replaces still
# streams here under the same id (its router replica stopped or died before the abort landed):
# the earlier run is aborted, and the new one waits this long for it to end before it is refused.
SUPERSEDE_WAIT_S = 5.0


@dataclass(frozen=True)
class WorkerInfo:
    """Static facts about one worker incarnation (a restart yields a new `incarnation`)."""

    worker_id: str
    incarnation: str
    model_name: str
    block_size: int
    # The Ray node (hex id) this incarnation runs on: where Ray placed it, and after a node
    # loss, where Ray restarted it.
    node_id: str = ""
    # The context length requests are validated against (model.max_model_len, else the
    # model's own positions): what ListModels reports.
    max_model_len: int = 0
    # This actor's Ray name: what another worker asks for to pull prefix KV from it
    # (GenerateRequest.kv_source); "" outside Ray.
    actor_name: str = ""


@dataclass(frozen=True)
class WorkerPoll:
    """What the router's pool refreshes every `router.stats_refresh_s`, in one call."""

    info: WorkerInfo
    stats: WorkerStats
    prefix_events: PrefixEventBatch
    metrics_snapshot: bytes = b""  # EngineMetrics.snapshot(): Prometheus text format
    # Per router replica, which of its dispatches `stats` holds (read with it); None: the
    # engine keeps no such log (the router then counts its dispatches by time).
    dispatches: dict[str, DispatchReport] | None = None


def worker_actor_name(app_name: str, index: int) -> str:
    return f"kvmesh-{app_name}-worker-{index}"


class WorkerActor:
    """Wraps one AsyncEngine. Create it with `start_workers` (named, detached, restartable)."""

    def __init__(self, config_dict: dict, worker_id: str):
        # The engine (and torch) load here, in the worker process, never in the router.
        from kvmesh.worker.runtime.async_engine import AsyncEngine
        from kvmesh.worker.runtime.prefix_pull import PrefixPuller  # torch too (via kv_transfer)

        self._config = KvmeshConfig.from_dict(config_dict)
        self._engine = AsyncEngine.from_config(self._config, worker_id=worker_id)
        self._info = WorkerInfo(worker_id=worker_id, incarnation=uuid.uuid4().hex,
                                model_name=self._engine.model_name, block_size=self._engine.block_size,
                                node_id=_current_node_id(), max_model_len=self._engine.engine.max_model_len,
                                actor_name=_current_actor_name())
        self._streaming: set[str] = set()  # request ids with a live `generate` stream or channel request
        self._channels: dict[str, DeltaChannel] = {}  # router replica id -> its connection's channel
        self._channel_server = ChannelServer(self._info.incarnation, self)
        self._draining = False  # leaving the routable set (drain): reported unhealthy, refuses new work
        self._tracer = telemetry.get_tracer(telemetry.setup_tracing(self._config.observability, "kvmesh-worker"))
        engine = self._engine.engine
        plan = engine.parts.plan
        swap_bytes = plan.num_swap_blocks * plan.block_size * plan.kv_bytes_per_token
        split = plan.device.split() | {"swap_space": swap_bytes}  # host memory, resident as blocks swap out
        self._metrics = telemetry.EngineMetrics(
            worker_id, telemetry.ModelInfoLabels.of_engine(engine, self._config), device=engine.parts.device,
            tensor_bytes=split["weights"] + split["draft_weights"] + split["kv_pool"] + split["draft_kv_pool"]
            + swap_bytes, kv_pool_bytes=plan.kv_cache_bytes, planned_bytes=split)
        self._step_log = telemetry.RequestStepLog()
        cache = self._config.cache
        self._puller = PrefixPuller(self._engine, WORKER_NAMESPACE, cache.kv_transfer_timeout_s, cache.kv_transfer,
                                    tracer=self._tracer)
        engine.phase_clock.observers.append(self._puller.observe_step_report)
        self._metrics.register(KVTierCollector(worker_id, self._kv_tier_figures))
        self._metrics.register(StructuredOutputCollector(worker_id, engine.structured.figures))
        engine.phase_clock.observers += [self._metrics.observe_step_report, self._step_log.observe_step_report]
        logger.info("worker %s up (incarnation %s, model %s, forward %s: %s)", worker_id, self._info.incarnation,
                    self._info.model_name, engine.parts.forward_path, engine.parts.forward_path_reason)

    async def info(self) -> WorkerInfo:
        return self._info

    async def generate(self, request: GenerateRequest) -> AsyncIterator[list[RequestDelta]]:
        """Stream the request's deltas in batches (the engine's one queue for this request). A
        refusal or failure ends the stream with a final error delta. Closing or cancelling this
        generator aborts the request."""
        if self._draining:
            # A router whose view predates the drain: retryable, nothing streamed, so the
            # router re-routes it to another worker.
            refusal = ErrorReport("OverloadedError", "worker is draining", retry_after_s=DRAIN_RETRY_AFTER_S)
            yield [refusal.as_delta(request.request_id)]
            return
        if request.request_id in self._streaming:
            # Refused before anything is touched: the request streaming under this id is
            # another client's and must keep running (and stay known to `abort`).
            refusal = ErrorReport("InvalidRequestError", f"request id {request.request_id!r} is already in flight")
            yield [refusal.as_delta(request.request_id)]
            return
        arrived_at = time.time()
        final: RequestDelta | None = None  # the last sample's final delta: timings + usage
        self._streaming.add(request.request_id)
        try:
            if request.kv_source and request.kv_source != self._info.actor_name:
                await self._puller.pull(request, self._engine.engine.tokenize(request))
            async with contextlib.aclosing(self._engine.generate_batches(request, paced=True)) as batches:
                async for batch in batches:
                    for delta in batch:
                        if delta.finished and delta.sample_index >= request.sampling.n - 1:
                            final = delta
                    yield batch
        except errors.KvmeshError as exc:
            yield [ErrorReport.from_exception(exc).as_delta(request.request_id)]
        except Exception as exc:  # a model failure: report it, keep the actor alive
            logger.exception("request %s failed in the engine", request.request_id)
            yield [ErrorReport("WorkerFailedError", f"engine failure: {exc!r}").as_delta(request.request_id)]
        finally:
            self._streaming.discard(request.request_id)
            self._record_spans(request, final, arrived_at)

    # ---- the router replicas' channels (worker/runtime/channel_server.py) --------------------

    async def channel_address(self) -> ChannelAddress:
        """Where router replicas connect for their channel (one socket each: every step's
        deltas of that replica's requests out, its submits and aborts in), and the token
        they must send first; the server starts at the first call, on the node's IP."""
        return await self._channel_server.start(_current_node_ip())

    async def channel_watch(self, connection_id: str) -> None:
        """Returns when the channel connection `connection_id` ends. The replica keeps this
        call pending while its connection is open, so Ray tells it of this actor's or its
        node's loss even when no FIN reaches the socket (a node gone, a process frozen)."""
        await self._channel_server.wait_closed(connection_id)

    # channel_opened / channel_ops / channel_closed: called by the ChannelServer on this
    # actor's event loop (a DeltaChannel does not cross Ray).

    def channel_opened(self, replica_id: str, channel: DeltaChannel) -> None:
        self._channels[replica_id] = channel

    def channel_ops(self, replica_id: str, channel: DeltaChannel, ops: list[tuple[str, object]]) -> None:
        """One OPS frame from a replica, in order: ("s", GenerateRequest) submits, ("a", id)
        aborts (only of what streams on this channel: a client's resumption through another
        replica may hold the id). Consecutive submits start as one batch (`_submit_on`);
        a refusal reaches the replica as the request's error delta on the channel."""
        batch: list[GenerateRequest] = []
        for kind, arg in ops:
            if kind == "s":
                batch.append(arg)
                continue
            if batch:
                self._submit_on(channel, batch).add_done_callback(_refusals_to(channel, batch))
                batch = []
            if arg in channel:
                self._engine.abort_nowait(arg)
        if batch:
            self._submit_on(channel, batch).add_done_callback(_refusals_to(channel, batch))

    def channel_closed(self, replica_id: str, channel: DeltaChannel) -> None:
        """The replica's connection ended (closed, stopped, or gone): its requests here stop."""
        if self._channels.get(replica_id) is channel:
            del self._channels[replica_id]
        for request_id in channel.request_ids():
            self._engine.abort_nowait(request_id)

    def _submit_on(self, channel: DeltaChannel, requests: list[GenerateRequest]) -> asyncio.Future:
        """Start `requests` with their deltas going to `channel`; they reach the engine in this
        order before this returns (so before any abort that follows them), except one that
        takes over the id of a run still streaming here (`_takes_over`), which first ends
        that run. The future resolves to one answer each, in order: this incarnation's id
        once the engine accepted it, or the refusal as an error delta (errors as values)."""
        superseding = [self._takes_over(channel, r) for r in requests]
        started = [None if waits else self._start(channel, r) for r, waits in zip(requests, superseding)]
        return asyncio.ensure_future(self._answers(channel, requests, superseding, started))

    def _takes_over(self, channel: DeltaChannel, request: GenerateRequest) -> bool:
        """Whether `request` replaces the run streaming here under its id instead of being
        refused as a duplicate. A request id is the client's, and a client sends an id again
        only after its earlier attempt failed: its resumption (resume tokens) or its retry
        (attempt > 1) through another router replica than the one still holding that attempt
        here (the replica died or stopped before this worker saw its socket close or its
        abort). A retry arriving on the holder's own channel is refused: that replica ended
        the attempt itself and its abort is already on the way, and it cannot tell the old
        run's late deltas from the new one's."""
        if request.request_id not in self._streaming:
            return False
        return bool(request.resume_token_ids) or (request.attempt > 1 and request.request_id not in channel)

    async def _answers(self, channel, requests, superseding, started) -> list[str | RequestDelta]:
        for i, request in enumerate(requests):
            if superseding[i]:
                await self._superseded(request.request_id)
                started[i] = (self._start(channel, request) if not channel.closed else
                              ErrorReport("WorkerFailedError", "channel closed").as_delta(request.request_id))
        return [answer if isinstance(answer, (str, RequestDelta)) else await self._answer(request, answer)
                for request, answer in zip(requests, started)]

    def _start(self, channel: DeltaChannel, request: GenerateRequest):
        """A refusal (error delta) now, or what to await for the engine's answer; the request
        is queued for the engine before this returns unless its prefix is pulled first."""
        if self._draining:  # as in `generate`: retryable, the router re-routes it
            return ErrorReport("OverloadedError", "worker is draining",
                               retry_after_s=DRAIN_RETRY_AFTER_S).as_delta(request.request_id)
        if request.request_id in self._streaming:
            return ErrorReport("InvalidRequestError",
                               f"request id {request.request_id!r} is already in flight").as_delta(request.request_id)
        arrived_at = time.time()
        self._streaming.add(request.request_id)

        def ended(last: RequestDelta) -> None:
            self._streaming.discard(request.request_id)
            self._record_spans(request, last if last.finished and not last.error_type else None, arrived_at)

        if request.kv_source and request.kv_source != self._info.actor_name:
            return asyncio.ensure_future(self._pull_and_submit(request, channel, ended))
        try:
            accepted = self._engine.submit_nowait(request, channel, on_end=ended)
        except Exception as exc:
            return self._refusal(request, exc)
        return self._engine.accepted(request.request_id, channel, accepted)

    async def _pull_and_submit(self, request: GenerateRequest, channel: DeltaChannel, ended) -> None:
        await self._puller.pull(request, self._engine.engine.tokenize(request))
        await self._engine.submit(request, channel, on_end=ended)

    async def _answer(self, request: GenerateRequest, pending) -> str | RequestDelta:
        try:
            await pending
        except Exception as exc:
            return self._refusal(request, exc)
        return self._info.incarnation

    def _refusal(self, request: GenerateRequest, exc: Exception) -> RequestDelta:
        self._streaming.discard(request.request_id)
        if isinstance(exc, errors.KvmeshError):
            return ErrorReport.from_exception(exc).as_delta(request.request_id)
        # A model failure: reported as the request's error, the actor stays up.
        logger.error("request %s failed in the engine", request.request_id, exc_info=exc)
        return ErrorReport("WorkerFailedError", f"engine failure: {exc!r}").as_delta(request.request_id)

    def _record_spans(self, request: GenerateRequest, final: RequestDelta | None, arrived_at: float) -> None:
        """kvmesh.worker.* spans for the request, in this process; a request that never got a
        final delta (cancelled, refused) still gets its generate span, marked abort/error."""
        steps = self._step_log.pop(request.request_id)
        try:
            if final is not None and final.timings is not None:
                telemetry.record_worker_spans(self._tracer, request, final.timings, final.usage,
                                              final.finish_reason, steps, self._info.block_size)
            else:
                telemetry.record_worker_spans(self._tracer, request,
                                              RequestTimings(arrival_time=arrived_at, finished_time=time.time()),
                                              None, FinishReason.ABORT, steps, self._info.block_size)
        except Exception:  # telemetry must never fail a request
            logger.exception("recording spans of %s failed", request.request_id)

    async def poll(self, since_prefix_seq: int) -> WorkerPoll:
        reads = await self._engine.poll_reads_async(since_prefix_seq)
        stats = dataclasses.replace(reads.stats, healthy=False) if self._draining else reads.stats  # as `stats`
        self._metrics.set_kv_window(reads.window.peak_kv_tokens, reads.window.mean_kv_tokens)
        return WorkerPoll(self._info, stats, reads.prefix_events, self._metrics.snapshot(), reads.dispatches)

    async def abort(self, request_id: str, replica_id: str | None = None) -> bool:
        """Abort a request; True when this worker was streaming it (its stream then ends
        with finish_reason ABORT). Unknown ids are a no-op. With `replica_id`, only while the
        request streams to that router replica: a late abort from a replica that gave the
        stream up must not end the client's resumption of it, which took the id since."""
        if replica_id is not None:
            channel = self._channels.get(replica_id)
            if channel is None or request_id not in channel:
                return False
        known = request_id in self._streaming
        await self._engine.abort(request_id)
        return known

    async def _superseded(self, request_id: str) -> bool:
        """Abort the run streaming under `request_id` for a retry or resumption of it; True once it ended."""
        logger.info("a retry or resumption of request %s supersedes its run still streaming here", request_id)
        await self._engine.abort(request_id)
        deadline = time.monotonic() + SUPERSEDE_WAIT_S
        while request_id in self._streaming:
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(DRAIN_POLL_S)
        return True

    async def stats(self) -> WorkerStats:
        stats = await self._engine.stats_async()
        # Draining reads as not healthy: every router replica drops it from its routable set
        # at its next poll (the readiness flip), whatever transport carries the deltas.
        return dataclasses.replace(stats, healthy=False) if self._draining else stats

    async def drain(self, grace_s: float) -> int:
        """Leave the routable set, let the requests here finish for up to `grace_s`, then end
        the rest with a retryable WorkerFailedError, which the router answers by resuming each
        on another worker from the tokens it streamed (its prefix pulled from here while this
        worker lives). Returns how many were moved. The worker stays drained (`undrain`)."""
        self._draining = True
        logger.info("worker %s draining (grace %.1f s)", self._info.worker_id, grace_s)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            stats = await self._engine.stats_async()
            if stats.num_running + stats.num_waiting == 0:
                return 0
            await asyncio.sleep(DRAIN_POLL_S)
        stats = await self._engine.stats_async()
        moved = stats.num_running + stats.num_waiting
        if moved:
            await self._engine.evict_all("worker drained: continued on another worker")
            logger.info("worker %s drained: %d requests moved", self._info.worker_id, moved)
        return moved

    async def undrain(self) -> None:
        """Back in the routable set (a scale-down that was called off)."""
        self._draining = False

    async def prefix_events(self, since_seq: int) -> PrefixEventBatch:
        return await self._engine.prefix_events_async(since_seq)

    async def export_prefix(self, token_ids: list[int], extra_keys: tuple[str, ...], first_block: int):
        """The KV of the prompt's prefix blocks from `first_block` on that this worker holds, a
        kv_transfer.PrefixExport (another worker pulls them: worker/runtime/prefix_pull.py)."""
        from kvmesh.worker.engine_loop.kv_transfer import export_prefix  # torch: worker process only

        return await self._engine.locked_async(export_prefix, list(token_ids), tuple(extra_keys), int(first_block))

    def _kv_tier_figures(self) -> KVTierFigures | None:
        figures = self._engine.engine.kv_tier_figures()
        if figures is None:
            return None
        p = self._puller
        return dataclasses.replace(figures, transfer_blocks_in=p.num_blocks_in, transfer_bytes_in=p.num_bytes_in,
                                   transfer_s=p.transfer_s, num_transfer_fallbacks=p.num_fallbacks)

    async def block_extra_keys(self, cache_salt: str | None, adapter=None) -> tuple[str, ...]:
        """adapter: the request's AdapterRef (core/seams.py) or None."""
        return self._engine.block_extra_keys(cache_salt, adapter)

    async def shutdown(self) -> None:
        self._channel_server.close()
        await self._engine.shutdown()


def _refusals_to(channel: DeltaChannel, requests: list[GenerateRequest]):
    """A done-callback of `_submit_on`'s future: each refusal onto the channel as its
    request's error delta."""
    def put(answers: asyncio.Future) -> None:
        if answers.cancelled():
            return
        exc = answers.exception()
        if exc is not None:  # a bug, not a refusal: the replica must not wait for ever
            logger.error("submitting on a channel failed", exc_info=exc)
            report = ErrorReport("WorkerFailedError", f"submit failed: {exc!r}")
            refusals = [report.as_delta(r.request_id) for r in requests]
        else:
            refusals = [a for a in answers.result() if isinstance(a, RequestDelta)]
        for refusal in refusals:
            channel.refuse(refusal)
    return put


def _current_node_ip() -> str:
    """The IP Ray uses for this node (the channel server listens there, never on every
    interface); loopback outside Ray."""
    import ray

    return ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"


def _current_actor_name() -> str:
    import ray

    return (ray.get_runtime_context().get_actor_name() or "") if ray.is_initialized() else ""


def _current_node_id() -> str:
    """The Ray node id of this process ("" outside Ray, e.g. an actor class used directly)."""
    import ray

    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else ""


def worker_actor_options(config: KvmeshConfig, app_name: str, index: int, placement_group=None) -> dict:
    """Ray actor options for worker `index`: named, detached, restarted by Ray. The actor holds
    rank 0's bundle (worker/parallel/placement.py): one GPU, never one per TP rank; with
    tensor parallelism it runs in bundle 0 of the engine's placement group."""
    options = dict(name=worker_actor_name(app_name, index), namespace=WORKER_NAMESPACE,
                   lifetime="detached", get_if_exists=True, max_restarts=-1, max_task_retries=0,
                   max_concurrency=max(1000, 4 * config.scheduler.max_num_seqs),
                   runtime_env=engine_runtime_env(config.parallel),
                   **actor_resource_options(rank_bundle(config.parallel)))
    if placement_group is not None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy  # Ray: only where actors start

        options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(placement_group,
                                                                          placement_group_bundle_index=0)
    return options


def start_workers(config: KvmeshConfig, app_name: str, worker_id_prefix: str = "worker") -> list:
    """Create (or find, when another router replica already did) the worker actors, with ids
    `<worker_id_prefix>-<index>` (a second group, e.g. a fallback pool, has its own prefix
    and app name). A tensor-parallel engine's placement group is placed first: a cluster that
    cannot hold it fails here, naming the missing resource."""
    import ray

    if config.parallel.worker_num_cpus is None:  # not resolved by the app builder: fit the cluster
        config = resolve_worker_num_cpus(config, ray.cluster_resources().get("CPU", 0.0), router_cpus=0.0)
    remote_class = ray.remote(WorkerActor)
    handles = []
    for index in range(config.parallel.num_workers):
        group = engine_placement_group(config.parallel, worker_actor_name(app_name, index))
        options = worker_actor_options(config, app_name, index, group)
        handles.append(remote_class.options(**options).remote(config.to_dict(), f"{worker_id_prefix}-{index}"))
    return handles


def find_workers(app_names: Sequence[str]) -> dict:
    """{actor name: handle} of every live worker actor of the apps `app_names`, found by name
    (sorted by name: worker 0 first)."""
    import ray

    pattern = re.compile("|".join(re.escape(worker_actor_name(app, 0)).removesuffix("0") + r"\d+" for app in app_names))
    names = sorted(actor["name"] for actor in ray.util.list_named_actors(all_namespaces=True)
                   if actor["namespace"] == WORKER_NAMESPACE and pattern.fullmatch(actor["name"]))
    return {name: ray.get_actor(name, namespace=WORKER_NAMESPACE) for name in names}


def drain_workers(app_names: Sequence[str], grace_s: float, node_id: str | None = None) -> dict[str, int]:
    """Drain every worker of the apps `app_names`, or only those on Ray node `node_id`, all at
    once, each with `grace_s` (WorkerActor.drain); returns {actor name: requests moved} once
    every drain returned. Found by name, so no worker count is needed (a pod's preStop hook
    has no config)."""
    import ray

    handles = find_workers(app_names)
    if node_id is not None:
        infos = ray.get([handle.info.remote() for handle in handles.values()])
        handles = {name: h for (name, h), info in zip(handles.items(), infos) if info.node_id == node_id}
    moved = ray.get([handle.drain.remote(grace_s) for handle in handles.values()])
    return dict(zip(handles, moved))


def kill_workers(config: KvmeshConfig, app_name: str) -> int:
    """Kill the app's detached workers for good; returns how many were found."""
    import ray

    killed = 0
    for index in range(config.parallel.num_workers):
        try:
            handle = ray.get_actor(worker_actor_name(app_name, index), namespace=WORKER_NAMESPACE)
        except ValueError:
            continue
        ray.kill(handle, no_restart=True)
        killed += 1
    for index in range(config.parallel.num_workers):
        remove_engine_placement_group(worker_actor_name(app_name, index))
    return killed
