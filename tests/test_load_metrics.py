"""Metric definitions (vLLM bench serve's) on synthetic timings with hand-computed values,
the retry policy, and parsing the router's real /metrics page."""

import random

import pytest

from kvmesh.load_tests.driver import DriverRetryPolicy, error_code
from kvmesh.load_tests.metrics import (SLO, Distribution, RequestRecord, summarize,
                                       summary_from_json)
from kvmesh.load_tests.server_metrics import metric_role, parse_prometheus_sample
from kvmesh.core.seams import WorkerStats
from kvmesh.core.errors import InvalidRequestError, OverloadedError


def rec(index, send, deltas=(), status="ok", end=None, out=None, prompt=10, cached=0, **kw):
    return RequestRecord(index=index, tenant_id="t", prompt_tokens=prompt, expected_output_tokens=out or len(deltas),
                         send_s=send, status=status, output_tokens=len(deltas) if out is None else out,
                         first_token_s=deltas[0] if deltas else None, end_s=end, delta_times_s=tuple(deltas),
                         cached_tokens=cached, **kw)


@pytest.fixture
def records():
    return [
        rec(0, 0.0, (0.5, 0.7, 1.0, 1.4), end=1.4, cached=8),  # TTFT .5, TPOT (1.4-.5)/3=.3, ITL .2 .3 .4
        rec(1, 1.0, (1.2, 1.3), end=1.3),  # TTFT .2, E2E .3, TPOT .1, ITL .1
        rec(2, 2.0, (2.1,), end=2.1, prompt=20, cached=2),  # one token: no TPOT, no ITL
        rec(3, 0.5, status="error", attempts=3, error_code="Overloaded",
            retry_error_codes=("Overloaded", "Overloaded")),
        rec(4, 0.2, (0.4, 0.6), status="cancelled", end=0.9, out=2),
    ]


def test_per_request_definitions(records):
    a = records[0]
    assert a.ttft_s == pytest.approx(0.5)
    assert a.e2e_s == pytest.approx(1.4)
    assert a.tpot_s == pytest.approx(0.3)
    assert a.itls_s == pytest.approx((0.2, 0.3, 0.4))
    assert records[2].tpot_s is None and records[2].itls_s == ()


def test_summary_matches_hand_computation(records):
    s = summarize(records, SLO(ttft_ms=300, tpot_ms=150))
    assert (s.num_requests, s.completed, s.failed, s.cancelled) == (5, 3, 1, 1)
    assert s.duration_s == pytest.approx(2.1)  # first send 0.0 -> last end 2.1
    assert s.request_throughput == pytest.approx(3 / 2.1)
    assert s.total_output_tokens == 7
    assert s.output_token_throughput == pytest.approx(7 / 2.1)
    # TTFT ms [500, 200, 100]: numpy linear percentiles.
    assert s.ttft.mean_ms == pytest.approx(800 / 3)
    assert s.ttft.p50_ms == pytest.approx(200)
    assert s.ttft.p90_ms == pytest.approx(440)  # rank 1.8 between 200 and 500
    assert s.ttft.p99_ms == pytest.approx(494)
    assert (s.tpot.count, s.tpot.mean_ms, s.tpot.p99_ms) == (2, pytest.approx(200), pytest.approx(298))
    assert s.itl.count == 4 and s.itl.mean_ms == pytest.approx(250) and s.itl.p90_ms == pytest.approx(370)
    assert s.e2e.mean_ms == pytest.approx(600)
    # Goodput: A misses TTFT; B meets both; C has no TPOT and meets TTFT.
    assert s.goodput == pytest.approx(2 / 2.1)
    assert s.slo_attainment == pytest.approx(2 / 3)
    assert s.errors_by_code == {"Overloaded": 1}
    assert s.retries == 2 and s.retried_errors_by_code == {"Overloaded": 2}
    assert s.prefix_cache_hit_rate == pytest.approx(10 / 40)


def test_no_slo_means_no_goodput_and_json_round_trip(records):
    s = summarize(records)
    assert s.goodput is None and s.slo_attainment is None
    assert summary_from_json(s.to_json()) == s
    assert RequestRecord.from_json(records[0].to_json()) == records[0]


