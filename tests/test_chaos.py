"""The chaos campaign without a cluster: the fault schedule and its YAML section, the stream
check against greedy references (a corrupted record must be caught), the per-fault report,
and the scheduler driving a load and a stand-in cluster on time. The real faults on a real
cluster: tests/test_chaos_e2e.py."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from pathlib import Path

import pytest

from kvmesh.core.errors import InvalidRequestError
from kvmesh.load_tests import chaos
from kvmesh.load_tests.arrivals import ArrivalSpec
from kvmesh.load_tests.campaign import RateOf, load_campaign, parse_campaign, resolve_rate
from kvmesh.load_tests.driver import DriverRetryPolicy, RunDriver, TenantStream
from kvmesh.load_tests.faults import FAULT_KINDS, FaultOutcome, FaultPlan
from kvmesh.load_tests.metrics import STATUS_ERROR, STATUS_OK, RequestRecord
from kvmesh.load_tests import report as report_module
from kvmesh.load_tests.report import markdown_summary
from kvmesh.load_tests.targets import StreamChunk, Target
from kvmesh.load_tests.token_check import compare_stream
from kvmesh.load_tests.workloads import WorkloadRequest

CAMPAIGNS = Path(__file__).resolve().parents[1] / "load_tests" / "campaigns"
REFERENCE = list(range(500, 540))


def test_the_schedule_takes_the_kinds_in_turn_every_interval():
    plan = FaultPlan(kinds=("kill_worker", "redis_stop", "redis_restart"), every_s=30, start_s=10)
    planned = plan.planned(100.0)
    assert [(f.kind, f.at_s) for f in planned] == [("kill_worker", 10), ("redis_stop", 40), ("redis_restart", 70)]
    assert [f.index for f in FaultPlan(kinds=("kill_worker",), every_s=1, count=4).schedule()] == [0, 1, 2, 3]
    assert FaultPlan(every_s=5).planned(11.0)[0].at_s == 5  # start_s defaults to every_s


@pytest.mark.parametrize("section, message", [
    ({"kinds": ["kill_everything"]}, "unknown"),
    ({"every_s": 0}, "every_s"),
    ({"count": 0}, "count"),
    ({"drain_hold_s": -1}, "drain_hold_s"),
    ({"sometimes": True}, "unknown field"),
])
def test_a_bad_faults_section_is_refused_at_load(section, message):
    run = {"name": "chaos", "target": {"kind": "cluster", "redis": True}, "faults": section}
    with pytest.raises(InvalidRequestError, match=message):
        parse_campaign({"runs": [run]})


def test_faults_need_a_cluster_target_and_redis_kinds_its_own_redis():
    with pytest.raises(InvalidRequestError, match="cluster"):
        parse_campaign({"runs": [{"name": "x", "target": {"kind": "engine"}, "faults": {"kinds": ["kill_worker"]}}]})
    with pytest.raises(InvalidRequestError, match="redis: true"):
        parse_campaign({"runs": [{"name": "x", "target": {"kind": "cluster"}, "faults": {"kinds": ["redis_stop"]}}]})


@pytest.mark.parametrize("name, minutes, each_kind", [("chaos.yaml", 10, 2), ("chaos-short.yaml", 2, 1)])
def test_the_shipped_chaos_campaigns_plan_every_kind(name, minutes, each_kind):
    """The issue's run: 10 minutes with a fault every 30 s, each kind at least twice; the
    short variant each kind once."""
    campaign = load_campaign(CAMPAIGNS / name)
    run = next(r for r in campaign.runs if r.faults is not None)
    duration_s = run.streams[0].arrival.duration_s
    assert duration_s == minutes * 60
    counts = Counter(f.kind for f in run.faults.planned(duration_s))
    assert set(counts) == set(FAULT_KINDS) and min(counts.values()) >= each_kind, counts
    assert run.target_options.get("client_retries") and run.target_options.get("redis")
    assert run.rate_of == RateOf("capacity", 0.7)  # ~70% of what this machine's capacity run completed


def _rate_campaign(chaos_run: dict, arrival: dict | None = None) -> dict:
    return {"defaults": {"arrival": arrival or {"process": "poisson", "rate": 9.0, "seed": 3}},
            "runs": [{"name": "capacity", "arrival": {"process": "closed", "concurrency": 4}},
                     {"name": "chaos", **chaos_run}]}


def test_a_run_takes_its_rate_as_a_fraction_of_an_earlier_runs_throughput():
    campaign = parse_campaign(_rate_campaign({"rate_of": {"run": "capacity", "fraction": 0.7}}))
    capacity, plan = campaign.runs
    assert capacity.rate_of is None and plan.rate_of == RateOf("capacity", 0.7)
    done = [{"name": "capacity", "summary": {"request_throughput": 2.0}}]
    resolved, taken = resolve_rate(plan, done)
    assert resolved.streams[0].arrival.rate == pytest.approx(1.4)  # the defaults' 9.0 replaced
    assert resolved.streams[0].arrival.seed == 3 and resolved.streams[0].arrival.process == "poisson"
    assert taken == {"run": "capacity", "fraction": 0.7, "baseline_request_throughput": 2.0,
                     "rate": pytest.approx(1.4)}
    assert resolve_rate(capacity, done) == (capacity, {})
    with pytest.raises(InvalidRequestError, match="has not run"):
        resolve_rate(plan, [])  # capacity left out (--only) or skipped
    with pytest.raises(InvalidRequestError, match="completed no request"):
        resolve_rate(plan, [{"name": "capacity", "summary": {"request_throughput": 0.0}}])
    # The summary says what the run was offered and what it did, as fractions of capacity.
    run = {"name": "chaos", "summary": {"request_throughput": 1.3},
           "rate_of": {**taken, "achieved_fraction": 0.65}}
    assert report_module.rate_of_line(run) == ("Run chaos: offered 0.7 x run capacity's 2.000 req/s = 1.400 "
                                               "req/s; completed 1.300 req/s = 0.65x capacity.")
    assert report_module.rate_of_line({"name": "capacity"}) == ""


@pytest.mark.parametrize("chaos_run, message", [
    ({"rate_of": {"run": "later", "fraction": 0.7}}, "not a run before it"),
    ({"rate_of": {"run": "chaos", "fraction": 0.7}}, "from itself"),
    ({"rate_of": {"run": "capacity", "fraction": 0}}, "fraction"),
    ({"rate_of": {"run": "capacity"}}, "fraction"),
    ({"rate_of": {"run": "capacity", "fraction": 0.7, "of": "x"}}, "unknown field"),
    ({"rate_of": {"run": "capacity", "fraction": 0.7}, "arrival": {"rate": 2.0}}, "leave arrival.rate out"),
    ({"rate_of": {"run": "capacity", "fraction": 0.7}, "arrival": {"process": "closed"}}, "open-loop"),
    ({"rate_of": {"run": "capacity", "fraction": 0.7}, "streams": [{"tenant": "a"}, {"tenant": "b"}]},
     "several streams"),
])
def test_a_bad_rate_of_is_refused_at_load(chaos_run, message):
    with pytest.raises(InvalidRequestError, match=message):
        parse_campaign(_rate_campaign(chaos_run))


def test_stream_check_names_what_is_wrong():
    ref = REFERENCE
    assert compare_stream(ref, ref).verdict == "ok"
    assert compare_stream(ref[:30], ref).to_json() == {"verdict": "missing", "at": 30, "count": 10}
    assert compare_stream(ref[:12] + ref[15:], ref).to_json() == {"verdict": "missing", "at": 12, "count": 3}
    assert compare_stream(ref[:5] + [ref[4]] + ref[5:], ref).to_json() == {"verdict": "repeated", "at": 5, "count": 1}
    assert compare_stream(ref[:20] + ref[17:20] + ref[20:], ref).to_json() == {"verdict": "repeated", "at": 20,
                                                                              "count": 3}
    assert compare_stream(ref + ref[-2:], ref).verdict == "repeated"
    assert compare_stream(ref[:10] + [1, 2, 3] + ref[13:], ref).verdict == "diverged"


def _record(index: int, tokens, end_s: float | None = 10.0, status: str = STATUS_OK) -> RequestRecord:
    return RequestRecord(index=index, tenant_id="t", prompt_tokens=3, expected_output_tokens=len(REFERENCE),
                         send_s=1.0, status=status, output_tokens=len(tokens or ()), end_s=end_s,
                         delta_times_s=(2.0, end_s or 4.0), output_token_ids=None if tokens is None else tuple(tokens))


def test_a_corrupted_record_is_caught_and_put_down_to_the_fault_before_it():
    prompts = {("t", i): (1, 2, i) for i in range(4)}
    references = {(1, 2, i): REFERENCE + [9, 9] for i in range(4)}  # longer than asked: cut to length
    repeated = REFERENCE[:7] + [REFERENCE[6]] + REFERENCE[7:-1]  # as long as asked, one token sent twice
    records = [_record(0, REFERENCE, end_s=3.0), _record(1, repeated, end_s=12.0),
               _record(2, None, end_s=None, status=STATUS_ERROR), _record(3, REFERENCE[:-4], end_s=6.0)]
    outcomes = [FaultOutcome(0, "kill_worker", 2.5, 2.5, "w0", 1.5), FaultOutcome(1, "drain_worker", 5.0, 5.0, "w1", 2.0),
                FaultOutcome(2, "redis_stop", 8.0, 8.0, "", None, "RuntimeError: no")]
    report = chaos.chaos_report(records, outcomes, {"kv_blocks_used": {"w0": 0, "w1": 3}}, prompts, references)
    rows = {row["index"]: row for row in report["faults"]}
    assert (rows[0]["in_flight"], rows[1]["in_flight"]) == (4, 2)  # records 0 and 2 were over by 5.0
    assert rows[1]["repeated"] == 1 and rows[1]["missing"] == 1  # records 1 (end 12) and 3 (end 6)
    assert rows[0]["failed"] == 1  # record 2's last token came at 4.0: after fault 0, before fault 1
    totals = report["totals"]
    assert (totals["checked"], totals["ok"], totals["repeated"], totals["missing"], totals["failed"]) == (3, 1, 1, 1, 1)
    assert totals["kv_blocks_used_end"] == 3 and totals["faults_not_done"] == 1 and totals["max_recovery_s"] == 2.0
    assert {s["index"]: s["verdict"] for s in report["bad_streams"]} == {1: "repeated", 3: "missing"}
    results = {"campaign": "c", "runs": [{"name": "chaos", "arrival": [], "summary": {"errors_by_code": {}},
                                          "records": [], "chaos": report}]}
    assert "| 1 | drain_worker | 5.0 | w1 | 2 | 0 | 1 | 1 | 0 | 2.0 | - |" in markdown_summary(results)
    page = report_module._chaos_html(results)  # the section html_report embeds (without its plots)
    assert page.startswith("<h2>Faults: chaos</h2><p>3 faults (1 not done") and "<td>drain_worker</td>" in page


class _Tokens(Target):
    """Streams REFERENCE's tokens, one per 5 ms (a stand-in for the served model)."""

    async def stream(self, request):
        for token in REFERENCE[:request.max_tokens]:
            await asyncio.sleep(0.005)
            yield StreamChunk(1, token_ids=(token,))
        yield StreamChunk(0, finished=True, completion_tokens=request.max_tokens)


