"""Per-request timings and the summary metrics computed from them.

The definitions are vLLM bench serve's, pinned here and in docs/load-testing.md:

  TTFT  first token's arrival at the client - the request's send time (first attempt)
  E2E   last token's arrival (the final delta) - send time
  TPOT  (E2E - TTFT) / (output_tokens - 1), per request with output_tokens > 1
  ITL   every gap between consecutive streamed deltas that carry tokens (pooled over
        requests; a delta carrying several tokens is one gap, as a user sees it)
  request throughput       completed requests / run duration
  output token throughput  output tokens of completed requests / run duration
  goodput                  completed requests meeting every SLO (TTFT <= x, TPOT <= y,
                           E2E <= z, each optional) / run duration -- the headline figure
  shed rate                requests the server shed (ended refused: Overloaded or
                           QuotaExceeded, or completed degraded) / requests offered
  retry-after accuracy     of the retries sent no earlier than the Retry-After the refusal
                           advertised, the share the server did not refuse again
  duration                 from the first send to the last request's end

Percentiles use numpy's default linear interpolation (as vLLM). Latency metrics cover
completed requests only; errors, cancellations and retries are counted separately.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field

import numpy as np

PERCENTILES = (50, 90, 95, 99)

STATUS_OK = "ok"
STATUS_CANCELLED = "cancelled"  # the client cancelled on purpose (cancel_after_tokens)
STATUS_ERROR = "error"

# Error codes (driver.error_code) that mean the server refused the request on purpose
# (admission or quota), as opposed to failing it or the client timing out.
REFUSAL_CODES = frozenset({"Overloaded", "QuotaExceeded"})


@dataclass(frozen=True)
class RequestRecord:
    """One request as the client saw it. Times are seconds relative to the run start."""

    index: int
    tenant_id: str
    prompt_tokens: int
    expected_output_tokens: int
    send_s: float  # first attempt's send time
    status: str  # ok | cancelled | error
    output_tokens: int = 0  # tokens received (usage.completion_tokens when reported)
    first_token_s: float | None = None
    end_s: float | None = None
    delta_times_s: tuple[float, ...] = ()  # arrival of each token-carrying delta
    cached_tokens: int = 0
    attempts: int = 1  # 1 + retries
    error_code: str | None = None  # set when status == error (last attempt's error)
    error_message: str | None = None  # its message, cut to 200 characters
    retry_error_codes: tuple[str, ...] = ()  # errors of attempts that were retried
    family: int | None = None
    # Per retry (aligned with retry_error_codes): the retry-after the error advertised (None
    # when it gave none) and how long the client waited before sending the retry.
    retry_after_s: tuple[float | None, ...] = ()
    retry_delay_s: tuple[float, ...] = ()
    degraded: bool = False  # the server said it served less than asked (e.g. capped max_tokens)
    # a structured-output request that completed: whether its output meets its constraint
    # (load_tests/structured_workload.py); None = free text, not completed, or not checked
    structured_valid: bool | None = None
    # every token id the request received, in order, across the client's own resumptions
    # (None: the target streams text only); checked against greedy references (token_check.py)
    output_token_ids: tuple[int, ...] | None = None

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.send_s

    @property
    def e2e_s(self) -> float | None:
        return None if self.end_s is None else self.end_s - self.send_s

    @property
    def tpot_s(self) -> float | None:
        if self.output_tokens <= 1 or self.ttft_s is None or self.e2e_s is None:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    @property
    def itls_s(self) -> tuple[float, ...]:
        t = self.delta_times_s
        return tuple(b - a for a, b in zip(t, t[1:]))

    @property
    def attempt_codes(self) -> tuple[str | None, ...]:
        """Every attempt's error code in order; None for the last one when it did not fail."""
        last = self.error_code if self.status == STATUS_ERROR else None
        return (*self.retry_error_codes, last)

    @property
    def refused(self) -> bool:
        return self.status == STATUS_ERROR and self.error_code in REFUSAL_CODES

    def retries_at_advertised_time(self) -> list[bool]:
        """One entry per retry that waited at least the Retry-After its refusal advertised:
        True when the server did not refuse that retry again. Retries sent earlier than
        advised (naive clients) say nothing about the advice and are left out."""
        codes = self.attempt_codes
        out = []
        for k, (advertised, waited) in enumerate(zip(self.retry_after_s, self.retry_delay_s)):
            if advertised is None or codes[k] not in REFUSAL_CODES or waited < advertised:
                continue
            out.append(codes[k + 1] not in REFUSAL_CODES)
        return out

    def to_json(self) -> dict:
        data = asdict(self)
        data.update(ttft_s=self.ttft_s, e2e_s=self.e2e_s, tpot_s=self.tpot_s)
        return data

    @classmethod
    def from_json(cls, data: dict) -> "RequestRecord":
        names = set(cls.__dataclass_fields__)
        kwargs = {k: v for k, v in data.items() if k in names}
        for k in ("delta_times_s", "retry_error_codes", "retry_after_s", "retry_delay_s"):
            kwargs[k] = tuple(kwargs.get(k, ()))
        if kwargs.get("output_token_ids") is not None:
            kwargs["output_token_ids"] = tuple(kwargs["output_token_ids"])
        return cls(**kwargs)


