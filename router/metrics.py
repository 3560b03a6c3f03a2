"""Prometheus metrics for the whole cluster, served at the router's `/metrics`.

Names follow vLLM's (`vllm:x` -> `kvmesh_x`) where vLLM has one, so existing dashboards map.

    metrics = RouterMetrics(max_num_seqs=config.scheduler.max_num_seqs)
    metrics.observe_request_end("acme", final_delta.timings, final_delta.usage, final_delta.finish_reason,
                                router_arrival_s=arrived_s)   # TTFT / e2e start at the router
    metrics.observe_dispatch(arrived_s, dispatched_s)  # the router's own queue (auth..admission)
    metrics.observe_timeout("acme", "admission")  # deadline passed: finish_reason "timeout", not "error"
    metrics.observe_route_truth(predicted_blocks=2, hit_blocks=1)  # routing truth histogram
    metrics.observe_rejection("quota")           # quota | overload | invalid | unauthenticated
    metrics.observe_retry()                      # a request that says it is a client retry
    metrics.observe_degraded("cap")              # the degradation ladder's step: cap | fallback | reject
    metrics.update_worker_stats(stats_list)      # every stats refresh (list[WorkerStats])
    metrics.set_quota_fallback(True)             # FallbackQuotaStore's on_fallback_change
    metrics.set_tenant_registry_stale(True)      # Authenticator's on_stale_change
    metrics.observe_tenant_registry_restore(12)  # Authenticator's on_restore (records written back)
    body = metrics.render(peer_snapshots)        # bytes for GET /metrics (CONTENT_TYPE)

    engine_metrics = EngineMetrics("worker-0", ...)   # worker side: what only the engine sees
    engine.phase_clock.observers.append(engine_metrics.observe_step_report)  # steps, memory, cost
    engine_metrics.snapshot() -> bytes           # core/telemetry.py; rides in every WorkerPoll

Why prometheus_client and not ray.util.metrics. Ray's metrics go through each node's metrics
agent and appear on the node's metrics export port (prefixed `ray_`), not on our router's
HTTP port; a scrape of `/metrics` on the service would see nothing, and tests would need the
dashboard agent running. With prometheus_client every process owns a private
`CollectorRegistry`, and we make the router's `/metrics` correct for the cluster by merging:

- request-level metrics (latency histograms, token counters, finish reasons, rejections) are
  observed at the router, from the `RequestTimings` and `Usage` each final delta carries, so
  the worker need not export them;
- worker-level figures (running/waiting, KV blocks, preemptions) come from the `WorkerStats`
  the router already polls for routing, rendered with a `worker` label;
- what only an engine sees (step phases, batch token mix, memory, per-tenant compute, model
  info; core/telemetry.py) travels as an `EngineMetrics.snapshot()` (the text
  exposition format, plain bytes over the Ray call) and is merged in;
- Serve routes a scrape to ANY router replica, so each replica's request-level metrics must
  be visible from every other: `snapshot()` gives a replica's own text, and `render()` sums
  the peers' snapshots into its own (counters and histogram buckets add; gauges carry a
  `replica` or `worker` label so they never collide). Snapshots meet on a `MetricsBoard`,
  one named Ray actor: each replica publishes its snapshot every few seconds and, on a
  scrape, renders its own live registry plus the others' latest snapshots:

      board = get_or_create_board(app_name)                  # named, detached, one per app
      task = start_publishing(board, metrics, interval_s=2)  # asyncio task per replica
      body = metrics.render(await board.snapshots.remote(exclude=metrics.replica_id))

  A replica that stops publishing (scaled down, crashed) drops out after `stale_after_s`;
  its counters then leave the sum, which Prometheus' rate() treats as a counter reset.
  The board belongs to its app (two apps on one cluster never sum each other's metrics) and
  goes with it (`kill_board`, called by stop_serving), so a new deployment of the same name
  does not render the old one's replicas for a minute.

Histograms are one observation per request; `inter_token_latency_seconds` observes the
request's mean gap (decode time / (completion tokens - 1)), like vLLM's per-request
time_per_output_token. Prefix-cache queries/hits count prompt tokens, as vLLM does.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections.abc import Iterable, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.parser import text_string_to_metric_families

from kvmesh.core.seams import FinishReason, RequestTimings, Usage, WorkerStats
from kvmesh.core.telemetry import EngineMetrics  # re-exported: the worker side of step time
from kvmesh.router.degradation import STEPS as DEGRADATION_STEPS  # cap | fallback | reject, in order
from kvmesh.router.routing import RoutingPath

__all__ = ["CONTENT_TYPE", "EngineMetrics", "MetricsBoard", "RouterMetrics", "get_board", "get_or_create_board",
           "kill_board", "metrics_board_name", "render_merged", "start_publishing", "worker_families"]

logger = logging.getLogger(__name__)

CONTENT_TYPE = CONTENT_TYPE_LATEST
# The board's named actor lives in this namespace, whichever namespace its creator ran in, so
# the driver that stops the app finds it.
METRICS_BOARD_NAMESPACE = "kvmesh"
PREFIX = "kvmesh_"
# deadline: refused on arrival, its expected queue wait already past its deadline (admission.py);
# evicted: refused while queued, its slot given to a more important request (admission.py)
REJECTION_REASONS = ("quota", "overload", "deadline", "evicted", "invalid", "unauthenticated", "adapter_not_found",
                     "permission_denied")
TIMEOUT_STAGES = ("admission", "stream")
FINISH_TIMEOUT = "timeout"  # finish_reason label of a request whose deadline passed (not an error)
SPILL_REASONS = ("preferred_full", "worker_refused")
AFFINITY_WAIT_OUTCOMES = ("room", "timed_out")  # router/affinity_wait.py
ROUTING_PATHS = tuple(path.value for path in RoutingPath)

# Seconds. Latency buckets span 1 ms (CPU decode step) to 5 min (long generations in a queue).
_LATENCY_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                      2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)
_ROUTE_ERROR_BUCKETS = (-64, -16, -8, -4, -2, -1, 0, 1, 2, 4, 8, 16, 64)
_TTFT_ERROR_BUCKETS_S = (-5.0, -1.0, -0.5, -0.25, -0.1, -0.05, -0.01, 0.0, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0)
_ITL_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3,
                  0.4, 0.5, 0.75, 1.0, 2.5, 5.0)


def default_replica_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


class RouterMetrics:
    def __init__(self, replica_id: str | None = None, max_num_seqs: int | None = None):
        self.replica_id = replica_id or default_replica_id()
        self._max_num_seqs = max_num_seqs  # denominator of batch_fill_ratio
        self._registry = CollectorRegistry(auto_describe=True)
        self._worker_stats: list[WorkerStats] = []
        self._engine_snapshots: dict[str, bytes] = {}  # worker id -> EngineMetrics.snapshot()
        r = self._registry

        def hist(name: str, doc: str, buckets=_LATENCY_BUCKETS_S) -> Histogram:
            return Histogram(PREFIX + name, doc, buckets=buckets, registry=r)

        def counter_by(name: str, doc: str, label: str, values: tuple[str, ...]) -> Counter:
            """A counter with one label, every value present at 0 so rate() works from the start."""
            counter = Counter(PREFIX + name, doc, [label], registry=r)
            for value in values:
                counter.labels(value)
            return counter

        self.ttft = hist("time_to_first_token_seconds",
                         "Time from the router's arrival to the first output token (what the client waits).")
        self.itl = hist("inter_token_latency_seconds", "Mean gap between output tokens, per request.", _ITL_BUCKETS_S)
        self.e2e = hist("e2e_request_latency_seconds", "Time from the router's arrival to the last output token.")
        self.router_queue = hist("router_queue_time_seconds",
                                 "Time from the router's arrival to dispatch to a worker (auth, quota, admission).")
        self.queue = hist("request_queue_time_seconds", "Time waiting in the worker before first scheduled.")
        self.prefill = hist("request_prefill_time_seconds", "Time from first scheduled to first token.")
        self.decode = hist("request_decode_time_seconds", "Time from first token to finish.")
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens of finished requests.",
                                     ["tenant"], registry=r)
        self.cached_prompt_tokens = Counter(PREFIX + "cached_prompt_tokens",
                                            "Prompt tokens served from the prefix cache.", ["tenant"], registry=r)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Output tokens generated.",
                                         ["tenant"], registry=r)
        self.prefix_cache_queries = Counter(PREFIX + "prefix_cache_queries",
                                            "Prompt tokens looked up in the prefix cache.", registry=r)
        self.prefix_cache_hits = Counter(PREFIX + "prefix_cache_hits",
                                         "Prompt tokens found in the prefix cache.", registry=r)
        self.requests = Counter(PREFIX + "requests", "Finished requests by finish reason.",
                                ["finish_reason", "tenant"], registry=r)
        self.rejections = counter_by("rejections", "Requests rejected before running, by reason.", "reason",
                                     REJECTION_REASONS)
        self.timeouts = counter_by("request_timeouts", "Requests whose deadline passed, by where they were "
                                   "(admission: before a worker; stream: on a worker). Not counted as errors.",
                                   "stage", TIMEOUT_STAGES)
        self.route_predicted_blocks = Counter(PREFIX + "route_predicted_prefix_blocks",
                                              "Prompt blocks the router expected the chosen worker to have cached.",
                                              registry=r)
        self.route_hit_blocks = Counter(PREFIX + "route_hit_prefix_blocks",
                                        "Prompt blocks the chosen worker's prefix cache actually served.", registry=r)
        self.route_error_blocks = Histogram(PREFIX + "route_prefix_blocks_error",
                                            "Predicted minus actually hit prefix blocks, per request (>0: the "
                                            "router's view of the caches is stale, <0: it missed a hit).",
                                            buckets=_ROUTE_ERROR_BUCKETS, registry=r)
        self.route_ttft_predicted_seconds = Counter(
            PREFIX + "route_ttft_predicted_seconds",
            "TTFT the predicted_latency policy predicted on the chosen worker, summed (router/latency.py).",
            registry=r)
        self.route_ttft_actual_seconds = Counter(
            PREFIX + "route_ttft_actual_seconds",
            "TTFT the chosen worker measured for those requests (arrival there to first token), summed.", registry=r)
        self.route_ttft_error_seconds = Histogram(
            PREFIX + "route_ttft_error_seconds",
            "Actual minus predicted TTFT on the chosen worker, per request (>0: the worker was slower than "
            "predicted).", buckets=_TTFT_ERROR_BUCKETS_S, registry=r)
        self.retries_seen = Counter(PREFIX + "retries_seen", "Requests that arrived as a client retry.",
                                    registry=r)
        self.routing_spills = counter_by(
            "routing_spills",
            "Requests sent to another worker than their cached prefix's because that one was full "
            "(preferred_full: no budget in the router's view; worker_refused: its own admission said no).",
            "reason", SPILL_REASONS)
        self.affinity_waits = counter_by(
            "routing_affinity_waits",
            "Requests that waited for room on the worker holding their cached prefix instead of spilling "
            "(router.affinity_wait_s), by outcome (room: it came in time; timed_out: spilled after the wait).",
            "outcome", AFFINITY_WAIT_OUTCOMES)
        self.affinity_wait_seconds = Counter(PREFIX + "routing_affinity_wait_seconds",
                                             "Seconds requests spent in the affinity wait.", registry=r)
        self.stream_resumptions = counter_by(
            "stream_resumptions",
            "Streams whose worker failed after output had reached the client, continued on another worker "
            "(resumed) or ended with a retryable error (not_resumable: resumption off, spent, n > 1, no worker).",
            "outcome", ("resumed", "not_resumable"))
        self.degraded = counter_by(
            "degraded",
            "Requests the degradation ladder handled, by its step (cap: max_tokens capped; fallback: "
            "sent to the fallback pool; reject: every step failed, refused with retry-after).",
            "step", DEGRADATION_STEPS)
        self.routing_decisions = counter_by(
            "routing_decisions",
            "Routing decisions by the policy's path (prefix_match: longest cached prefix within the load "
            "guard; prefix_spill / prefix_imbalanced: the guard moved it; prefix_spread: predicted_latency gave its "
            "hot family one more worker; no_prefix: nothing matched among the "
            "workers with room; least_loaded / round_robin: those policies). A worker refusal's re-route counts again.",
            "path", ROUTING_PATHS)
        self.adapter_requests = Counter(PREFIX + "adapter_requests", "Finished requests run with a LoRA adapter.",
                                        ["adapter"], registry=r)
        self.adapter_prompt_tokens = Counter(PREFIX + "adapter_prompt_tokens",
                                             "Prompt tokens of finished requests, by LoRA adapter.", ["adapter"],
                                             registry=r)
        self.adapter_generation_tokens = Counter(PREFIX + "adapter_generation_tokens",
                                                 "Output tokens generated, by LoRA adapter.", ["adapter"], registry=r)
        self.adapter_routed_loads = Counter(PREFIX + "adapter_routed_loads",
                                            "LoRA requests routed to a worker not holding their adapter (it loads "
                                            "it), by adapter: the routing's cost in adapter loads.", ["adapter"],
                                            registry=r)
        self.family_claims = counter_by(
            "family_claims",
            "New prompt families placed through the router replicas' shared claim in Redis "
            "(router.family_claim_ttl_s), by outcome (won: this replica's placement became the claim; joined: "
            "another replica's claim was followed; unavailable: Redis did not answer, this replica's own rule).",
            "outcome", ("won", "joined", "unavailable"))
        self.family_claims_fallback = Gauge(
            PREFIX + "family_claims_fallback_active",
            "1 while Redis is unreachable and this replica places new prompt families by its own rule "
            "(no shared claim: replicas may then place one family on two workers).", ["replica"], registry=r)
        self.family_claims_fallback.labels(self.replica_id).set(0)
        self.quota_fallback = Gauge(PREFIX + "quota_store_fallback_active",
                                    "1 while Redis is unreachable and local per-replica limits apply.",
                                    ["replica"], registry=r)
        self.quota_fallback.labels(self.replica_id).set(0)
        self.tenant_registry_stale = Gauge(
            PREFIX + "tenant_registry_stale",
            "1 while the tenant store cannot be read and this replica serves the registry it last read.",
            ["replica"], registry=r)
        self.tenant_registry_stale.labels(self.replica_id).set(0)
        self.tenant_registry_restores = Counter(
            PREFIX + "tenant_registry_restores",
            "Times this replica found the tenant store wiped (no records, no write marker) and wrote back "
            "the registry it last read.", registry=r)
        self.tenant_records_restored = Counter(
            PREFIX + "tenant_records_restored", "Tenant records written back into a wiped tenant store.",
            registry=r)

    # ---- what the router core calls ------------------------------------------------------

    def observe_request_end(self, tenant: str, timings: RequestTimings | None, usage: Usage | None,
                            finish_reason: FinishReason | str | None, router_arrival_s: float | None = None) -> None:
        """`router_arrival_s` (time.time() when the router got the request) moves the start of
        TTFT and e2e latency from the worker's arrival back to the router's. Clocks of other
        hosts may drift: the earlier of the two arrivals is used."""
        reason = finish_reason.value if isinstance(finish_reason, FinishReason) else str(finish_reason or "error")
        self.requests.labels(reason, tenant).inc()
        if usage is not None:
            self.prompt_tokens.labels(tenant).inc(usage.prompt_tokens)
            self.cached_prompt_tokens.labels(tenant).inc(usage.cached_tokens)
            self.generation_tokens.labels(tenant).inc(usage.completion_tokens)
            self.prefix_cache_queries.inc(usage.prompt_tokens)
            self.prefix_cache_hits.inc(usage.cached_tokens)
        if timings is not None:
            start_s = timings.arrival_time if router_arrival_s is None else min(router_arrival_s, timings.arrival_time)
            self._observe_timings(timings, usage.completion_tokens if usage is not None else 0, start_s)

    def _observe_timings(self, t: RequestTimings, completion_tokens: int, start_s: float) -> None:
        def observe(hist: Histogram, start: float | None, end: float | None) -> None:
            if start is not None and end is not None and end >= start:
                hist.observe(end - start)

        observe(self.queue, t.arrival_time, t.first_scheduled_time)
        observe(self.ttft, start_s, t.first_token_time)
        observe(self.prefill, t.first_scheduled_time, t.first_token_time)
        observe(self.decode, t.first_token_time, t.finished_time)
        observe(self.e2e, start_s, t.finished_time)
        if completion_tokens >= 2 and t.first_token_time is not None and t.finished_time is not None:
            self.itl.observe(max(0.0, t.finished_time - t.first_token_time) / (completion_tokens - 1))

    def observe_dispatch(self, router_arrival_s: float, dispatched_s: float) -> None:
        """A request left the router for a worker (after auth, quota and admission)."""
        self.router_queue.observe(max(0.0, dispatched_s - router_arrival_s))

    def observe_timeout(self, tenant: str, stage: str) -> None:
        """A deadline passed before the admission finished; one in a stream ends through
        observe_request_end with finish_reason FINISH_TIMEOUT and counts here too."""
        if stage not in TIMEOUT_STAGES:
            raise ValueError(f"timeout stage must be one of {TIMEOUT_STAGES}, got {stage!r}")
        self.timeouts.labels(stage).inc()
        if stage == "admission":
            self.requests.labels(FINISH_TIMEOUT, tenant).inc()

    def observe_route_truth(self, predicted_blocks: int, hit_blocks: int) -> None:
        self.route_predicted_blocks.inc(predicted_blocks)
        self.route_hit_blocks.inc(hit_blocks)
        self.route_error_blocks.observe(predicted_blocks - hit_blocks)

    def observe_ttft_prediction(self, predicted_s: float, actual_s: float) -> None:
        self.route_ttft_predicted_seconds.inc(predicted_s)
        self.route_ttft_actual_seconds.inc(actual_s)
        self.route_ttft_error_seconds.observe(actual_s - predicted_s)

    def observe_rejection(self, reason: str) -> None:
        if reason not in REJECTION_REASONS:
            raise ValueError(f"rejection reason must be one of {REJECTION_REASONS}, got {reason!r}")
        self.rejections.labels(reason).inc()

    def observe_spill(self, reason: str) -> None:
        if reason not in SPILL_REASONS:
            raise ValueError(f"spill reason must be one of {SPILL_REASONS}, got {reason!r}")
        self.routing_spills.labels(reason).inc()

    def observe_affinity_wait(self, outcome: str, seconds: float) -> None:
        if outcome not in AFFINITY_WAIT_OUTCOMES:
            raise ValueError(f"affinity wait outcome must be one of {AFFINITY_WAIT_OUTCOMES}, got {outcome!r}")
        self.affinity_waits.labels(outcome).inc()
        self.affinity_wait_seconds.inc(seconds)

    def observe_adapter_request(self, adapter: str, usage: Usage | None) -> None:
        self.adapter_requests.labels(adapter).inc()
        if usage is not None:
            self.adapter_prompt_tokens.labels(adapter).inc(usage.prompt_tokens)
            self.adapter_generation_tokens.labels(adapter).inc(usage.completion_tokens)

    def observe_adapter_routed(self, adapter: str, holder: bool) -> None:
        if not holder:
            self.adapter_routed_loads.labels(adapter).inc()

    def observe_route(self, path: str) -> None:
        if path not in ROUTING_PATHS:
            raise ValueError(f"routing path must be one of {ROUTING_PATHS}, got {path!r}")
        self.routing_decisions.labels(path).inc()

    def observe_degraded(self, step: str) -> None:
        if step not in DEGRADATION_STEPS:
            raise ValueError(f"degradation step must be one of {DEGRADATION_STEPS}, got {step!r}")
        self.degraded.labels(step).inc()

    def observe_retry(self) -> None:
        self.retries_seen.inc()

    def observe_stream_resumption(self, resumed: bool) -> None:
        self.stream_resumptions.labels("resumed" if resumed else "not_resumable").inc()

    def observe_family_claim(self, outcome) -> None:
        """FamilyClaims' on_outcome (a ClaimOutcome)."""
        self.family_claims.labels(outcome.value).inc()

    def set_family_claims_fallback(self, active: bool) -> None:
        """FamilyClaims' on_fallback_change."""
        self.family_claims_fallback.labels(self.replica_id).set(1 if active else 0)

    def set_quota_fallback(self, active: bool) -> None:
        self.quota_fallback.labels(self.replica_id).set(1 if active else 0)

    def set_tenant_registry_stale(self, stale: bool) -> None:
        """The Authenticator's on_stale_change."""
        self.tenant_registry_stale.labels(self.replica_id).set(1 if stale else 0)

    def observe_tenant_registry_restore(self, num_records: int) -> None:
        """The Authenticator's on_restore: the store came back wiped."""
        self.tenant_registry_restores.inc()
        self.tenant_records_restored.inc(num_records)

    def update_worker_stats(self, stats: Sequence[WorkerStats]) -> None:
        """The latest stats of every worker; a worker missing from the list disappears."""
        self._worker_stats = list(stats)

    def update_engine_snapshots(self, snapshots: dict[str, bytes]) -> None:
        """The latest EngineMetrics snapshot of every worker (from the pool's polls). Rendered
        by this replica only, not published to peers, so each worker counts once."""
        self._engine_snapshots = dict(snapshots)

    # ---- exposition ----------------------------------------------------------------------

    def snapshot(self) -> bytes:
        """This replica's own metrics (no worker gauges), for a peer's `render`."""
        return generate_latest(self._registry)

    def render(self, peer_snapshots: Iterable[bytes] = ()) -> bytes:
        """`/metrics` body: own + peers' snapshots merged, plus the workers' gauges."""
        return render_merged([self.snapshot(), *peer_snapshots, *self._engine_snapshots.values()],
                             worker_families(self._worker_stats, self._max_num_seqs))