class _Cluster:
    """Records the faults done to it, on the driver's clock; whole again at once."""

    redis = None
    redis_down = False

    def __init__(self):
        self.done: list[tuple[str, float]] = []
        self.driver = None

    def inject(self, fault, plan):
        self.done.append((fault.kind, self.driver.now_s()))
        if fault.kind == "redeploy_router":
            raise RuntimeError("serve is not running")
        return f"victim-{fault.index}"

    def wait_whole(self, timeout_s):
        return 0.01

    def wait_idle(self, timeout_s):
        return {}


def test_the_scheduler_does_each_fault_on_time_and_a_counted_plan_ends_the_load():
    requests = tuple(WorkloadRequest(index=i, prompt_token_ids=(1, 2, i), prompt_text="", output_tokens=8,
                                     tenant_id="t") for i in range(10_000))
    streams = [TenantStream(requests=requests, arrival=ArrivalSpec(process="closed", concurrency=4))]
    plan = FaultPlan(kinds=("kill_worker", "redeploy_router", "drain_worker"), every_s=0.2, start_s=0.1, count=3)
    cluster = _Cluster()

    async def run():
        driver = RunDriver(_Tokens(), DriverRetryPolicy(), sample_interval_s=0.05, progress=False)
        cluster.driver = driver
        return await chaos.drive_with_faults(driver, streams, plan, cluster)

    started = time.monotonic()
    result, outcomes = asyncio.run(run())
    assert time.monotonic() - started < 30  # the load ended with the faults, not after 10,000 requests
    assert [kind for kind, _ in cluster.done] == list(plan.kinds)
    for (_, at_s), planned in zip(cluster.done, (0.1, 0.3, 0.5)):
        assert at_s >= planned  # never early (late only when the machine is slow)
    assert [o.error is None for o in outcomes] == [True, False, True]
    assert outcomes[1].error == "RuntimeError: serve is not running" and outcomes[1].recovery_s is None
    assert 0 < len(result.records) < len(requests)
    assert all(r.status == STATUS_OK and r.output_token_ids == tuple(REFERENCE[:8]) for r in result.records)
    assert all(r.send_s <= outcomes[-1].at_s + 1.0 for r in result.records)
