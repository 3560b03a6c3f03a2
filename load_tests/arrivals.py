"""When requests are sent: open-loop arrival processes and closed-loop concurrency.

Open loop (the server cannot slow the client down, like real users):
  poisson   inter-arrival gaps ~ Exponential(mean 1/rate)
  gamma     gaps ~ Gamma(shape=burstiness, scale=1/(rate*burstiness)): the mean gap stays
            1/rate, the coefficient of variation is 1/sqrt(burstiness), so burstiness < 1
            is burstier than Poisson and > 1 more regular (vLLM bench serve's definition;
            burstiness=1 is exactly Poisson)
  constant  gaps of exactly 1/rate
  rate=inf  every request at t=0 (a burst; vLLM's default)
Replay:
  trace     each request's recorded arrival_s (a trace workload)
Closed loop:
  closed    `concurrency` clients, each sends its next request when the previous ends

A run stops at `max_requests` or `duration_s`, whichever comes first. Everything is seeded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from kvmesh.core.errors import InvalidRequestError


@dataclass(frozen=True)
class ArrivalSpec:
    """A campaign's `arrival:` section. `rate` may be a list in YAML: a sweep (campaign.py
    expands it into one run per rate); here it is always one number (requests/s)."""

    process: str = "poisson"  # poisson | gamma | constant | trace | closed
    rate: float = math.inf  # requests per second (open loop)
    burstiness: float = 1.0  # gamma shape
    concurrency: int = 1  # closed loop: clients in flight
    max_requests: int | None = None  # None = the whole workload
    duration_s: float | None = None  # stop sending after this long
    seed: int = 0

    def validate(self) -> None:
        if self.process not in ("poisson", "gamma", "constant", "trace", "closed"):
            raise InvalidRequestError(
                f"arrival process must be poisson|gamma|constant|trace|closed, got {self.process!r}")
        if not self.rate > 0:
            raise InvalidRequestError(f"arrival rate must be > 0 (inf = all at once), got {self.rate}")
        if not self.burstiness > 0:
            raise InvalidRequestError(f"burstiness must be > 0, got {self.burstiness}")
        if self.concurrency < 1:
            raise InvalidRequestError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.max_requests is not None and self.max_requests < 1:
            raise InvalidRequestError("max_requests must be >= 1")
        if self.duration_s is not None and not self.duration_s > 0:
            raise InvalidRequestError("duration_s must be > 0")

    @property
    def open_loop(self) -> bool:
        return self.process != "closed"

    def label(self) -> str:
        if not self.open_loop:
            return f"closed c={self.concurrency}"
        if self.process == "trace":
            return "trace replay"
        rate = "inf" if math.isinf(self.rate) else f"{self.rate:g}/s"
        return f"{self.process} {rate}" + (f" b={self.burstiness:g}" if self.process == "gamma" else "")


def inter_arrival_gaps_s(spec: ArrivalSpec, n: int) -> np.ndarray:
    """n seeded gaps (seconds) between consecutive sends; the first request goes at gap[0]."""
    spec.validate()
    if spec.process in ("closed", "trace"):
        raise InvalidRequestError(f"a {spec.process} process has no generated arrival times")
    if math.isinf(spec.rate):
        return np.zeros(n)
    rng = np.random.default_rng(spec.seed)
    if spec.process == "constant":
        return np.full(n, 1.0 / spec.rate)
    shape = 1.0 if spec.process == "poisson" else spec.burstiness
    return rng.gamma(shape, 1.0 / (spec.rate * shape), size=n)


def arrival_offsets_s(spec: ArrivalSpec, num_available: int) -> np.ndarray:
    """Send times (seconds from the run start) for an open-loop run over a workload of
    `num_available` requests, cut by max_requests and duration_s.

    The first request goes at t=0 (like vLLM, which sleeps *after* each send)."""
    n = num_available if spec.max_requests is None else min(num_available, spec.max_requests)
    gaps = inter_arrival_gaps_s(spec, n)
    offsets = np.concatenate([[0.0], np.cumsum(gaps[:-1])]) if n else np.zeros(0)
    if spec.duration_s is not None:
        offsets = offsets[offsets < spec.duration_s]
    return offsets
