"""Server-side samples from a Prometheus /metrics page, scraped during a run.

The router's metric names (router/metrics.py, `kvmesh_...`) are matched by role rather than
by exact name, so the scraper keeps working if a name changes or a metric is absent:

  kv_usage               a kvmesh_ gauge whose name has "kv" and "usage"/"utilization"
  num_running            ... "running"
  num_waiting            ... "waiting" or "queue" (and not "time"/"seconds")
  num_preemptions        ... "preempt"
  kv_blocks_used         ... "kv_blocks_used"
  prefix_cache_hit_rate  ... "prefix", "hit" and "rate"/"ratio"; else the counters
                         kvmesh_prefix_cache_hits / kvmesh_prefix_cache_queries (since start)

Samples with labels (per worker, per tenant) are summed, except ratios (kv_usage, hit rate),
which are averaged. Every kvmesh_ gauge/counter is also kept raw as "raw:<name>".
"""

from __future__ import annotations

import logging
from collections import defaultdict

logger = logging.getLogger(__name__)

_RATIO_ROLES = ("kv_usage", "prefix_cache_hit_rate")


def metric_role(name: str) -> str | None:
    n = name.lower()
    if not n.startswith("kvmesh_"):
        return None
    if "kv" in n[len("kvmesh_"):] and ("usage" in n or "utilization" in n):
        return "kv_usage"
    if "prefix" in n and "hit" in n and ("rate" in n or "ratio" in n):
        return "prefix_cache_hit_rate"
    if "kv_blocks_used" in n:
        return "kv_blocks_used"
    if "preempt" in n:
        return "num_preemptions"
    if "time" in n or "seconds" in n:
        return None  # histograms of queue time etc. are not queue lengths
    if "running" in n:
        return "num_running"
    if "waiting" in n or "queue" in n:
        return "num_waiting"
    return None


def parse_prometheus_sample(text: str) -> dict[str, float]:
    """Prometheus exposition text -> {role or raw:<name>: value}."""
    from prometheus_client.parser import text_string_to_metric_families

    sums: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    try:
        families = list(text_string_to_metric_families(text))
    except ValueError as exc:  # a malformed page is reported, not fatal
        logger.warning("unparseable /metrics page: %s", exc)
        return {}
    for family in families:
        if family.type not in ("gauge", "counter") or not family.name.startswith("kvmesh_"):
            continue
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            sums[f"raw:{sample.name}"] += sample.value
            role = metric_role(sample.name)
            if role is not None:
                sums[role] += sample.value
                counts[role] += 1
    out = dict(sums)
    hits, queries = out.get("raw:kvmesh_prefix_cache_hits_total"), out.get("raw:kvmesh_prefix_cache_queries_total")
    if "prefix_cache_hit_rate" not in out and hits is not None and queries:
        out["prefix_cache_hit_rate"] = hits / queries
    for role in _RATIO_ROLES:
        if counts.get(role):
            out[role] = sums[role] / counts[role]
    return out
