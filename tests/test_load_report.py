"""Reports from results: valid JSON, HTML with embedded plots, a markdown table, checks,
comparisons of two result directories, and the `kvmesh load report|compare` commands."""

import json
from html.parser import HTMLParser

import numpy as np
import pytest

from kvmesh.deploy.cli import main
from kvmesh.load_tests.metrics import SLO, RequestRecord, summarize
from kvmesh.load_tests.report import (compare_results, evaluate_checks, load_results, lookup, markdown_compare,
                                      markdown_summary, write_reports)
from kvmesh.core.errors import InvalidRequestError


def _run(name, rate, ttft_s, tpot_s, n=20, label=None, seed=0):
    """A run result with n requests of 8 tokens at the given latencies (+ seeded noise)."""
    rng = np.random.default_rng(seed)
    records = []
    for i in range(n):
        send = i / rate
        first = send + ttft_s * (1 + 0.2 * rng.random())
        deltas = tuple(first + k * tpot_s for k in range(8))
        records.append(RequestRecord(index=i, tenant_id="t", prompt_tokens=16, expected_output_tokens=8, send_s=send,
                                     status="ok", output_tokens=8, first_token_s=first, end_s=deltas[-1],
                                     delta_times_s=deltas))
    samples = [{"t_s": t, "kv_usage": 0.1 * t, "num_running": 2.0, "num_waiting": float(t > 1)} for t in (0, 1, 2)]
    return {"name": name, "label": label or name, "target": {"kind": "engine"}, "config": {},
            "arrival": [{"process": "poisson", "rate": rate, "label": f"poisson {rate}/s"}], "tenants": ["t"],
            "retry": "none", "summary": summarize(records, SLO(ttft_ms=300)).to_json(),
            "records": [r.to_json() for r in records], "server_samples": samples,
            "final_server_sample": {"t_s": 3.0, "kv_usage": 0.0, "kv_tokens_used": 0.0}}


@pytest.fixture
def results():
    return {"campaign": "demo", "description": "a <b>synthetic</b> campaign", "created_at": 0.0, "source": {},
            "checks": [{"run": "fast@4", "metric": "ttft.p99_ms", "op": "<=", "baseline": "slow@4", "ratio": 0.5},
                       {"run": "fast@4", "metric": "final.kv_tokens_used", "op": "==", "value": 0},
                       {"run": "slow@4", "metric": "output_token_throughput", "op": ">", "baseline": "fast@4"},
                       {"run": "missing", "metric": "ttft.p99_ms", "op": "<=", "value": 1}],
            "runs": [_run("fast@2", 2, 0.1, 0.01, label="fast"), _run("fast@4", 4, 0.1, 0.01, label="fast"),
                     _run("slow@2", 2, 0.5, 0.05, label="slow"), _run("slow@4", 4, 0.5, 0.05, label="slow")]}


class _Checker(HTMLParser):
    VOID = {"meta", "img", "br", "hr", "link", "input"}

    def __init__(self):
        super().__init__()
        self.stack, self.imgs, self.errors = [], [], []

    def handle_starttag(self, tag, attrs):
        if tag == "img":
            self.imgs.append(dict(attrs))
        elif tag not in self.VOID:
            self.stack.append(tag)

    def handle_endtag(self, tag):
        if tag in self.VOID:
            return
        if not self.stack or self.stack.pop() != tag:
            self.errors.append(tag)


def test_reports_are_valid_html_json_and_markdown(results, tmp_path):
    write_reports(results, tmp_path)
    assert load_results(tmp_path)["runs"][0]["name"] == "fast@2"
    json.loads((tmp_path / "results.json").read_text())

    checker = _Checker()
    page = (tmp_path / "report.html").read_text()
    checker.feed(page)
    assert checker.errors == [] and checker.stack == []
    # CDFs, throughput vs rate (two swept configs), percentile bars, server timeline.
    assert len(checker.imgs) == 4
    assert all(img["src"].startswith("data:image/png;base64,iVBOR") for img in checker.imgs)
    assert "&lt;b&gt;synthetic&lt;/b&gt;" in page  # text is escaped

    md = (tmp_path / "summary.md").read_text()
    table = [line for line in md.splitlines() if line.startswith("| ")]
    assert len(table) == 1 + 4  # header + one row per run
    assert all(line.count("|") == table[0].count("|") for line in table)
    goodput = results["runs"][0]["summary"]["goodput"]
    # The headline comes first: goodput, shed rate, retry-after accuracy (no retries: "-").
    assert table[0].startswith("| run | arrival | goodput req/s | shed | retry-after ok | done |")
    assert f"| fast@2 | poisson 2/s | {goodput:.2f} | 0% | - | 20 | 0 | 0 | 0 |" in md