# ---- worker gauges and merging -----------------------------------------------------------

def worker_families(stats: Sequence[WorkerStats], max_num_seqs: int | None) -> list[Metric]:
    """Gauges (and cumulative preemption counters) with a `worker` label, from WorkerStats."""
    gauges = {
        "num_requests_running": "Requests running on the worker.",
        "num_requests_waiting": "Requests waiting in the worker's queue.",
        "kv_cache_usage_ratio": "KV blocks referenced by running requests / all blocks (0..1).",
        "kv_blocks_used": "KV blocks referenced by running requests.",
        "kv_blocks_cached": "Unreferenced KV blocks holding reusable prefixes (evictable).",
        "kv_blocks_free": "Empty KV blocks.",
        "kv_block_fragmentation_ratio": "Slots in used blocks holding no token (internal fragmentation).",
        "batch_size": "Requests in the current batch.",
        "batch_fill_ratio": "Batch size / max_num_seqs.",
        "worker_healthy": "1 if the worker answered its last stats call healthy.",
        "prefix_index_event_seq": "Newest prefix-cache event of the worker in this replica's last poll, applied to "
                                  "its prefix index with the poll's figures (behind the worker's own = routing lag).",
    }
    families = {name: Metric(PREFIX + name, doc, "gauge") for name, doc in gauges.items()}
    preemptions = Metric(PREFIX + "preemptions", "Preemptions since the worker started, by mode.", "counter")
    for_priority = Metric(PREFIX + "priority_preemptions", "Preemptions made for a more important waiting request "
                          "(scheduler.priority_preemption), by what it lacked: a slot, step budget or blocks "
                          "(reason=slot), or KV budget: a reservation taken (reason=kv_reservation).", "counter")
    outgrown = Metric(PREFIX + "outgrown_estimates", "Requests that outgrew their expected-output reservation "
                      "(scheduler.admission_reserve: expected).", "counter")
    lora = [Metric(PREFIX + "lora_slots", "LoRA adapter slots of the worker (lora.max_loras).", "gauge"),
            Metric(PREFIX + "lora_slots_used", "LoRA adapter slots holding an adapter.", "gauge"),
            Metric(PREFIX + "lora_adapter_resident", "1 for each adapter in one of the worker's slots.", "gauge"),
            Metric(PREFIX + "lora_adapter_loads", "Adapters loaded into a slot since the worker started.", "counter"),
            Metric(PREFIX + "lora_adapter_evictions", "Adapters evicted from a slot (LRU) since the worker started.",
                   "counter"),
            Metric(PREFIX + "lora_requests_waiting", "Requests waiting for their adapter's load.", "gauge")]
    for s in stats:
        labels = {"worker": s.worker_id}
        slots_used = s.num_blocks_used * s.block_size
        values = {
            "num_requests_running": s.num_running,
            "num_requests_waiting": s.num_waiting,
            "kv_cache_usage_ratio": s.num_blocks_used / s.num_blocks_total if s.num_blocks_total else 0.0,
            "kv_blocks_used": s.num_blocks_used,
            "kv_blocks_cached": s.num_blocks_cached,
            "kv_blocks_free": s.num_blocks_free,
            "kv_block_fragmentation_ratio": 1.0 - s.kv_tokens_used / slots_used if slots_used else 0.0,
            "batch_size": s.num_running,
            "batch_fill_ratio": s.num_running / max_num_seqs if max_num_seqs else 0.0,
            "worker_healthy": 1.0 if s.healthy else 0.0,
            "prefix_index_event_seq": s.prefix_event_seq,
        }
        for name, value in values.items():
            families[name].add_sample(PREFIX + name, labels, float(value))
        for mode, count in (("recompute", s.num_preemptions_recompute), ("swap", s.num_preemptions_swap)):
            preemptions.add_sample(PREFIX + "preemptions_total", {**labels, "mode": mode}, float(count))
        for reason, count in (("slot", s.num_preemptions_priority - s.num_preemptions_priority_kv),
                              ("kv_reservation", s.num_preemptions_priority_kv)):
            for_priority.add_sample(PREFIX + "priority_preemptions_total", {**labels, "reason": reason}, float(count))
        outgrown.add_sample(PREFIX + "outgrown_estimates_total", labels, float(s.num_outgrown_estimates))
        if s.lora_slots_total:
            lora[0].add_sample(PREFIX + "lora_slots", labels, float(s.lora_slots_total))
            lora[1].add_sample(PREFIX + "lora_slots_used", labels, float(len(s.resident_adapters)))
            for name in s.resident_adapters:
                lora[2].add_sample(PREFIX + "lora_adapter_resident", {**labels, "adapter": name}, 1.0)
            lora[3].add_sample(PREFIX + "lora_adapter_loads_total", labels, float(s.num_adapter_loads))
            lora[4].add_sample(PREFIX + "lora_adapter_evictions_total", labels, float(s.num_adapter_evictions))
            lora[5].add_sample(PREFIX + "lora_requests_waiting", labels, float(s.num_waiting_for_adapter))
    return [*families.values(), preemptions, for_priority, outgrown, *lora]