@dataclass(frozen=True)
class SLO:
    """Goodput thresholds (milliseconds); None = not constrained."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None

    def met_by(self, rec: RequestRecord) -> bool:
        checks = ((self.ttft_ms, rec.ttft_s), (self.tpot_ms, rec.tpot_s), (self.e2e_ms, rec.e2e_s))
        # A request with one output token has no TPOT: the TPOT SLO cannot fail it.
        return all(limit is None or value is None or value * 1000.0 <= limit for limit, value in checks)


@dataclass(frozen=True)
class Distribution:
    """mean, P50/P90/P95/P99 (and count) of one latency metric, in milliseconds."""

    count: int
    mean_ms: float | None
    p50_ms: float | None
    p90_ms: float | None
    p95_ms: float | None
    p99_ms: float | None

    @classmethod
    def of_seconds(cls, values_s: list[float]) -> "Distribution":
        if not values_s:
            return cls(0, None, None, None, None, None)
        ms = np.asarray(values_s, dtype=float) * 1000.0
        p = np.percentile(ms, PERCENTILES)
        return cls(len(ms), float(ms.mean()), *(float(x) for x in p))


@dataclass(frozen=True)
class RunSummary:
    # Field order is report order: what the run delivered (goodput) and what it refused
    # (shed rate, retry-after accuracy) come first, so a run that wins by shedding shows it.
    goodput: float | None  # requests / s meeting the SLO; None = no SLO given
    shed_rate: float | None  # (refused + degraded requests) / offered; None = nothing offered
    retry_after_accuracy: float | None  # see metrics docstring; None = no retry followed the advice
    num_requests: int
    completed: int
    cancelled: int
    failed: int
    duration_s: float
    request_throughput: float  # completed requests / s
    output_token_throughput: float  # tokens / s
    total_output_tokens: int
    total_prompt_tokens: int
    slo_attainment: float | None  # share of completed requests meeting the SLO
    ttft: Distribution
    tpot: Distribution
    itl: Distribution
    e2e: Distribution
    errors_by_code: dict[str, int] = field(default_factory=dict)  # final failures
    retries: int = 0  # extra attempts over all requests
    retried_errors_by_code: dict[str, int] = field(default_factory=dict)
    prefix_cache_hit_rate: float | None = None  # cached prompt tokens / prompt tokens (completed)
    refused: int = 0  # requests that ended refused (REFUSAL_CODES)
    degraded: int = 0  # requests completed degraded
    refused_attempts: int = 0  # attempts refused, retried or not
    # completed structured-output requests whose output meets its constraint / those checked
    structured_valid_rate: float | None = None

    def to_json(self) -> dict:
        return asdict(self)


def summarize(records: list[RequestRecord], slo: SLO | None = None) -> RunSummary:
    done = [r for r in records if r.status == STATUS_OK]
    ends = [r.end_s for r in records if r.end_s is not None]
    start = min((r.send_s for r in records), default=0.0)
    duration = max(ends, default=start) - start
    per_s = (lambda x: x / duration) if duration > 0 else (lambda x: 0.0)
    out_tokens = sum(r.output_tokens for r in done)
    prompt_tokens = sum(r.prompt_tokens for r in done)
    good = None
    attainment = None
    if slo is not None and any(v is not None for v in (slo.ttft_ms, slo.tpot_ms, slo.e2e_ms)):
        num_good = sum(1 for r in done if slo.met_by(r))
        good = per_s(num_good)
        attainment = num_good / len(done) if done else 0.0
    retried = Counter(code for r in records for code in r.retry_error_codes)
    refused = sum(1 for r in records if r.refused)
    degraded = sum(1 for r in done if r.degraded)
    advised = [admitted for r in records for admitted in r.retries_at_advertised_time()]
    checked = [r.structured_valid for r in done if r.structured_valid is not None]
    return RunSummary(
        shed_rate=(refused + degraded) / len(records) if records else None,
        retry_after_accuracy=sum(advised) / len(advised) if advised else None,
        refused=refused, degraded=degraded,
        refused_attempts=sum(1 for r in records for code in r.attempt_codes if code in REFUSAL_CODES),
        num_requests=len(records),
        completed=len(done),
        cancelled=sum(1 for r in records if r.status == STATUS_CANCELLED),
        failed=sum(1 for r in records if r.status == STATUS_ERROR),
        duration_s=duration,
        request_throughput=per_s(len(done)),
        output_token_throughput=per_s(out_tokens),
        total_output_tokens=out_tokens,
        total_prompt_tokens=prompt_tokens,
        goodput=good,
        slo_attainment=attainment,
        ttft=Distribution.of_seconds([r.ttft_s for r in done if r.ttft_s is not None]),
        tpot=Distribution.of_seconds([r.tpot_s for r in done if r.tpot_s is not None]),
        itl=Distribution.of_seconds([gap for r in done for gap in r.itls_s]),
        e2e=Distribution.of_seconds([r.e2e_s for r in done if r.e2e_s is not None]),
        errors_by_code=dict(Counter(r.error_code or "unknown" for r in records if r.status == STATUS_ERROR)),
        retries=sum(r.attempts - 1 for r in records),
        retried_errors_by_code=dict(retried),
        prefix_cache_hit_rate=(sum(r.cached_tokens for r in done) / prompt_tokens) if prompt_tokens else None,
        structured_valid_rate=sum(checked) / len(checked) if checked else None,
    )


def summary_from_json(data: dict) -> RunSummary:
    dists = {k: Distribution(**data[k]) for k in ("ttft", "tpot", "itl", "e2e")}
    rest = {k: v for k, v in data.items() if k not in dists}
    for key in ("shed_rate", "retry_after_accuracy"):  # results written before these existed
        rest.setdefault(key, None)
    return RunSummary(**rest, **dists)
