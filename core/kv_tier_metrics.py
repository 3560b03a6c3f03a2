"""A worker's host KV tier and prefix transfers as figures and Prometheus counters.

The engine fills `KVTierFigures` (worker/engine_loop/engine.py: `kv_tier_figures`); the worker
actor registers a `KVTierCollector` on its EngineMetrics registry, so the figures ride in the
snapshot the router renders on /metrics, one sample set per worker:

    kvmesh_kv_tier_blocks{worker, state="used"|"total"}                  gauge
    kvmesh_kv_tier_hit_tokens_total{worker}                              prompt tokens copied back (recomputes avoided)
    kvmesh_kv_tier_bytes_total{worker, direction="store"|"load"|"transfer_in"}
    kvmesh_kv_tier_copy_seconds_total{worker, kind="tier"|"transfer"}
    kvmesh_kv_tier_checksum_failures_total{worker}                       host or pulled copies refused
    kvmesh_kv_transfer_blocks_total{worker}                              blocks pulled from another worker
    kvmesh_kv_transfer_fallbacks_total{worker}                           pulls that failed: recomputed
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

PREFIX = "kvmesh_"


@dataclass(frozen=True)
class KVTierFigures:
    num_blocks_total: int
    num_blocks_used: int
    hit_tokens: int
    bytes_stored: int  # device -> host
    bytes_loaded: int  # host -> device
    copy_s: float  # both directions
    num_checksum_failures: int = 0
    transfer_blocks_in: int = 0
    transfer_bytes_in: int = 0
    transfer_s: float = 0.0
    num_transfer_fallbacks: int = 0


class KVTierCollector:
    """A prometheus_client custom collector reading the figures at scrape (snapshot) time."""

    def __init__(self, worker_id: str, figures: Callable[[], KVTierFigures | None]):
        self.worker_id = worker_id
        self._figures = figures

    def describe(self):
        return []  # figures appear only on workers with a tier

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        f = self._figures()
        if f is None:
            return
        w = self.worker_id
        blocks = GaugeMetricFamily(PREFIX + "kv_tier_blocks", "Host KV tier blocks.", labels=["worker", "state"])
        blocks.add_metric([w, "used"], f.num_blocks_used)
        blocks.add_metric([w, "total"], f.num_blocks_total)
        yield blocks
        moved = CounterMetricFamily(PREFIX + "kv_tier_bytes", "KV bytes moved by the host tier and transfers.",
                                    labels=["worker", "direction"])
        for direction, value in (("store", f.bytes_stored), ("load", f.bytes_loaded),
                                 ("transfer_in", f.transfer_bytes_in)):
            moved.add_metric([w, direction], value)
        yield moved
        seconds = CounterMetricFamily(PREFIX + "kv_tier_copy_seconds", "Time spent copying KV blocks.",
                                      labels=["worker", "kind"])
        seconds.add_metric([w, "tier"], f.copy_s)
        seconds.add_metric([w, "transfer"], f.transfer_s)
        yield seconds
        for name, doc, value in (
                ("kv_tier_hit_tokens", "Prompt tokens copied back from the host tier (recomputes avoided).",
                 f.hit_tokens),
                ("kv_tier_checksum_failures", "Host or pulled KV copies refused by the content check.",
                 f.num_checksum_failures),
                ("kv_transfer_blocks", "KV blocks pulled from another worker.", f.transfer_blocks_in),
                ("kv_transfer_fallbacks", "Prefix pulls that failed or timed out (recomputed).",
                 f.num_transfer_fallbacks)):
            family = CounterMetricFamily(PREFIX + name, doc, labels=["worker"])
            family.add_metric([w], value)
            yield family
