"""The kvmesh Grafana dashboard, generated: rows for the four metric layers (request, batch,
compute, memory) plus tenants and routing, every panel a PromQL query over the router's
merged /metrics (router/metrics.py; docs/observability.md says what each one means).

    python -m kvmesh.deploy.grafana_dashboard                # rewrite the chart's copy
    python -m kvmesh.deploy.grafana_dashboard --stdout > kvmesh.json   # for an import by hand

One copy is committed: helm/kvmesh/dashboards/kvmesh.json, inside the chart because Helm's
`.Files.Get` reads only the chart's own folder (the chart's ConfigMap hands it to Grafana's
dashboard sidecar). An import by hand takes that file or `--stdout` (the same bytes, built
here, also from an installed package without the repository). tests/test_helm_chart.py fails
when the chart's copy differs from what this module builds.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

UID = "kvmesh-overview"
REPO = Path(__file__).resolve().parents[1]
CHART_COPY = REPO / "helm" / "kvmesh" / "dashboards" / "kvmesh.json"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
WINDOW = "$__rate_interval"
ALERTS_TEMPLATE = REPO / "helm" / "kvmesh" / "templates" / "prometheusrule.yaml"
_METRIC_NAME = re.compile(r"\bkvmesh_[a-z0-9_]+")


def queried_metric_names(text: str) -> set[str]:
    """Every kvmesh_* sample name a dashboard or rule text queries (as /metrics spells them:
    counters end in _total, histograms are queried as _bucket / _sum / _count)."""
    return set(_METRIC_NAME.findall(text))


def _q(quantile: float, histogram: str, by: str = "") -> str:
    group = f"le{', ' + by if by else ''}"
    return f"histogram_quantile({quantile}, sum by ({group}) (rate({histogram}_bucket[{WINDOW}])))"


def _mean(histogram: str, by: str) -> str:
    return (f"sum by ({by}) (rate({histogram}_sum[{WINDOW}])) / "
            f"sum by ({by}) (rate({histogram}_count[{WINDOW}]))")


# (row title, [(panel title, unit, [(expr, legend)], description)])
ROWS: list[tuple[str, list[tuple[str, str, list[tuple[str, str]], str]]]] = [
    ("Request layer: what users feel", [
        ("Requests by finish reason", "reqps",
         [(f"sum by (finish_reason) (rate(kvmesh_requests_total[{WINDOW}]))", "{{finish_reason}}")],
         "stop/length are served; timeout = the deadline passed (not an error); error = a failure."),
        ("Time to first token (from router arrival)", "s",
         [(_q(0.5, "kvmesh_time_to_first_token_seconds"), "p50"),
          (_q(0.99, "kvmesh_time_to_first_token_seconds"), "p99")],
         "Includes the router's admission wait: what the client waited for its first token."),
        ("Inter-token latency", "s",
         [(_q(0.5, "kvmesh_inter_token_latency_seconds"), "p50"),
          (_q(0.99, "kvmesh_inter_token_latency_seconds"), "p99")],
         "Mean gap between output tokens per request. Rising while throughput rises = batches too big."),
        ("Queue time: router admission and worker queue", "s",
         [(_q(0.99, "kvmesh_router_queue_time_seconds"), "router p99"),
          (_q(0.99, "kvmesh_request_queue_time_seconds"), "worker p99")],
         "Router: auth + quota + admission until dispatch. Worker: arrival until first scheduled."),
        ("End-to-end latency", "s",
         [(_q(0.5, "kvmesh_e2e_request_latency_seconds"), "p50"),
          (_q(0.99, "kvmesh_e2e_request_latency_seconds"), "p99")], ""),
        ("Rejections, timeouts, retries", "reqps",
         [(f"sum by (reason) (rate(kvmesh_rejections_total[{WINDOW}]))", "rejected: {{reason}}"),
          (f"sum by (stage) (rate(kvmesh_request_timeouts_total[{WINDOW}]))", "timeout: {{stage}}"),
          (f"sum(rate(kvmesh_retries_seen_total[{WINDOW}]))", "client retries")],
         "Overload rejections are load shedding; retries rising with them is a retry storm."),
        ("Model served", "none",
         [("max by (worker, model, revision, dtype, weight_quant, kv_cache_dtype, version) (kvmesh_model_info)",
           "{{worker}} {{model}}@{{revision}} {{dtype}} w:{{weight_quant}} kv:{{kv_cache_dtype}} v{{version}}")],
         "One series per worker: a mixed fleet shows as more than one label set."),
    ]),
    ("Batch layer: how full each step is", [
        ("Token fill rate (tokens / step budget)", "percentunit",
         [(_mean("kvmesh_step_token_fill_ratio", "worker"), "{{worker}}")],
         "Low with requests waiting = a budget, block or seq limit; low and nothing waiting = idle."),
        ("Tokens per step: prefill vs decode", "none",
         [(_mean("kvmesh_step_tokens", "worker, kind"), "{{worker}} {{kind}}")],
         "Big prefill chunks next to decodes stretch every decode step (ITL spikes)."),
        ("Batch size and waiting requests", "none",
         [("sum by (worker) (kvmesh_num_requests_running)", "{{worker}} running"),
          ("sum by (worker) (kvmesh_num_requests_waiting)", "{{worker}} waiting"),
          ("max by (worker) (kvmesh_batch_fill_ratio)", "{{worker}} running / max_num_seqs")], ""),
    ]),
    ("Compute layer: where step time goes", [
        ("Step time by phase (mean)", "s",
         [(_mean("kvmesh_step_phase_seconds", "phase"), "{{phase}}")],
         "schedule / prepare / forward / sample / output. Forward should dominate; if not, the "
         "engine's host overhead is the bottleneck."),
        ("Step time", "s",
         [(_q(0.5, "kvmesh_step_time_seconds", "worker"), "{{worker}} p50"),
          (_q(0.99, "kvmesh_step_time_seconds", "worker"), "{{worker}} p99")], ""),
        ("GPU utilisation and temperature", "percentunit",
         [("max by (worker) (kvmesh_gpu_utilization_ratio)", "{{worker}} util"),
          ("max by (worker) (kvmesh_gpu_temperature_celsius) / 100", "{{worker}} temp C / 100")],
         "From NVML on CUDA workers; empty on CPU workers."),
    ]),
    ("Memory layer: KV pool and device memory", [
        ("KV cache usage", "percentunit",
         [("max by (worker) (kvmesh_kv_cache_usage_ratio)", "{{worker}}")],
         "Blocks referenced by running requests / all blocks. Near 1 precedes preemption."),
        ("KV tokens: peak and mean over 30 s", "none",
         [("max by (worker) (kvmesh_kv_tokens_peak)", "{{worker}} peak"),
          ("max by (worker) (kvmesh_kv_tokens_mean)", "{{worker}} mean")],
         "Peak far above mean = bursty long prompts: size the pool for the peak."),
        ("Memory: allocated / reserved / peak", "bytes",
         [("max by (worker, rank) (kvmesh_memory_allocated_bytes)", "{{worker}}/{{rank}} allocated"),
          ("max by (worker, rank) (kvmesh_memory_reserved_bytes)", "{{worker}}/{{rank}} reserved"),
          ("max by (worker, rank) (kvmesh_memory_peak_bytes)", "{{worker}}/{{rank}} peak"),
          ("max by (worker) (kvmesh_kv_pool_bytes)", "{{worker}} KV pool")],
         "Reserved far above allocated = the caching allocator holds fragmented free memory."),
        ("OOMs and preemptions", "none",
         [(f"sum by (worker) (increase(kvmesh_oom_total[{WINDOW}]))", "{{worker}} OOM steps"),
          (f"sum by (worker, mode) (rate(kvmesh_preemptions_total[{WINDOW}]))", "{{worker}} preempt {{mode}}/s")],
         ""),
        ("KV blocks and fragmentation", "none",
         [("sum by (worker) (kvmesh_kv_blocks_used)", "{{worker}} used"),
          ("sum by (worker) (kvmesh_kv_blocks_cached)", "{{worker}} cached"),
          ("sum by (worker) (kvmesh_kv_blocks_free)", "{{worker}} free"),
          ("max by (worker) (kvmesh_kv_block_fragmentation_ratio)", "{{worker}} fragmentation")], ""),
    ]),
    ("Tenants: who uses what", [
        ("Compute seconds per tenant", "s",
         [(f"sum by (tenant, phase) (rate(kvmesh_tenant_compute_seconds_total[{WINDOW}]))", "{{tenant}} {{phase}}")],
         "Step time shared by each step's rows in proportion to their tokens: the cost basis."),
        ("Tokens per tenant", "none",
         [(f"sum by (tenant) (rate(kvmesh_prompt_tokens_total[{WINDOW}]))", "{{tenant}} prompt"),
          (f"sum by (tenant) (rate(kvmesh_generation_tokens_total[{WINDOW}]))", "{{tenant}} output"),
          (f"sum by (tenant) (rate(kvmesh_cached_prompt_tokens_total[{WINDOW}]))", "{{tenant}} cached")], ""),
        ("Quota store on local fallback", "none",
         [("max by (replica) (kvmesh_quota_store_fallback_active)", "{{replica}}")],
         "1 = Redis unreachable: limits are per replica, so tenants get up to N replicas x their quota."),
    ]),
    ("Routing: is the router's view of the caches true?", [
        ("Prefix cache hit rate", "percentunit",
         [(f"sum(rate(kvmesh_prefix_cache_hits_total[{WINDOW}])) / sum(rate(kvmesh_prefix_cache_queries_total"
           f"[{WINDOW}]))", "hit rate")], ""),
        ("Predicted vs hit prefix blocks", "none",
         [(f"sum(rate(kvmesh_route_predicted_prefix_blocks_total[{WINDOW}]))", "predicted"),
          (f"sum(rate(kvmesh_route_hit_prefix_blocks_total[{WINDOW}]))", "hit")],
         "Predicted above hit = stale prefix index (evictions the router has not heard of yet)."),
        ("Prediction error (predicted - hit blocks)", "none",
         [(_q(0.5, "kvmesh_route_prefix_blocks_error"), "p50"),
          (_q(0.99, "kvmesh_route_prefix_blocks_error"), "p99")], ""),
        ("Worker health and restarts", "none",
         [("min by (worker) (kvmesh_worker_healthy)", "{{worker}} healthy"),
          ("changes(kvmesh_worker_start_time_seconds[15m])", "{{worker}} restarts (15 m)")], ""),
    ]),
]


def build_dashboard() -> dict:
    panels: list[dict] = []
    y, panel_id = 0, 1
    for row_title, row_panels in ROWS:
        panels.append({"type": "row", "title": row_title, "id": panel_id, "collapsed": False,
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []})
        panel_id, y = panel_id + 1, y + 1
        for i, (title, unit, queries, description) in enumerate(row_panels):
            panels.append({
                "type": "timeseries", "title": title, "id": panel_id, "description": description,
                "datasource": DATASOURCE,
                "gridPos": {"h": 8, "w": 8, "x": 8 * (i % 3), "y": y + 8 * (i // 3)},
                "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
                "options": {"legend": {"displayMode": "list", "placement": "bottom"}},
                "targets": [{"refId": chr(ord("A") + j), "datasource": DATASOURCE, "expr": expr,
                             "legendFormat": legend} for j, (expr, legend) in enumerate(queries)],
            })
            panel_id += 1
        y += 8 * ((len(row_panels) + 2) // 3)
    return {
        "uid": UID, "title": "kvmesh", "tags": ["kvmesh", "llm-serving"], "timezone": "browser",
        "schemaVersion": 39, "version": 1, "editable": True, "refresh": "30s",
        "time": {"from": "now-1h", "to": "now"},
        "templating": {"list": [{"name": "datasource", "label": "Prometheus", "type": "datasource",
                                 "query": "prometheus", "current": {}, "hide": 0}]},
        "annotations": {"list": []},
        "panels": panels,
    }


def dashboard_json() -> str:
    return json.dumps(build_dashboard(), indent=2) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write the kvmesh Grafana dashboard (the chart's copy).")
    parser.add_argument("--stdout", action="store_true", help="print the JSON instead of rewriting the chart's copy")
    args = parser.parse_args(argv)
    text = dashboard_json()
    if args.stdout:
        sys.stdout.write(text)
        return
    CHART_COPY.parent.mkdir(parents=True, exist_ok=True)
    CHART_COPY.write_text(text)
    print(f"wrote {CHART_COPY}")


if __name__ == "__main__":
    main()