def test_shed_rate_and_retry_after_accuracy_by_hand():
    ok = dict(deltas=(1.0, 1.1), end=1.1)
    records = [
        rec(0, 0.0, **ok),  # served first time
        # Refused twice, each retry sent at (or after) the advertised time; the first retry was
        # refused again (advice wrong), the second admitted (advice right).
        rec(1, 0.0, **ok, attempts=3, retry_error_codes=("Overloaded", "Overloaded"),
            retry_after_s=(1.0, 2.0), retry_delay_s=(1.0, 2.5)),
        # Quota refusal retried too early (0.2 < 0.5 s: says nothing of the advice), then
        # refused for good: a shed request.
        rec(2, 0.0, status="error", error_code="Overloaded", attempts=2, retry_error_codes=("QuotaExceeded",),
            retry_after_s=(0.5,), retry_delay_s=(0.2,)),
        # Retried at the advertised time and admitted; the client then timed out: not refused.
        rec(3, 0.0, status="error", error_code="timeout", attempts=2, retry_error_codes=("Overloaded",),
            retry_after_s=(0.5,), retry_delay_s=(0.5,)),
        rec(4, 0.0, **ok, degraded=True),  # served less than asked: shed too
        # A worker failure carries no retry-after: neither shed nor judged.
        rec(5, 0.0, status="error", error_code="WorkerFailed", attempts=2, retry_error_codes=("WorkerFailed",),
            retry_after_s=(None,), retry_delay_s=(0.1,)),
    ]
    s = summarize(records, SLO(ttft_ms=2000))
    assert (s.refused, s.degraded) == (1, 1)
    assert s.shed_rate == pytest.approx(2 / 6)
    assert s.retry_after_accuracy == pytest.approx(2 / 3)  # [False, True] + [True]
    assert s.refused_attempts == 2 + 2 + 1  # B twice, C twice, D once
    assert s.goodput == pytest.approx(3 / 1.1)  # A, B and E meet the TTFT SLO; duration 1.1 s
    assert list(s.to_json())[:3] == ["goodput", "shed_rate", "retry_after_accuracy"]  # headline first
    assert summary_from_json(s.to_json()) == s
    assert RequestRecord.from_json(records[1].to_json()) == records[1]


def test_nothing_offered_or_no_advised_retry_gives_none():
    s = summarize([])
    assert s.shed_rate is None and s.retry_after_accuracy is None
    naive = rec(0, 0.0, (1.0,), end=1.0, attempts=2, retry_error_codes=("Overloaded",), retry_after_s=(0.5,),
                retry_delay_s=(0.0,))
    assert summarize([naive]).retry_after_accuracy is None and summarize([naive]).shed_rate == 0.0
    old = summarize([naive]).to_json()
    del old["shed_rate"], old["retry_after_accuracy"]  # a results.json from before these figures
    assert summary_from_json(old).shed_rate is None


def test_empty_and_all_failed_runs():
    s = summarize([rec(0, 0.0, status="error", error_code="timeout")], SLO(ttft_ms=1))
    assert s.completed == 0 and s.request_throughput == 0.0 and s.ttft == Distribution.of_seconds([])
    assert s.errors_by_code == {"timeout": 1} and s.goodput == 0.0


def test_retry_policies():
    rng = random.Random(0)
    assert DriverRetryPolicy("naive").delay_s(3, None, rng) == 0.0
    backoff = DriverRetryPolicy("backoff", base_delay_s=0.1, max_delay_s=1.0)
    delays = [backoff.delay_s(a, None, rng) for a in (1, 2, 3, 4, 5, 6) for _ in range(200)]
    assert all(0 <= d <= 1.0 for d in delays)
    assert max(delays[:200]) <= 0.1 and max(delays[-200:]) > 0.5  # grows to the cap, jittered
    # retry_after + jitter over a window as long as it, up to max_delay_s
    assert all(2.5 <= backoff.delay_s(1, 2.5, rng) <= 3.5 for _ in range(50))
    with pytest.raises(InvalidRequestError):
        DriverRetryPolicy("backoff", base_delay_s=2.0, max_delay_s=1.0).validate()
    with pytest.raises(InvalidRequestError):
        DriverRetryPolicy("storm").validate()


def test_error_codes():
    assert error_code(OverloadedError("busy", 1.0)) == "Overloaded"
    assert error_code(TimeoutError()) == "timeout"
    assert error_code(ValueError("x")) == "Value"


def _stats(worker_id, used, total, running, waiting, preempt):
    return WorkerStats(worker_id=worker_id, healthy=True, block_size=16, num_blocks_total=total,
                       num_blocks_used=used, num_blocks_cached=0, num_blocks_free=total - used, kv_tokens_used=used * 16,
                       kv_tokens_capacity=total * 16, kv_tokens_reserved=0, num_running=running, num_waiting=waiting,
                       queued_prompt_tokens=0, prefix_cache_hit_rate=0.0, output_tokens_per_s=0.0,
                       num_preemptions_recompute=preempt)


