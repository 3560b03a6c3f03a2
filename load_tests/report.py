"""Reports people can read, from a campaign's results.json:

  summary.md    one table row per run, headed by goodput, shed rate and retry-after accuracy
                (what the run delivered and what it refused to get there), then throughput,
                TTFT/TPOT/E2E percentiles, errors, retries; per-tenant rows the same way;
                and the campaign's checks, pass or fail
  report.html   the same table plus plots embedded as base64 PNGs (matplotlib): latency
                CDFs, throughput and goodput vs request rate, TTFT/TPOT percentiles per
                run side by side, KV usage and queue length over time
  compare       two result directories -> per-run ratios (B / A) as markdown
"""

from __future__ import annotations

import html
import json
import logging
import math
import operator
from pathlib import Path

from kvmesh.load_tests import plots
from kvmesh.core.errors import InvalidRequestError

logger = logging.getLogger(__name__)

# (column header, path into a run's result, format)
SUMMARY_COLUMNS = (
    ("run", "name", "{}"),
    ("arrival", "arrival_label", "{}"),
    ("goodput req/s", "summary.goodput", "{:.2f}"),
    ("shed", "summary.shed_rate", "{:.0%}"),
    ("retry-after ok", "summary.retry_after_accuracy", "{:.0%}"),
    ("done", "summary.completed", "{}"),
    ("failed", "summary.failed", "{}"),
    ("cancelled", "summary.cancelled", "{}"),
    ("retries", "summary.retries", "{}"),
    ("req/s", "summary.request_throughput", "{:.2f}"),
    ("out tok/s", "summary.output_token_throughput", "{:.1f}"),
    ("TTFT p50 ms", "summary.ttft.p50_ms", "{:.0f}"),
    ("TTFT p99 ms", "summary.ttft.p99_ms", "{:.0f}"),
    ("TPOT p50 ms", "summary.tpot.p50_ms", "{:.1f}"),
    ("TPOT p99 ms", "summary.tpot.p99_ms", "{:.1f}"),
    ("ITL p99 ms", "summary.itl.p99_ms", "{:.1f}"),
    ("E2E mean ms", "summary.e2e.mean_ms", "{:.0f}"),
    ("E2E p99 ms", "summary.e2e.p99_ms", "{:.0f}"),
    ("max KV use", "peak.kv_usage", "{:.0%}"),
    ("preemptions", "final.num_preemptions", "{:.0f}"),
    ("KV tokens after", "final.kv_tokens_used", "{:.0f}"),
    ("valid outputs", "summary.structured_valid_rate", "{:.0%}"),  # structured-output runs only
)

# Metrics `compare` reports, with whether higher is better (for the verdict column).
COMPARED_METRICS = (
    ("summary.goodput", True),
    ("summary.shed_rate", False),
    ("summary.retry_after_accuracy", True),
    ("summary.output_token_throughput", True),
    ("summary.request_throughput", True),
    ("summary.ttft.p50_ms", False),
    ("summary.ttft.p99_ms", False),
    ("summary.tpot.p50_ms", False),
    ("summary.tpot.p99_ms", False),
    ("summary.e2e.p99_ms", False),
    ("summary.failed", False),
)

_OPS = {">=": operator.ge, ">": operator.gt, "<=": operator.le, "<": operator.lt, "==": operator.eq}