def test_per_tenant_table_for_multi_tenant_runs(results, tmp_path, monkeypatch):
    # Plots are covered above; skipping them here keeps this test fast on a busy CPU.
    monkeypatch.setattr("kvmesh.load_tests.plots.all_plots", lambda results: [])
    run = results["runs"][0]
    run["summary_by_tenant"] = {"heavy": run["summary"], "light": results["runs"][2]["summary"]}
    md = markdown_summary(results)
    assert "## Per tenant" in md
    heavy, light = (results["runs"][i]["summary"]["goodput"] for i in (0, 2))
    assert f"| fast@2 | heavy | {heavy:.2f} | 0% | - | 20 | 0 | 0 |" in md
    assert f"| fast@2 | light | {light:.2f} | 0% | - | 20 | 0 | 0 |" in md
    write_reports(results, tmp_path)
    checker = _Checker()
    checker.feed((tmp_path / "report.html").read_text())
    assert checker.errors == [] and checker.stack == []
    assert "<td>light</td>" in (tmp_path / "report.html").read_text()


def test_checks_compare_runs_and_fail_on_missing_data(results):
    outcome = [c["passed"] for c in evaluate_checks(results)]
    assert outcome == [True, True, False, False]
    md = markdown_summary(results)
    assert md.count("PASS") == 2 and md.count("FAIL") == 2


def test_lookup_paths(results):
    run = results["runs"][0]
    assert lookup(run, "summary.completed") == 20 == lookup(run, "completed")
    assert lookup(run, "peak.kv_usage") == pytest.approx(0.2)
    assert lookup(run, "final.kv_tokens_used") == 0.0
    assert lookup(run, "nope.nothing") is None


def test_compare_gives_ratios(results, tmp_path):
    a, b = results, json.loads(json.dumps(results))
    b["runs"] = [_run("fast@2", 2, 0.2, 0.02, label="fast")]  # twice as slow
    rows = {(r["run"], r["metric"]): r for r in compare_results(a, b)}
    assert set(r for r, _ in rows) == {"fast@2"}
    ttft = rows[("fast@2", "ttft.p50_ms")]
    assert ttft["ratio"] == pytest.approx(2.0, rel=0.2) and ttft["better"] == "A"
    assert rows[("fast@2", "failed")]["ratio"] is None  # 0 -> 0 has no ratio
    assert "| fast@2 | ttft.p50_ms |" in markdown_compare(a, b)


def test_cli_report_and_compare(results, tmp_path, capsys):
    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):  # what `kvmesh load run` leaves when interrupted: results.json only
        d.mkdir()
        (d / "results.json").write_text(json.dumps(results))
    assert main(["load", "report", str(a)]) == 0
    assert (a / "report.html").exists()
    assert main(["load", "compare", str(a), str(b), "--out", str(tmp_path / "cmp.md")]) == 0
    assert "| fast@2 | output_token_throughput | " in (tmp_path / "cmp.md").read_text()
    assert "1.000" in capsys.readouterr().out  # identical runs: ratio 1
    assert main(["load", "report", str(tmp_path / "nothing")]) == 2


def test_load_results_rejects_other_files(tmp_path):
    (tmp_path / "results.json").write_text("[1, 2]")
    with pytest.raises(InvalidRequestError):
        load_results(tmp_path)


def test_a_check_may_compare_a_tenant_row_with_another_runs_summary(results):
    run = results["runs"][0]
    run["summary_by_tenant"] = {"high": results["runs"][2]["summary"]}  # slow@2's figures
    results["checks"] = [{"run": "fast@2", "metric": "summary_by_tenant.high.ttft.p99_ms", "op": "<=",
                          "baseline": "fast@4", "baseline_metric": "ttft.p99_ms", "ratio": 2.0}]
    (check,) = evaluate_checks(results)
    assert check["expected"] == pytest.approx(2.0 * results["runs"][1]["summary"]["ttft"]["p99_ms"])
    assert check["passed"] is False  # slow's TTFT (~0.5 s) is more than twice fast's (~0.1 s)
    assert "2.0 x fast@4 ttft.p99_ms" in markdown_summary(results)