def test_parse_the_routers_real_metrics_page():
    from kvmesh.router.metrics import RouterMetrics

    metrics = RouterMetrics(max_num_seqs=8)
    metrics.update_worker_stats([_stats("w0", 10, 100, 3, 2, 1), _stats("w1", 30, 100, 5, 4, 2)])
    sample = parse_prometheus_sample(metrics.render([]).decode())
    assert sample["kv_usage"] == pytest.approx(0.2)  # mean of 0.1 and 0.3
    assert sample["num_running"] == 8 and sample["num_waiting"] == 6
    assert sample["num_preemptions"] == 3
    assert sample["kv_blocks_used"] == 40


def test_parse_is_tolerant_of_absent_or_foreign_metrics():
    assert parse_prometheus_sample("") == {}
    text = "# TYPE other_running gauge\nother_running 5\n# TYPE kvmesh_prefix_cache_hits_total counter\n" \
           "kvmesh_prefix_cache_hits_total 30\n# TYPE kvmesh_prefix_cache_queries_total counter\n" \
           "kvmesh_prefix_cache_queries_total 120\n"
    sample = parse_prometheus_sample(text)
    assert "num_running" not in sample
    assert sample["prefix_cache_hit_rate"] == pytest.approx(0.25)
    assert metric_role("kvmesh_queue_time_seconds_bucket") is None


def test_openai_sse_lines_become_chunks():
    from kvmesh.load_tests.targets import parse_sse_line

    assert parse_sse_line("") is None and parse_sse_line(": keep-alive") is None
    assert parse_sse_line("data: [DONE]") is None
    text = parse_sse_line('data: {"choices": [{"index": 0, "text": " the", "finish_reason": null}]}')
    assert (text.num_tokens, text.finished) == (1, False)
    last = parse_sse_line('data: {"choices": [{"index": 0, "text": "", "finish_reason": "length"}]}')
    assert (last.num_tokens, last.finished) == (0, True)
    usage = parse_sse_line('data: {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 7, '
                           '"prompt_tokens_details": {"cached_tokens": 4}}}')
    assert (usage.completion_tokens, usage.cached_tokens, usage.finished) == (7, 4, True)
    assert not usage.degraded
    capped = parse_sse_line('data: {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 7, '
                            '"kvmesh_degraded": "cap"}}')
    assert capped.degraded and capped.finished  # the ladder's flag reaches RequestRecord.degraded
    with pytest.raises(Exception) as err:
        parse_sse_line('data: {"error": {"message": "worker died"}}')
    assert error_code(err.value) == "WorkerFailed"


def test_http_statuses_map_to_kvmesh_errors():
    from kvmesh.load_tests.targets import http_error

    assert error_code(http_error(429, "slow down", "2")) == "QuotaExceeded"
    assert http_error(429, "", "2").retry_after_s == 2.0
    assert error_code(http_error(503, "busy", None)) == "Overloaded"
    assert error_code(http_error(401, "", None)) == "Unauthenticated"
    assert error_code(http_error(400, "bad", None)) == "InvalidRequest" and not http_error(400, "", None).retryable
    assert http_error(500, "boom", None).retryable


@pytest.mark.parametrize("url,ok", [("http://127.0.0.1:8000", True), ("http://localhost:1", True),
                                    ("http://[::1]:80", True), ("http://10.0.0.5:8000", False),
                                    ("https://api.example.com", False)])
def test_remote_targets_are_refused_unless_allowed(url, ok):
    from kvmesh.load_tests.targets import OpenAIHttpTarget

    if ok:
        OpenAIHttpTarget(url)
    else:
        with pytest.raises(InvalidRequestError):
            OpenAIHttpTarget(url)
        OpenAIHttpTarget(url, allow_remote=True)


def test_retryable_errors_survive_pickling_with_their_retry_after():
    """Errors cross Ray (worker actor -> router) pickled; the client's backoff needs retry_after_s."""
    import pickle

    from kvmesh.core.errors import QuotaExceededError

    for err in (OverloadedError("busy", 2.5), QuotaExceededError("tenant over quota", 4.0)):
        back = pickle.loads(pickle.dumps(err))
        assert (type(back), back.message, back.retry_after_s, back.retryable) == (type(err), err.message,
                                                                                   err.retry_after_s, True)