def render_merged(snapshots: Iterable[bytes], extra_families: Iterable[Metric] = ()) -> bytes:
    """Sum samples with the same name and labels across snapshots (counters, histogram
    buckets/count/sum, and gauges, which carry a replica/worker label so they do not
    collide). `_created` timestamps are dropped: they cannot be merged."""
    merged: dict[str, Metric] = {}
    values: dict[str, dict[tuple, float]] = {}
    for blob in snapshots:
        for family in text_string_to_metric_families(blob.decode()):
            if family.name.endswith("_created"):
                continue
            merged.setdefault(family.name, Metric(family.name, family.documentation, family.type))
            acc = values.setdefault(family.name, {})
            for sample in family.samples:
                if sample.name.endswith("_created"):
                    continue
                key = (sample.name, tuple(sorted(sample.labels.items())))
                acc[key] = acc.get(key, 0.0) + sample.value
    families = []
    for name, family in merged.items():
        for (sample_name, labels), value in values[name].items():
            family.add_sample(sample_name, dict(labels), value)
        families.append(family)
    families.extend(extra_families)
    return generate_latest(_StaticCollector(families))


class _StaticCollector:
    """A registry-like object for generate_latest over prepared families."""

    def __init__(self, families: list[Metric]):
        self._families = families

    def collect(self):
        return iter(self._families)


