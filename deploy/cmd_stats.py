"""`kvmesh stats`: a live summary of a running cluster, scraped from the router's /metrics.

    kvmesh stats                                   # http://127.0.0.1:8000/metrics (router defaults)
    kvmesh stats --url http://router:8000/metrics
    kvmesh stats --config kvmesh.yaml --watch 2    # every 2 s until Ctrl-C

The router's /metrics already merges every replica and worker (router/metrics.py), so one
scrape is the whole cluster. Quantiles are estimated from histogram buckets the way
Prometheus' histogram_quantile does (linear inside the bucket), so they are approximate.
Exit codes: 0 printed, 1 the endpoint could not be scraped.
"""

from __future__ import annotations

import argparse
import sys
import time
import urllib.request
from dataclasses import dataclass, field

# Function-level imports: each `kvmesh` command imports only what it runs, so the CLI starts
# (and `--help` answers) without loading torch, Ray or transformers.

EXIT_UNREACHABLE = 1
QUANTILES = (0.5, 0.95, 0.99)

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def register(subparsers) -> None:
    p = subparsers.add_parser("stats", help="live summary of a running cluster (scrapes /metrics)",
                              description="Scrape the router's Prometheus /metrics and print requests, "
                                          "tokens, latency quantiles, rejections and per-worker KV use.")
    p.add_argument("--url", help="metrics URL (default: from --config's router host/http_port)")
    p.add_argument("--config", help="kvmesh YAML config, for the router address")
    p.add_argument("--watch", type=float, metavar="SECONDS", help="repeat every SECONDS until Ctrl-C")
    p.add_argument("--timeout", type=float, default=5.0, help="HTTP timeout, seconds")
    p.set_defaults(func=run)


@dataclass(frozen=True)
class StatsSummary:
    requests_by_reason: dict[str, float]
    prompt_tokens: float
    cached_prompt_tokens: float
    generation_tokens: float
    rejections: dict[str, float]
    retries_seen: float
    quota_fallback_replicas: int
    ttft_quantiles_s: dict[float, float | None]
    itl_quantiles_s: dict[float, float | None]
    e2e_quantiles_s: dict[float, float | None]
    workers: dict[str, dict[str, float]] = field(default_factory=dict)
    timeouts: dict[str, float] = field(default_factory=dict)  # stage -> count
    router_queue_quantiles_s: dict[float, float | None] = field(default_factory=dict)
    step_phase_mean_s: dict[str, float] = field(default_factory=dict)  # phase -> mean seconds per step
    mean_fill_ratio: float | None = None  # tokens per step / step token budget
    mean_step_tokens: dict[str, float] = field(default_factory=dict)  # prefill | decode -> mean per step
    tenant_compute_s: dict[str, dict[str, float]] = field(default_factory=dict)  # tenant -> phase -> seconds
    route_predicted_blocks: float = 0.0
    route_hit_blocks: float = 0.0

    @property
    def prefix_cache_hit_ratio(self) -> float | None:
        return self.cached_prompt_tokens / self.prompt_tokens if self.prompt_tokens else None


def scrape(url: str, timeout_s: float = 5.0) -> Samples:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=timeout_s) as resp:
        text = resp.read().decode()
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def _sum_by(samples: Samples, name: str, label: str | None = None) -> dict[str, float]:
    out: dict[str, float] = {}
    for (sample_name, labels), v in samples.items():
        if sample_name == name:
            key = dict(labels).get(label, "") if label else ""
            out[key] = out.get(key, 0.0) + v
    return out


def histogram_quantile(samples: Samples, name: str, q: float) -> float | None:
    """Prometheus' histogram_quantile over all label sets of `name`_bucket summed."""
    buckets: dict[float, float] = {}
    for (sample_name, labels), v in samples.items():
        if sample_name == name + "_bucket":
            le = float(dict(labels)["le"])
            buckets[le] = buckets.get(le, 0.0) + v
    if not buckets or buckets.get(float("inf"), 0.0) == 0:
        return None
    bounds = sorted(buckets)
    rank = q * buckets[bounds[-1]]
    prev_bound, prev_count = 0.0, 0.0
    for bound in bounds:
        count = buckets[bound]
        if count >= rank:
            if bound == float("inf"):
                return prev_bound  # above the largest finite bucket: its bound is all we know
            if count == prev_count:
                return bound
            return prev_bound + (bound - prev_bound) * (rank - prev_count) / (count - prev_count)
        prev_bound, prev_count = bound, count
    return prev_bound


