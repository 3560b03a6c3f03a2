"""The report's plots, each rendered to a base64 PNG (matplotlib, Agg backend, no display).

Each function takes the campaign results dict and returns a PNG or None when it has no
data to show (e.g. no rate sweep, no server samples); `all_plots` keeps the non-empty ones.
"""

from __future__ import annotations

import base64
import io
import logging
from collections import defaultdict

import numpy as np

logger = logging.getLogger(__name__)


def _png(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    import matplotlib.pyplot as plt
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _completed(run: dict) -> list[dict]:
    return [r for r in run["records"] if r["status"] == "ok"]


def latency_cdfs(results: dict) -> str | None:
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
    drawn = False
    for run in results["runs"]:
        recs = _completed(run)
        for ax, key in zip(axes, ("ttft_s", "tpot_s", "e2e_s")):
            values = np.sort([r[key] * 1000 for r in recs if r.get(key) is not None])
            if len(values):
                ax.step(values, np.arange(1, len(values) + 1) / len(values), where="post", label=run["name"])
                drawn = True
    for ax, title in zip(axes, ("TTFT", "TPOT", "E2E latency")):
        ax.set_title(f"{title} CDF")
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    return _png(fig) if drawn else (plt.close(fig) or None)


def throughput_vs_rate(results: dict) -> str | None:
    """Output throughput and goodput vs offered request rate, one line per swept config."""
    import matplotlib.pyplot as plt

    series = defaultdict(list)
    for run in results["runs"]:
        rates = [a.get("rate") for a in run.get("arrival", [])]
        if len(rates) == 1 and rates[0] is not None:
            series[run.get("label", run["name"])].append((rates[0], run["summary"]))
    series = {k: sorted(v, key=lambda p: p[0]) for k, v in series.items() if len(v) >= 2}
    if not series:
        return None
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.8))
    for label, points in series.items():
        rates = [p[0] for p in points]
        ax1.plot(rates, [p[1]["output_token_throughput"] for p in points], marker="o", label=label)
        ax2.plot(rates, [p[1]["request_throughput"] for p in points], marker="o", label=f"{label} throughput")
        if any(p[1].get("goodput") is not None for p in points):
            ax2.plot(rates, [p[1].get("goodput") or 0 for p in points], marker="x", ls="--", label=f"{label} goodput")
    ax1.set(title="output tokens/s vs request rate", xlabel="offered req/s", ylabel="tokens/s")
    ax2.set(title="throughput and goodput vs request rate", xlabel="offered req/s", ylabel="req/s")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return _png(fig)


def percentile_bars(results: dict) -> str | None:
    """TTFT and TPOT P50/P90/P99 per run, side by side."""
    import matplotlib.pyplot as plt

    runs = [r for r in results["runs"] if r["summary"]["ttft"]["count"]]
    if not runs:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(12, 3.8))
    pcts = ("p50_ms", "p90_ms", "p99_ms")
    width = 0.8 / len(pcts)
    x = np.arange(len(runs))
    for ax, metric in zip(axes, ("ttft", "tpot")):
        for i, p in enumerate(pcts):
            ax.bar(x + i * width, [r["summary"][metric][p] or 0 for r in runs], width, label=p[:-3].upper())
        ax.set_xticks(x + width, [r["name"] for r in runs], rotation=20, ha="right", fontsize=7)
        ax.set(title=f"{metric.upper()} percentiles", ylabel="ms")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3, axis="y")
    return _png(fig)


def server_timeline(results: dict) -> str | None:
    """KV usage and queue length (running / waiting) over time, from server samples."""
    import matplotlib.pyplot as plt

    runs = [r for r in results["runs"] if r.get("server_samples")]
    if not runs:
        return None
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 3.8))
    for run in runs:
        s = run["server_samples"]
        t = [x["t_s"] for x in s]
        if any("kv_usage" in x for x in s):
            ax1.plot(t, [x.get("kv_usage", np.nan) * 100 for x in s], label=run["name"])
        if any("num_waiting" in x for x in s):
            ax2.plot(t, [x.get("num_waiting", np.nan) for x in s], label=f"{run['name']} waiting")
        if any("num_running" in x for x in s):
            ax2.plot(t, [x.get("num_running", np.nan) for x in s], ls=":", label=f"{run['name']} running")
    ax1.set(title="KV cache usage", xlabel="s since run start", ylabel="% of blocks")
    ax2.set(title="queue: waiting (solid) / running (dotted)", xlabel="s since run start", ylabel="requests")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    return _png(fig)


def fault_timeline(results: dict) -> str | None:
    """Per chaos run: tokens the clients received per second, each fault a line, its recovery
    (fault -> whole again) a shaded span."""
    import matplotlib.pyplot as plt

    runs = [r for r in results["runs"] if r.get("chaos")]
    if not runs:
        return None
    fig, axes = plt.subplots(len(runs), 1, figsize=(12, 3.2 * len(runs)), squeeze=False)
    for ax, run in zip(axes[:, 0], runs):
        times = [t for rec in run["records"] for t in rec.get("delta_times_s") or ()]
        if times:
            ax.hist(times, bins=np.arange(0, max(times) + 1.0, 1.0), color="#4477aa", label="deltas received / s")
        for row in run["chaos"]["faults"]:
            if row.get("at_s") is None:
                continue
            ax.axvline(row["at_s"], color="#b00", lw=1)
            if row.get("recovery_s") is not None:
                ax.axvspan(row["at_s"], row["at_s"] + row["recovery_s"], color="#b00", alpha=0.12)
            ax.annotate(row["kind"], (row["at_s"], 1), xycoords=("data", "axes fraction"), rotation=90,
                        va="top", ha="right", fontsize=6)
        ax.set(title=f"{run['name']}: faults (red) and recovery (shaded)", xlabel="s since run start",
               ylabel="deltas / s")
        ax.grid(alpha=0.3)
    return _png(fig)


def all_plots(results: dict) -> list[tuple[str, str]]:
    """[(title, base64 png)] for every plot that has data; [] without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
    except ImportError:
        logger.warning("matplotlib is not installed: report.html has no plots (pip install matplotlib)")
        return []
    out = []
    for title, fn in (("Latency CDFs", latency_cdfs), ("Throughput and goodput vs request rate", throughput_vs_rate),
                      ("TTFT / TPOT percentiles per run", percentile_bars),
                      ("KV usage and queue length over time", server_timeline),
                      ("Faults and recovery over time", fault_timeline)):
        png = fn(results)
        if png:
            out.append((title, png))
    return out