# ---- where replicas' snapshots meet ------------------------------------------------------

class MetricsBoard:
    """Latest snapshot per source (router replica or engine). A plain class: run it as one
    named Ray actor (`get_or_create_board`); unit tests use it directly."""

    def __init__(self, stale_after_s: float = 60.0, clock=time.monotonic):
        self._stale_after_s = stale_after_s
        self._clock = clock
        self._latest: dict[str, tuple[float, bytes]] = {}  # source id -> (published at, snapshot)

    def publish(self, source_id: str, snapshot: bytes) -> None:
        self._latest[source_id] = (self._clock(), snapshot)

    def snapshots(self, exclude: str | None = None) -> list[bytes]:
        """Fresh snapshots of every source but `exclude` (the caller renders its own live)."""
        now = self._clock()
        for source_id, (published_at, _) in list(self._latest.items()):
            if now - published_at > self._stale_after_s:
                del self._latest[source_id]
        return [snap for source_id, (_, snap) in sorted(self._latest.items()) if source_id != exclude]


def metrics_board_name(app_name: str) -> str:
    return f"kvmesh-{app_name}-metrics-board"


def get_or_create_board(app_name: str, stale_after_s: float = 60.0):
    """The app's MetricsBoard actor handle (created by the first caller). Needs ray.init."""
    import ray

    board_actor = ray.remote(num_cpus=0)(MetricsBoard)
    return board_actor.options(name=metrics_board_name(app_name), namespace=METRICS_BOARD_NAMESPACE,
                               get_if_exists=True, lifetime="detached").remote(stale_after_s=stale_after_s)