_WORKER_GAUGES = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_ratio", "kv_blocks_used",
                  "kv_blocks_cached", "kv_blocks_free", "kv_block_fragmentation_ratio", "worker_healthy",
                  "memory_allocated_bytes", "memory_reserved_bytes", "memory_peak_bytes", "kv_pool_bytes",
                  "kv_tokens_peak", "kv_tokens_mean", "oom_total", "gpu_utilization_ratio",
                  "gpu_temperature_celsius")


def _mean(samples: Samples, name: str, label: str | None = None) -> dict[str, float]:
    """Per label value: histogram _sum / _count (the mean observation)."""
    sums, counts = _sum_by(samples, name + "_sum", label), _sum_by(samples, name + "_count", label)
    return {k: sums.get(k, 0.0) / n for k, n in counts.items() if n}


def summarize(samples: Samples) -> StatsSummary:
    def total(name: str) -> float:
        return sum(_sum_by(samples, name).values())

    workers: dict[str, dict[str, float]] = {}
    for gauge in _WORKER_GAUGES:
        for worker, v in _sum_by(samples, "kvmesh_" + gauge, "worker").items():
            workers.setdefault(worker, {})[gauge] = v
    tenant_compute: dict[str, dict[str, float]] = {}
    for (name, labels), v in samples.items():
        if name == "kvmesh_tenant_compute_seconds_total":
            d = dict(labels)
            tenant_compute.setdefault(d.get("tenant", ""), {})[d.get("phase", "")] = v
    return StatsSummary(
        requests_by_reason=_sum_by(samples, "kvmesh_requests_total", "finish_reason"),
        prompt_tokens=total("kvmesh_prompt_tokens_total"),
        cached_prompt_tokens=total("kvmesh_cached_prompt_tokens_total"),
        generation_tokens=total("kvmesh_generation_tokens_total"),
        rejections=_sum_by(samples, "kvmesh_rejections_total", "reason"),
        retries_seen=total("kvmesh_retries_seen_total"),
        quota_fallback_replicas=int(total("kvmesh_quota_store_fallback_active")),
        ttft_quantiles_s={q: histogram_quantile(samples, "kvmesh_time_to_first_token_seconds", q) for q in QUANTILES},
        itl_quantiles_s={q: histogram_quantile(samples, "kvmesh_inter_token_latency_seconds", q) for q in QUANTILES},
        e2e_quantiles_s={q: histogram_quantile(samples, "kvmesh_e2e_request_latency_seconds", q) for q in QUANTILES},
        workers=workers,
        timeouts=_sum_by(samples, "kvmesh_request_timeouts_total", "stage"),
        router_queue_quantiles_s={q: histogram_quantile(samples, "kvmesh_router_queue_time_seconds", q)
                                  for q in QUANTILES},
        step_phase_mean_s=_mean(samples, "kvmesh_step_phase_seconds", "phase"),
        mean_fill_ratio=_mean(samples, "kvmesh_step_token_fill_ratio").get(""),
        mean_step_tokens=_mean(samples, "kvmesh_step_tokens", "kind"),
        tenant_compute_s=tenant_compute,
        route_predicted_blocks=total("kvmesh_route_predicted_prefix_blocks_total"),
        route_hit_blocks=total("kvmesh_route_hit_prefix_blocks_total"),
    )


def _fmt_quantiles(qs: dict[float, float | None]) -> str:
    return "  ".join(f"p{int(q * 100)} {'-' if v is None else f'{v * 1000:.1f} ms'}" for q, v in qs.items())


