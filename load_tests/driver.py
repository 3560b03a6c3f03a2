"""The client side of a run: send a fixed request list to a target on schedule, with
retries, timeouts and deliberate cancellations, and record what every request saw.

One run = one target x one or more request streams (a stream per tenant). Open-loop streams
send at precomputed offsets regardless of how the server keeps up; closed-loop streams keep
`concurrency` requests in flight. While requests run, a sampler records server-side
figures every `sample_interval_s`, and once more after the last request (so a test can
check that KV usage went back to zero after a cancel storm).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from kvmesh.load_tests.arrivals import ArrivalSpec, arrival_offsets_s
from kvmesh.load_tests.metrics import STATUS_CANCELLED, STATUS_ERROR, STATUS_OK, RequestRecord
from kvmesh.load_tests.structured_workload import output_is_valid
from kvmesh.load_tests.targets import Target, TargetRequest
from kvmesh.load_tests.workloads import WorkloadRequest
from kvmesh.core.errors import InvalidRequestError, KvmeshError
from kvmesh.router import retry as client_retry

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DriverRetryPolicy:
    """How a client reacts to a retryable error (overloaded, quota, worker failed, timeout).

    none     give up at once
    naive    resend immediately, up to max_attempts (the retry storm the article describes)
    backoff  the client library's backoff (router/retry.py, the one implementation): the
             server's retry_after_s plus full jitter, uniform(0, min(max_delay_s,
             base_delay_s * 2^(attempt-1)))
    """

    mode: str = "none"
    max_attempts: int = 3
    base_delay_s: float = 0.1
    max_delay_s: float = 5.0
    timeout_s: float | None = None  # per attempt; hitting it is a retryable "timeout" error
    seed: int = 0

    def validate(self) -> None:
        if self.mode not in ("none", "naive", "backoff"):
            raise InvalidRequestError(f"retry mode must be none|naive|backoff, got {self.mode!r}")
        if self.max_attempts < 1 or self.base_delay_s < 0 or self.max_delay_s < self.base_delay_s:
            raise InvalidRequestError("retry: max_attempts >= 1 and 0 <= base_delay_s <= max_delay_s")
        if self.timeout_s is not None and not self.timeout_s > 0:
            raise InvalidRequestError("retry.timeout_s must be > 0")

    def delay_s(self, attempt: int, retry_after_s: float | None, rng: random.Random) -> float:
        if self.mode == "naive":
            return 0.0
        policy = client_retry.RetryPolicy(max_attempts=self.max_attempts, initial_backoff_s=self.base_delay_s,
                                          max_backoff_s=self.max_delay_s, multiplier=2.0)
        return client_retry.backoff_s(attempt, policy, rng, retry_after_s)


@dataclass(frozen=True)
class TenantStream:
    """The requests of one tenant and when to send them."""

    requests: tuple[WorkloadRequest, ...]
    arrival: ArrivalSpec


@dataclass
class RunResult:
    records: list[RequestRecord]
    server_samples: list[dict] = field(default_factory=list)  # {"t_s": ..., role: value}
    final_server_sample: dict | None = None


def error_code(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "timeout"
    name = type(exc).__name__
    return name[:-5] if name.endswith("Error") and len(name) > 5 else name


class _Attempt:
    """What one attempt observed (times relative to the run start)."""

    def __init__(self):
        self.first_token_s: float | None = None
        self.delta_times_s: list[float] = []
        self.num_tokens = 0
        self.completion_tokens: int | None = None
        self.cached_tokens = 0
        self.cancelled = False
        self.degraded = False  # the final delta said the server's ladder degraded it
        self.text_parts: list[str] = []  # kept only for a structured-output request
        self.token_ids: list[int] | None = None  # None until the target reports ids


class RunDriver:
    def __init__(self, target: Target, retry: DriverRetryPolicy, run_id: str = "run",
                 sample_interval_s: float = 0.5, progress: bool = True,
                 clock: Callable[[], float] = time.perf_counter,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep):
        """clock and sleep time the run: arrival offsets, retry waits and every recorded time
        (tests inject a virtual pair). The server sampler always samples in real time."""
        retry.validate()
        self._clock = clock
        self._sleep = sleep
        self.target = target
        self.retry = retry
        self.run_id = run_id
        self.sample_interval_s = sample_interval_s
        self.progress = progress
        self._t0 = 0.0
        self._bar = None
        self._stop_sending = False

    def _now_s(self) -> float:
        return self._clock() - self._t0

    def now_s(self) -> float:
        """Seconds since the run started, on the clock every record's times use."""
        return self._now_s()

    def stop_sending(self) -> None:
        """End the load early: no request is sent after this; those under way finish (a chaos
        run whose faults are all done)."""
        self._stop_sending = True

    async def run(self, streams: list[TenantStream]) -> RunResult:
        """Send every stream's requests; returns when all have finished."""
        planned = sum(_planned_count(s) for s in streams)
        self._bar = _progress_bar(planned, self.run_id, self.progress)
        records: list[RequestRecord] = []
        samples: list[dict] = []
        self._t0 = self._clock()
        sampler = asyncio.create_task(self._sample_loop(samples))
        try:
            results = await asyncio.gather(*(self._run_stream(i, s) for i, s in enumerate(streams)))
        finally:
            sampler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sampler
            self._bar.close()
        for stream_records in results:
            records.extend(stream_records)
        records.sort(key=lambda r: (r.send_s, r.index))
        # Let aborts and frees settle before the last look at the server (cancel storms).
        await asyncio.sleep(min(0.5, self.sample_interval_s))
        final = await self._sample_once()
        return RunResult(records=records, server_samples=samples, final_server_sample=final)

    async def _sample_once(self) -> dict | None:
        try:
            sample = await self.target.server_sample()
        except Exception as exc:  # sampling is best effort; the run's results stand without it
            logger.debug("server sample failed: %s", exc)
            return None
        return None if sample is None else {"t_s": self._now_s(), **sample}

    async def _sample_loop(self, out: list[dict]) -> None:
        while True:
            sample = await self._sample_once()
            if sample is not None:
                out.append(sample)
            await asyncio.sleep(self.sample_interval_s)

    async def _run_stream(self, stream_no: int, stream: TenantStream) -> list[RequestRecord]:
        spec = stream.arrival
        reqs = list(stream.requests)
        if spec.process == "closed":
            return await self._run_closed(stream_no, reqs, spec)
        if spec.process == "trace":
            offsets = [r.arrival_offset_s or 0.0 for r in reqs]
            offsets = [o for o in offsets if spec.duration_s is None or o < spec.duration_s][:spec.max_requests]
        else:
            offsets = list(arrival_offsets_s(spec, len(reqs)))
        tasks = []
        for req, offset in zip(reqs, offsets):
            await self._sleep(max(0.0, offset - self._now_s()))
            if self._stop_sending:
                break
            tasks.append(asyncio.create_task(self._send(stream_no, req)))
        return list(await asyncio.gather(*tasks))

    async def _run_closed(self, stream_no: int, reqs: list[WorkloadRequest], spec: ArrivalSpec) -> list[RequestRecord]:
        pending = iter(reqs[:spec.max_requests] if spec.max_requests else reqs)
        out: list[RequestRecord] = []

        async def client() -> None:
            for req in pending:  # a shared iterator: each request goes to one client
                if self._stop_sending or (spec.duration_s is not None and self._now_s() >= spec.duration_s):
                    return
                out.append(await self._send(stream_no, req))

        await asyncio.gather(*(client() for _ in range(spec.concurrency)))
        return out

    async def _send(self, stream_no: int, req: WorkloadRequest) -> RequestRecord:
        send_s = self._now_s()
        rng = random.Random(f"{self.retry.seed}-{stream_no}-{req.index}")  # str seeds are stable
        retry_codes: list[str] = []
        advised_s: list[float | None] = []  # per retry: the retry-after its error advertised
        waited_s: list[float] = []  # per retry: the delay the client chose before sending it
        attempt_no = 0
        while True:
            attempt_no += 1
            treq = TargetRequest(request_id=f"{self.run_id}-s{stream_no}-r{req.index}-a{attempt_no}",
                                 prompt_token_ids=req.prompt_token_ids, prompt_text=req.prompt_text,
                                 max_tokens=req.output_tokens, tenant_id=req.tenant_id, api_key=req.api_key,
                                 attempt=attempt_no, stop=req.stop, structured=req.structured,
                                 adapter=req.adapter)
            seen = _Attempt()
            try:
                if self.retry.timeout_s is None:
                    await self._attempt(treq, req.cancel_after_tokens, seen)
                else:
                    async with asyncio.timeout(self.retry.timeout_s):
                        await self._attempt(treq, req.cancel_after_tokens, seen)
            except Exception as exc:  # every failure is a result to count, never a crash of the run
                code = error_code(exc)
                if not isinstance(exc, (KvmeshError, TimeoutError)):
                    logger.debug("request %s failed: %r", treq.request_id, exc)
                retryable = isinstance(exc, TimeoutError) or getattr(exc, "retryable", False)
                if self.retry.mode == "none" or not retryable or attempt_no >= self.retry.max_attempts:
                    return self._record(stream_no, req, send_s, STATUS_ERROR, seen, attempt_no,
                                        (retry_codes, advised_s, waited_s), code, str(exc)[:200])
                advertised = getattr(exc, "retry_after_s", None)
                delay = self.retry.delay_s(attempt_no, advertised, rng)
                retry_codes.append(code)
                advised_s.append(advertised)
                waited_s.append(delay)
                await self._sleep(delay)
                continue
            status = STATUS_CANCELLED if seen.cancelled else STATUS_OK
            return self._record(stream_no, req, send_s, status, seen, attempt_no,
                                (retry_codes, advised_s, waited_s), None)

    async def _attempt(self, treq: TargetRequest, cancel_after_tokens: int | None, seen: _Attempt) -> None:
        async with contextlib.aclosing(self.target.stream(treq)) as chunks:
            async for chunk in chunks:
                if chunk.num_tokens > 0:
                    t = self._now_s()
                    if seen.first_token_s is None:
                        seen.first_token_s = t
                    seen.delta_times_s.append(t)
                    seen.num_tokens += chunk.num_tokens
                if chunk.token_ids is not None:
                    if seen.token_ids is None:
                        seen.token_ids = []
                    seen.token_ids.extend(chunk.token_ids)
                if chunk.completion_tokens is not None:
                    seen.completion_tokens = chunk.completion_tokens
                if chunk.cached_tokens is not None:
                    seen.cached_tokens = chunk.cached_tokens
                seen.degraded = seen.degraded or chunk.degraded
                if treq.structured is not None and chunk.text:
                    seen.text_parts.append(chunk.text)
                if cancel_after_tokens is not None and seen.num_tokens >= cancel_after_tokens:
                    seen.cancelled = True
                    return  # leaving the `async with` closes the stream: the server aborts

    def _record(self, stream_no: int, req: WorkloadRequest, send_s: float, status: str, seen: _Attempt,
                attempts: int, retries: tuple[list[str], list[float | None], list[float]], code: str | None,
                message: str | None = None) -> RequestRecord:
        retry_codes, advised_s, waited_s = retries
        if self._bar is not None:
            self._bar.update(1)
        end_s = self._now_s() if status != STATUS_ERROR else None
        output = seen.completion_tokens if seen.completion_tokens is not None else seen.num_tokens
        valid = (output_is_valid(req.structured, "".join(seen.text_parts))
                 if req.structured is not None and status == STATUS_OK else None)
        return RequestRecord(index=req.index, tenant_id=req.tenant_id, prompt_tokens=req.prompt_tokens,
                             expected_output_tokens=req.output_tokens, send_s=send_s, status=status,
                             output_tokens=output, first_token_s=seen.first_token_s, end_s=end_s,
                             delta_times_s=tuple(seen.delta_times_s), cached_tokens=seen.cached_tokens,
                             attempts=attempts, error_code=code, error_message=message,
                             retry_error_codes=tuple(retry_codes), retry_after_s=tuple(advised_s),
                             retry_delay_s=tuple(waited_s), degraded=seen.degraded,
                             family=req.family, structured_valid=valid,
                             output_token_ids=None if seen.token_ids is None else tuple(seen.token_ids))


def _planned_count(stream: TenantStream) -> int:
    n = len(stream.requests)
    return n if stream.arrival.max_requests is None else min(n, stream.arrival.max_requests)


class _StderrProgress:
    """A one-line progress report when tqdm is unavailable."""

    def __init__(self, total: int, label: str):
        self.total, self.label, self.done = total, label, 0

    def update(self, n: int) -> None:
        self.done += n
        sys.stderr.write(f"\r{self.label}: {self.done}/{self.total} requests")
        sys.stderr.flush()

    def close(self) -> None:
        sys.stderr.write("\n")


class _NoProgress:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def _progress_bar(total: int, label: str, enabled: bool):
    if not enabled:
        return _NoProgress()
    try:
        from tqdm import tqdm
    except ImportError:
        return _StderrProgress(total, label)
    return tqdm(total=total, desc=label, unit="req", file=sys.stderr, leave=False)