def get_board(app_name: str):
    """The app's running MetricsBoard (ValueError when there is none)."""
    import ray

    return ray.get_actor(metrics_board_name(app_name), namespace=METRICS_BOARD_NAMESPACE)


def kill_board(app_name: str, release_timeout_s: float = 10.0) -> bool:
    """Kill the app's board (its replicas are gone) and wait until its name is free, so an app
    deployed next under the same name gets a live board, not the dying one; False when it had
    none."""
    import ray

    try:
        board = get_board(app_name)
    except ValueError:
        return False
    ray.kill(board, no_restart=True)
    deadline = time.monotonic() + release_timeout_s
    while time.monotonic() < deadline:
        try:
            get_board(app_name)
        except ValueError:
            break
        time.sleep(0.05)
    return True


def start_publishing(board, metrics: RouterMetrics, interval_s: float) -> asyncio.Task:
    """Publish `metrics.snapshot()` to the board actor every `interval_s` (awaits the Ray
    call; never blocks the event loop). Cancel the task to stop."""
    async def loop() -> None:
        failing = False
        while True:
            try:
                await board.publish.remote(metrics.replica_id, metrics.snapshot())
                failing = False
            except Exception as exc:  # the board restarts with the cluster; keep serving meanwhile
                if not failing:
                    logger.warning("metrics board publish failed (%s); /metrics elsewhere lacks this "
                                   "replica until it succeeds", type(exc).__name__)
                failing = True
            await asyncio.sleep(interval_s)
    return asyncio.get_running_loop().create_task(loop())