def format_summary(s: StatsSummary) -> str:
    hit = "-" if s.prefix_cache_hit_ratio is None else f"{s.prefix_cache_hit_ratio:.1%}"
    reasons = ", ".join(f"{k} {int(v)}" for k, v in sorted(s.requests_by_reason.items())) or "none"
    rejected = ", ".join(f"{k} {int(v)}" for k, v in sorted(s.rejections.items()))
    lines = [
        f"requests        {int(sum(s.requests_by_reason.values()))} ({reasons})",
        f"prompt tokens   {int(s.prompt_tokens)} (prefix cache hit {hit})",
        f"output tokens   {int(s.generation_tokens)}",
        f"rejections      {rejected or 'none'}; retries seen {int(s.retries_seen)}",
        f"TTFT            {_fmt_quantiles(s.ttft_quantiles_s)}",
        f"ITL             {_fmt_quantiles(s.itl_quantiles_s)}",
        f"e2e latency     {_fmt_quantiles(s.e2e_quantiles_s)}",
    ]
    timeouts = ", ".join(f"{k} {int(v)}" for k, v in sorted(s.timeouts.items()))
    lines += [
        f"timeouts        {timeouts or 'none'} (not counted as errors)",
        f"router queue    {_fmt_quantiles(s.router_queue_quantiles_s)}",
        "step phases     " + ("  ".join(f"{p} {v * 1000:.2f} ms" for p, v in s.step_phase_mean_s.items()) or "-"),
        "batch           " + ("-" if s.mean_fill_ratio is None else
                              f"token fill {s.mean_fill_ratio:.1%}, per step prefill "
                              f"{s.mean_step_tokens.get('prefill', 0):.1f} / decode "
                              f"{s.mean_step_tokens.get('decode', 0):.1f} tokens"),
        f"routing truth   predicted {int(s.route_predicted_blocks)} prefix blocks, hit {int(s.route_hit_blocks)}",
    ]
    for tenant, phases in sorted(s.tenant_compute_s.items()):
        lines.append(f"tenant {tenant:<9}prefill {phases.get('prefill', 0):.3f} s, decode "
                     f"{phases.get('decode', 0):.3f} s of compute")
    if s.quota_fallback_replicas:
        lines.append(f"QUOTA FALLBACK  {s.quota_fallback_replicas} replica(s) on local limits (Redis unreachable)")
    lines.append(f"{'worker':<16}{'healthy':>8}{'running':>9}{'waiting':>9}{'kv use':>8}"
                 f"{'used':>7}{'cached':>8}{'free':>7}{'frag':>7}")
    for worker, g in sorted(s.workers.items()):
        lines.append(f"{worker:<16}{'yes' if g.get('worker_healthy') else 'NO':>8}"
                     f"{int(g.get('num_requests_running', 0)):>9}{int(g.get('num_requests_waiting', 0)):>9}"
                     f"{g.get('kv_cache_usage_ratio', 0):>8.1%}{int(g.get('kv_blocks_used', 0)):>7}"
                     f"{int(g.get('kv_blocks_cached', 0)):>8}{int(g.get('kv_blocks_free', 0)):>7}"
                     f"{g.get('kv_block_fragmentation_ratio', 0):>7.1%}")
    lines.append(f"{'memory':<16}{'alloc MiB':>10}{'resv MiB':>10}{'peak MiB':>10}{'KV MiB':>8}"
                 f"{'KV tok pk':>10}{'KV tok avg':>11}{'OOM':>5}{'GPU util':>9}{'GPU C':>6}")
    for worker, g in sorted(s.workers.items()):
        gpu = ((f"{g['gpu_utilization_ratio']:>9.0%}{g['gpu_temperature_celsius']:>6.0f}")
               if "gpu_utilization_ratio" in g else f"{'-':>9}{'-':>6}")
        lines.append(f"{worker:<16}{g.get('memory_allocated_bytes', 0) / 2**20:>10.1f}"
                     f"{g.get('memory_reserved_bytes', 0) / 2**20:>10.1f}{g.get('memory_peak_bytes', 0) / 2**20:>10.1f}"
                     f"{g.get('kv_pool_bytes', 0) / 2**20:>8.1f}{int(g.get('kv_tokens_peak', 0)):>10}"
                     f"{g.get('kv_tokens_mean', 0):>11.1f}{int(g.get('oom_total', 0)):>5}" + gpu)
    return "\n".join(lines)


def _metrics_url(args: argparse.Namespace) -> str:
    if args.url:
        return args.url
    from kvmesh.core.config import KvmeshConfig

    router = KvmeshConfig.from_yaml(args.config).router if args.config else KvmeshConfig().router
    return f"http://{router.host}:{router.http_port}/metrics"


def run(args: argparse.Namespace) -> int:
    url = _metrics_url(args)
    while True:
        try:
            summary = summarize(scrape(url, args.timeout))
        except OSError as exc:
            print(f"kvmesh stats: cannot scrape {url}: {exc}", file=sys.stderr)
            return EXIT_UNREACHABLE
        print(format_summary(summary), flush=True)
        if not args.watch:
            return 0
        time.sleep(args.watch)
        print()