def lookup(run: dict, path: str):
    """A dotted path into a run's result. Extra roots: `final.<key>` (the server sample after
    the run), `peak.<key>` (the maximum over the run's server samples), `arrival_label`."""
    if path == "arrival_label":
        return " + ".join(a["label"] for a in run.get("arrival", []))
    root, _, rest = path.partition(".")
    if root == "final":
        return (run.get("final_server_sample") or {}).get(rest)
    if root == "peak":
        values = [s[rest] for s in run.get("server_samples", []) if s.get(rest) is not None]
        return max(values) if values else None
    node = run
    if root not in run and root in run.get("summary", {}):
        node = run["summary"]  # `ttft.p99_ms` is short for `summary.ttft.p99_ms`
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _fmt(value, fmt: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    try:
        return fmt.format(value)
    except (ValueError, TypeError):
        return str(value)


def evaluate_checks(results: dict) -> list[dict]:
    """Each check -> {check, actual, expected, passed}. A missing run or metric fails."""
    runs = {r["name"]: r for r in results["runs"]}
    out = []
    for check in results.get("checks", []):
        run = runs.get(check.get("run"))
        actual = lookup(run, check["metric"]) if run else None
        if "baseline" in check:
            # baseline_metric: compare against another figure of the baseline run (a tenant's
            # row against a run where that tenant ran alone and has no per-tenant rows).
            base_run = runs.get(check["baseline"])
            base = lookup(base_run, check.get("baseline_metric", check["metric"])) if base_run else None
            expected = None if base is None else base * float(check.get("ratio", 1.0))
        else:
            expected = check.get("value")
        op = _OPS.get(check.get("op", ">="))
        passed = bool(op and actual is not None and expected is not None and op(actual, expected))
        out.append({"check": check, "actual": actual, "expected": expected, "passed": passed})
    return out


def describe_check(c: dict) -> str:
    chk = c["check"]
    base = chk.get("baseline", "")
    if "baseline_metric" in chk:
        base += f" {chk['baseline_metric']}"
    rhs = (f"{chk.get('ratio', 1.0)} x {base}" if "baseline" in chk else f"{chk.get('value')}")
    return f"{chk.get('run')}: {chk['metric']} {chk.get('op', '>=')} {rhs}"


def markdown_summary(results: dict) -> str:
    lines = [f"# Load campaign: {results['campaign']}", ""]
    if results.get("description"):
        lines += [results["description"].strip(), ""]
    lines.append("| " + " | ".join(c[0] for c in SUMMARY_COLUMNS) + " |")
    lines.append("|" + "---|" * len(SUMMARY_COLUMNS))
    for run in results["runs"]:
        lines.append("| " + " | ".join(_fmt(lookup(run, path), fmt) for _, path, fmt in SUMMARY_COLUMNS) + " |")
    lines += _tenant_table(results)
    lines += [line for run in results["runs"] for line in ("", rate_of_line(run)) if rate_of_line(run)]
    errors = [(run["name"], run["summary"]["errors_by_code"]) for run in results["runs"] if run["summary"]["errors_by_code"]]
    if errors:
        lines += ["", "Errors by code: " + "; ".join(f"{n}: {e}" for n, e in errors)]
    lines += _chaos_tables(results)
    for skipped in results.get("skipped", []):
        lines += ["", f"Skipped run {skipped['name']}: {skipped['reason']}"]
    checks = evaluate_checks(results)
    if checks:
        lines += ["", "## Checks", ""]
        for c in checks:
            mark = "PASS" if c["passed"] else "FAIL"
            lines.append(f"- {mark}: {describe_check(c)} (actual {_fmt(c['actual'], '{:.4g}')}, "
                         f"expected {_fmt(c['expected'], '{:.4g}')})")
    return "\n".join(lines) + "\n"


TENANT_COLUMNS = (("goodput req/s", "goodput", "{:.2f}"), ("shed", "shed_rate", "{:.0%}"),
                  ("retry-after ok", "retry_after_accuracy", "{:.0%}"), ("done", "completed", "{}"), ("failed", "failed", "{}"), ("retries", "retries", "{}"),
                  ("out tok/s", "output_token_throughput", "{:.1f}"), ("TTFT p50 ms", "ttft.p50_ms", "{:.0f}"),
                  ("TTFT p99 ms", "ttft.p99_ms", "{:.0f}"), ("TPOT p50 ms", "tpot.p50_ms", "{:.1f}"),
                  ("E2E p99 ms", "e2e.p99_ms", "{:.0f}"))


def rate_of_line(run: dict) -> str:
    """A run whose rate was taken from an earlier run (campaign.py `rate_of`): what it was
    offered and what it completed, as fractions of that run's throughput; "" otherwise."""
    taken = run.get("rate_of")
    if not taken:
        return ""
    return (f"Run {run['name']}: offered {taken['fraction']:g} x run {taken['run']}'s "
            f"{taken['baseline_request_throughput']:.3f} req/s = {taken['rate']:.3f} req/s; completed "
            f"{run['summary']['request_throughput']:.3f} req/s = {taken['achieved_fraction']:.2f}x {taken['run']}.")


def _tenant_table(results: dict) -> list[str]:
    """Per-tenant rows for runs with several tenants (markdown lines; [] when none)."""
    rows = []
    for run in results["runs"]:
        for tenant, summary in (run.get("summary_by_tenant") or {}).items():
            cells = [_fmt(lookup({"summary": summary}, f"summary.{p}"), f) for _, p, f in TENANT_COLUMNS]
            rows.append(f"| {run['name']} | {tenant} | " + " | ".join(cells) + " |")
    if not rows:
        return []
    head = "| run | tenant | " + " | ".join(c[0] for c in TENANT_COLUMNS) + " |"
    return ["", "## Per tenant", "", head, "|" + "---|" * (len(TENANT_COLUMNS) + 2), *rows]


# The chaos table (load_tests/chaos.py): one row per fault of a run with a `faults` section.
CHAOS_COLUMNS = (("#", "index", "{}"), ("fault", "kind", "{}"), ("at s", "at_s", "{:.1f}"), ("hit", "target", "{}"),
                 ("in flight", "in_flight", "{}"), ("failed", "failed", "{}"), ("missing", "missing", "{}"),
                 ("repeated", "repeated", "{}"), ("diverged", "diverged", "{}"),
                 ("recovered in s", "recovery_s", "{:.1f}"), ("error", "error", "{}"))


def _chaos_tables(results: dict) -> list[str]:
    """Per chaos run: its faults, one row each, and the totals line (markdown; [] when none)."""
    lines = []
    for run in results["runs"]:
        chaos = run.get("chaos")
        if not chaos:
            continue
        t = chaos["totals"]
        lines += ["", f"## Faults: {run['name']}", "",
                  f"{t['faults']} faults ({t['faults_not_done']} not done, {t['not_recovered']} not recovered in "
                  f"time), {t['requests']} requests: {t['failed']} failed after the client's retries; "
                  f"{t['checked']} streams checked against greedy references: {t['ok']} exact, {t['missing']} "
                  f"missing tokens, {t['repeated']} repeated tokens, {t['diverged']} diverged; KV blocks in use at "
                  f"the end {t['kv_blocks_used_end']}; slowest recovery {_fmt(t['max_recovery_s'], '{:.1f}')} s.",
                  "", "| " + " | ".join(c[0] for c in CHAOS_COLUMNS) + " |", "|" + "---|" * len(CHAOS_COLUMNS)]
        for row in chaos["faults"]:
            lines.append("| " + " | ".join(_fmt(row.get(key), fmt) for _, key, fmt in CHAOS_COLUMNS) + " |")
    return lines


def _markdown_table_to_html(lines: list[str], title: str = "Per tenant") -> str:
    rows = [line.strip("|").split("|") for line in lines if line.startswith("| ")]
    if not rows:
        return ""
    cells = lambda row, tag: "".join(f"<{tag}>{html.escape(c.strip())}</{tag}>" for c in row)  # noqa: E731
    body = "".join(f"<tr>{cells(r, 'td')}</tr>" for r in rows[1:])
    return f"<h2>{html.escape(title)}</h2><table><thead><tr>{cells(rows[0], 'th')}</tr></thead><tbody>{body}</tbody></table>"


def _chaos_html(results: dict) -> str:
    """Each chaos run's totals line and fault table."""
    out, block = [], []
    for line in _chaos_tables(results) + [""]:
        if line.startswith("## ") or (not line and block and block[-1].startswith("| ")):
            if block:
                title = block[0][3:]
                prose = "".join(f"<p>{html.escape(b)}</p>" for b in block[1:] if b and not b.startswith("|"))
                out.append(_markdown_table_to_html(block, title).replace("</h2>", "</h2>" + prose, 1))
            block = [line] if line.startswith("## ") else []
        elif line or block:
            block.append(line)
    return "".join(out)


def html_report(results: dict) -> str:
    esc = html.escape
    head = "".join(f"<th>{esc(c[0])}</th>" for c in SUMMARY_COLUMNS)
    rows = "".join("<tr>" + "".join(f"<td>{esc(_fmt(lookup(run, p), f))}</td>" for _, p, f in SUMMARY_COLUMNS)
                   + "</tr>" for run in results["runs"])
    checks = "".join(f"<li class='{'pass' if c['passed'] else 'fail'}'>{'PASS' if c['passed'] else 'FAIL'}: "
                     f"{esc(describe_check(c))} (actual {esc(_fmt(c['actual'], '{:.4g}'))}, expected "
                     f"{esc(_fmt(c['expected'], '{:.4g}'))})</li>" for c in evaluate_checks(results))
    figures = "".join(f"<figure><img alt='{esc(title)}' src='data:image/png;base64,{png}'/>"
                      f"<figcaption>{esc(title)}</figcaption></figure>" for title, png in plots.all_plots(results))
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>kvmesh load: {esc(results['campaign'])}</title>
<style>body{{font-family:sans-serif;margin:2em}} table{{border-collapse:collapse}}
td,th{{border:1px solid #bbb;padding:3px 7px;text-align:right}} .pass{{color:#070}} .fail{{color:#b00}}
figure{{display:inline-block;margin:1em}} img{{max-width:640px}}</style></head>
<body><h1>Load campaign: {esc(results['campaign'])}</h1><p>{esc(results.get('description', ''))}</p>
<p>Metric definitions: docs/load-testing.md (TTFT, TPOT=(E2E-TTFT)/(output-1), ITL, E2E; ms).</p>
<table><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>
{_markdown_table_to_html(_tenant_table(results))}
{''.join(f"<p>{esc(rate_of_line(run))}</p>" for run in results["runs"] if rate_of_line(run))}
{_chaos_html(results)}
{''.join(f"<p>Skipped run {esc(s['name'])}: {esc(s['reason'])}</p>" for s in results.get('skipped', []))}
<h2>Checks</h2><ul>{checks or '<li>none</li>'}</ul>
<h2>Plots</h2>{figures or '<p>no plots (matplotlib missing or no data)</p>'}
</body></html>
"""


def write_reports(results: dict, out_dir: str | Path) -> None:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "summary.md").write_text(markdown_summary(results))
    (out / "report.html").write_text(html_report(results))


def load_results(result_dir: str | Path) -> dict:
    path = Path(result_dir) / "results.json"
    if not path.is_file():
        raise InvalidRequestError(f"{result_dir}: no results.json (not a load-test result directory)")
    data = json.loads(path.read_text())
    if not isinstance(data, dict) or "runs" not in data:
        raise InvalidRequestError(f"{path}: not a kvmesh load results file")
    return data


def compare_results(a: dict, b: dict) -> list[dict]:
    """Rows {run, metric, a, b, ratio (b/a), better} for runs present in both."""
    runs_b = {r["name"]: r for r in b["runs"]}
    rows = []
    for run_a in a["runs"]:
        run_b = runs_b.get(run_a["name"])
        if run_b is None:
            continue
        for path, higher_is_better in COMPARED_METRICS:
            va, vb = lookup(run_a, path), lookup(run_b, path)
            ratio = (vb / va) if (va not in (None, 0) and vb is not None) else None
            better = None
            if ratio is not None and ratio != 1.0:
                better = "B" if (ratio > 1.0) == higher_is_better else "A"
            rows.append({"run": run_a["name"], "metric": path.removeprefix("summary."), "a": va, "b": vb,
                         "ratio": ratio, "better": better})
    return rows


def markdown_compare(a: dict, b: dict, name_a: str = "A", name_b: str = "B") -> str:
    rows = compare_results(a, b)
    lines = [f"# Compare: A = {name_a}, B = {name_b}", "",
             "| run | metric | A | B | B/A | better |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['run']} | {r['metric']} | {_fmt(r['a'], '{:.4g}')} | {_fmt(r['b'], '{:.4g}')} | "
                     f"{_fmt(r['ratio'], '{:.3f}')} | {r['better'] or '-'} |")
    if not rows:
        lines.append("| (no run names in common) | | | | | |")
    return "\n".join(lines) + "\n"
