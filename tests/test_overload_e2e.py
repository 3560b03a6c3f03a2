"""Overload on the real cluster: a burst of about three times what the cluster can hold
(running + the router's admission queue), sent over gRPC to a local Ray cluster with two
tiny-Llama workers whose limits are set small. One cluster for the module.

Capacity, from the config below (the router's budget is each worker's KV tokens):

    worker: 46 blocks x 16 = 736 KV tokens; a request costs 48 prompt + 128 output = 176
            -> 4 admitted per worker (1 running, max_num_seqs, and 3 in its queue)
    router: max_queue_len 4 -> 3 first-attempt slots + floor(4 x 0.25) = 1 retry slot;
            admitted retries may hold at most 0.25 x 1472 = 368 KV tokens (2 requests)
    total:  8 admitted + 3 queued = 11 first attempts; the burst is 36 (3.3x)

One request runs at a time per worker, 128 tokens long, so the cluster finishes about 6
requests a second: however slowly a contended router takes the burst's calls in (full-suite
CI runs saw them reach admission over ~1 s although they left the client within 3 ms), the
burst outruns what ends meanwhile and the queue overflows.

Each simulated user is its own client (its own retry budget, as separate processes would
have) on one shared channel. Every attempt is observed by a client interceptor: its
attempt number (the `x-kvmesh-attempt` metadata the client sends), status, details,
retry-after, and when it started, delivered its first message and ended.

Two retry disciplines over the same burst:
  naive    retry at once on RESOURCE_EXHAUSTED / UNAVAILABLE, up to the same attempt cap,
           ignoring retry-after (still marking attempt numbers, so only the timing differs)
  backoff  KvmeshClient: retry-after, then full jitter over a window at least as long
           (router/retry.py)
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import gc
import logging
import random
import statistics
import threading
import time
from dataclasses import dataclass, field

import grpc
import pytest

from kvmesh.core.config import KvmeshConfig
from kvmesh.proto import kvmesh_pb2_grpc
from kvmesh.router import convert, status_map
from kvmesh.router.client import KvmeshClient
from kvmesh.router.retry import RetryPolicy
from kvmesh.core.seams import SamplingParams
from kvmesh.core.errors import KvmeshError
from e2e_cluster import serving, tiny_cluster_config

logger = logging.getLogger(__name__)

APP_NAME = "kvmesh-overload-e2e"
PROMPT_TOKENS = 48
MAX_TOKENS = 128
NUM_USERS = 36
MAX_ATTEMPTS = 4
RETRY_LANE_FRACTION = 0.25
RETRYABLE = (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE)
# The router admission's refusals given when a request arrives (router/admission.py), as
# opposed to "no capacity within N s", a queue wait that ran out.
ARRIVAL_REFUSALS = ("admission queue full", "no room now")

# e2e: a Ray cluster with the Serve app (`pytest -m "not e2e"` skips the module)
pytestmark = [pytest.mark.e2e, pytest.mark.shared_ray, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def overload_config(tiny_model_dir) -> KvmeshConfig:
    # The tiny model steps in ~2.5 ms: at the default pace (2,000 messages a second over the
    # replica's streams) each running stream writes a message a token, work the router's event
    # loop does beside taking the burst's calls in. Paced at 200 a second it writes less; the
    # first token and the final message never wait, so admission and retry timing are as before.
    return tiny_cluster_config(tiny_model_dir, num_workers=2, max_num_seqs=1, num_blocks=46, max_new_tokens=None,
                               router={"policy": "least_loaded", "stats_refresh_s": 0.05, "max_queue_len": 4,
                                       "retry_lane_fraction": RETRY_LANE_FRACTION, "max_queue_wait_s": 20.0,
                                       "stream_messages_per_s": 200.0})


@pytest.fixture(scope="module")
def cluster(overload_config):
    with serving(overload_config, APP_NAME) as config:
        yield config


@dataclass
class Attempt:
    """One Generate RPC as the client saw it (monotonic seconds)."""

    attempt: int
    started_s: float
    first_message_s: float | None = None
    ended_s: float | None = None
    code: grpc.StatusCode | None = None
    details: str = ""
    retry_after_s: float | None = None


class _ObservedCall:
    """Wraps a streaming call: stamps the first message and the end, forwards the rest."""

    def __init__(self, call, record: Attempt):
        self._call = call
        self._record = record
        call.add_done_callback(self._on_done)

    def _on_done(self, call) -> None:
        self._record.ended_s = time.monotonic()
        self._record.code = call.code()
        self._record.details = call.details() or ""
        self._record.retry_after_s = status_map.retry_after_from_status(call.trailing_metadata(), call.details())

    def __iter__(self):
        return self

    def __next__(self):
        message = next(self._call)
        if self._record.first_message_s is None:
            self._record.first_message_s = time.monotonic()
        return message

    def __getattr__(self, name):
        return getattr(self._call, name)


class _AttemptRecorder(grpc.UnaryStreamClientInterceptor):
    def __init__(self) -> None:
        self.attempts: list[Attempt] = []
        self._lock = threading.Lock()

    def intercept_unary_stream(self, continuation, client_call_details, request):
        number = int(status_map.metadata_value(client_call_details.metadata or (), status_map.ATTEMPT_KEY) or 1)
        record = Attempt(number, time.monotonic())
        with self._lock:
            self.attempts.append(record)
        return _ObservedCall(continuation(client_call_details, request), record)


@dataclass
class Outcome:
    succeeded: int = 0
    retryable_errors: int = 0
    other_errors: list[str] = field(default_factory=list)
    completion_tokens: int = 0
    latencies_s: list[float] = field(default_factory=list)  # successful requests, all attempts


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1000, 40000) for _ in range(PROMPT_TOKENS)] for _ in range(NUM_USERS)]


SAMPLING = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


def _backoff_user(channel, prompt: list[int], outcome: Outcome, lock: threading.Lock,
                  start: threading.Barrier) -> None:
    client = KvmeshClient("", channel=channel, retry_policy=RetryPolicy(max_attempts=MAX_ATTEMPTS))
    start.wait()
    started = time.monotonic()
    try:
        deltas = list(client.generate(prompt_token_ids=prompt, sampling=SAMPLING, timeout_s=120))
    except KvmeshError as exc:
        with lock:
            if exc.retryable:
                outcome.retryable_errors += 1
            else:
                outcome.other_errors.append(f"{type(exc).__name__}: {exc}")
        return
    with lock:
        outcome.succeeded += 1
        outcome.completion_tokens += deltas[-1].usage.completion_tokens
        outcome.latencies_s.append(time.monotonic() - started)


def _naive_user(channel, prompt: list[int], outcome: Outcome, lock: threading.Lock,
                start: threading.Barrier) -> None:
    """Retries at once, ignoring retry-after; marks the attempt number like the library."""
    stub = kvmesh_pb2_grpc.KvmeshStub(channel)
    request = convert.inbound_to_pb(convert.InboundRequest(prompt_token_ids=tuple(prompt), sampling=SAMPLING))
    start.wait()
    started = time.monotonic()
    for attempt in range(1, MAX_ATTEMPTS + 1):
        try:
            messages = list(stub.Generate(request, metadata=[(status_map.ATTEMPT_KEY, str(attempt))], timeout=120))
        except grpc.RpcError as error:
            if error.code() in RETRYABLE and attempt < MAX_ATTEMPTS:
                continue
            with lock:
                if error.code() in RETRYABLE:
                    outcome.retryable_errors += 1
                else:
                    outcome.other_errors.append(f"{error.code().name}: {error.details()}")
            return
        with lock:
            outcome.succeeded += 1
            outcome.completion_tokens += messages[-1].usage.completion_tokens
            outcome.latencies_s.append(time.monotonic() - started)
        return


@contextlib.contextmanager
def _no_collector_pauses():
    """The client's clocks stop with its Python threads: a full collection in the suite's
    process (a large heap by the time this module runs) stalls every thread that stamps an
    attempt's end, and the rejections that finish meanwhile are all stamped when it ends (a
    full-suite run saw 25 rejections stamped within 3 ms of each other at 661 ms, against
    52-166 ms quiet). So collect first and keep the collector off for the burst, as timeit does."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _burst(config: KvmeshConfig, user, seed: int) -> tuple[Outcome, list[Attempt], float]:
    """All users at once; returns their outcome, every attempt, and the wall time (s).
    The connection is up and every user's thread is ready before any sends (a barrier), so
    the burst arrives together however slowly this process starts its threads."""
    recorder = _AttemptRecorder()
    plain = grpc.insecure_channel(f"127.0.0.1:{config.router.grpc_port}")
    grpc.channel_ready_future(plain).result(timeout=30)
    channel = grpc.intercept_channel(plain, recorder)
    outcome, lock, start = Outcome(), threading.Lock(), threading.Barrier(NUM_USERS + 1)
    try:
        with _no_collector_pauses(), concurrent.futures.ThreadPoolExecutor(NUM_USERS) as pool:
            futures = [pool.submit(user, channel, p, outcome, lock, start) for p in _prompts(seed)]
            start.wait(timeout=60)
            started = time.monotonic()
            for future in futures:
                future.result()
            wall_s = time.monotonic() - started
    finally:
        channel.close()
    return outcome, recorder.attempts, wall_s


def _wait_idle(config: KvmeshConfig, timeout_s: float = 60.0) -> convert.ClusterStats:
    deadline = time.monotonic() + timeout_s
    with KvmeshClient(f"127.0.0.1:{config.router.grpc_port}") as client:
        while time.monotonic() < deadline:
            stats = client.get_stats(timeout_s=10)
            if (len(stats.workers) == 2 and all(w.healthy for w in stats.workers)
                    and all(w.num_running == 0 and w.num_waiting == 0 and w.num_blocks_used == 0
                            for w in stats.workers) and stats.totals.router_in_flight == 0):
                return stats
            time.sleep(0.1)
    raise AssertionError("the cluster did not return to idle")


def _max_concurrent_tokens(attempts: list[Attempt]) -> int:
    """Most retry attempts' KV tokens held at one time, counting each from its first
    message (after admission) to its end as the client sees it (a little after the router
    releases it: so this may overstate by a request or two, which the caller allows for)."""
    edges = []
    for a in attempts:
        if a.first_message_s is not None and a.ended_s is not None:
            edges += [(a.first_message_s, PROMPT_TOKENS + MAX_TOKENS), (a.ended_s, -(PROMPT_TOKENS + MAX_TOKENS))]
    held = peak = 0
    for _, delta in sorted(edges, key=lambda e: (e[0], e[1])):  # ends before starts at a tie
        held += delta
        peak = max(peak, held)
    return peak


def _recovered_share(outcome: Outcome, attempts: list[Attempt]) -> float:
    """Of the users whose first attempt was refused, the share that got in by retrying (each
    user makes one first attempt; a user refused first and then served is a success whose
    first attempt was not OK)."""
    first = [a for a in attempts if a.attempt == 1]
    refused_first = sum(a.code != grpc.StatusCode.OK for a in first)
    recovered = outcome.succeeded - sum(a.code == grpc.StatusCode.OK for a in first)
    return recovered / refused_first if refused_first else 0.0


def _attempt_account(name: str, attempts: list[Attempt]) -> str:
    """What a failed burst saw, as a message pytest prints whole: attempts by (attempt number,
    code, details), and the first attempts' starts, first messages and ends in ms after the
    first start (quartiles): a burst that never overloaded shows whether its calls left the
    client spread out or were taken in slowly on the other side."""
    account = collections.Counter((a.attempt, a.code.name if a.code else None, a.details[:80]) for a in attempts)
    first = min((a.started_s for a in attempts), default=0.0)
    firsts = [a for a in attempts if a.attempt == 1]

    def quartiles(times: list[float | None]) -> list[int]:
        ms = sorted(round(1000 * (t - first)) for t in times if t is not None)
        return [ms[min(len(ms) - 1, i * len(ms) // 4)] for i in range(5)] if ms else []

    return (f"{name}: attempts {dict(account)}; first attempts' ms (min, quartiles, max): "
            f"start {quartiles([a.started_s for a in firsts])}, "
            f"first message {quartiles([a.first_message_s for a in firsts])}, end {quartiles([a.ended_s for a in firsts])}")


def _summary(name: str, outcome: Outcome, attempts: list[Attempt], wall_s: float) -> dict:
    rejected = [a for a in attempts if a.code == grpc.StatusCode.RESOURCE_EXHAUSTED]
    return {"policy": name, "sent": NUM_USERS, "succeeded": outcome.succeeded,
            "retryable_errors": outcome.retryable_errors, "attempts": len(attempts),
            "rejections": len(rejected), "goodput_tokens_per_s": outcome.completion_tokens / wall_s,
            "wall_s": wall_s}


def test_retry_after_travels_in_the_details_when_trailing_metadata_is_lost():
    """No cluster: Serve's gRPC proxy keeps only code and details of a stream that fails
    before its first message, so the retry-after must survive in the details alone."""
    from kvmesh.core.errors import OverloadedError

    status = status_map.status_for(OverloadedError("server overloaded: admission queue full", 1.2345))
    details = status_map.grpc_details(status)
    assert details.endswith("retry-after-ms=1235]")  # rounded up: never earlier than asked
    assert status_map.retry_after_from_status((), details) == 1.235
    assert status_map.retry_after_from_status((("retry-after-ms", "70"),), details) == 0.07  # metadata wins
    assert status_map.retry_after_from_status((), "no hint here") is None
    error = status_map.error_from_grpc(grpc.StatusCode.RESOURCE_EXHAUSTED, details, None)
    assert isinstance(error, OverloadedError) and error.retry_after_s == 1.235
    assert error.message == "server overloaded: admission queue full"


def test_overload_rejects_fast_caps_retries_and_loses_nothing(cluster):
    idle = _wait_idle(cluster)
    capacity_tokens = idle.totals.kv_tokens_capacity
    results = {}
    for name, user, seed in (("naive", _naive_user, 1), ("backoff", _backoff_user, 2)):
        results[name] = _burst(cluster, user, seed)
        _wait_idle(cluster)  # every terminal path gave its blocks back

    for name, (outcome, attempts, wall_s) in results.items():
        # Nothing lost: every request ended in success or a retryable error its client saw.
        assert outcome.other_errors == [], outcome.other_errors
        assert NUM_USERS == outcome.succeeded + outcome.retryable_errors
        assert all(a.code is not None for a in attempts)
        # Accepted requests completed in full.
        assert all(a.code == grpc.StatusCode.OK for a in attempts if a.first_message_s is not None)
        assert outcome.completion_tokens == MAX_TOKENS * outcome.succeeded
        # Overload answers are RESOURCE_EXHAUSTED with a retry-after.
        rejected = [a for a in attempts if a.code == grpc.StatusCode.RESOURCE_EXHAUSTED]
        assert rejected, _attempt_account(name, attempts)
        assert all(a.retry_after_s is not None and a.retry_after_s > 0 for a in rejected)
        assert {a.code for a in attempts} <= {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}, (
            _attempt_account(name, attempts))
        # First attempts are turned away without waiting for capacity: the router says why
        # it refused, and most first-attempt refusals are the ones given on arrival (the
        # queue is full, or no room now), not a queue wait that ran out. The reason, not a
        # duration, is checked (durations on a shared machine flake); the measured times are
        # printed below with MEASURED.
        first_rejections = [a for a in rejected if a.attempt == 1]
        assert first_rejections and any(a.code == grpc.StatusCode.OK and a.attempt == 1 for a in attempts)
        on_arrival = [a for a in first_rejections if any(r in a.details for r in ARRIVAL_REFUSALS)]
        assert len(on_arrival) > len(first_rejections) / 2, [a.details for a in first_rejections]
        # Retries go through their lane: it turns hammering away, and those it admitted never
        # held more than its share of the KV budget (368 tokens: two of these 176-token
        # requests). Seen from the client, a release shows up late, so the next admitted retry
        # can overlap the one it replaced: allowed for by two requests (a full-suite run under
        # a CPU-heavy neighbour saw four requests; quiet runs see two or three).
        retries = [a for a in attempts if a.attempt > 1]
        if name == "naive":
            assert any("retry lane" in a.details for a in retries if a.code == grpc.StatusCode.RESOURCE_EXHAUSTED), (
                _attempt_account(name, attempts))
        assert (_max_concurrent_tokens(retries)
                <= RETRY_LANE_FRACTION * capacity_tokens + 2 * (PROMPT_TOKENS + MAX_TOKENS))

    summaries = {name: _summary(name, *result) for name, result in results.items()}
    for name, (outcome, attempts, wall_s) in results.items():
        rejections_ms = sorted(1000 * (a.ended_s - a.started_s) for a in attempts
                               if a.code == grpc.StatusCode.RESOURCE_EXHAUSTED and a.attempt == 1)
        accepted_ms = sorted(1000 * (a.ended_s - a.started_s) for a in attempts
                             if a.code == grpc.StatusCode.OK and a.attempt == 1)
        summaries[name].update(
            first_rejection_ms_p50=statistics.median(rejections_ms), first_rejection_ms_max=rejections_ms[-1],
            first_accepted_ms_p50=statistics.median(accepted_ms), first_accepted_ms_max=accepted_ms[-1],
            retry_attempts=sum(a.attempt > 1 for a in attempts),
            retry_lane_rejections=sum("retry lane" in a.details for a in attempts),
            retry_peak_tokens=_max_concurrent_tokens([a for a in attempts if a.attempt > 1]),
            recovered_share=_recovered_share(outcome, attempts),
            capacity_tokens=capacity_tokens)
        print(f"\nMEASURED overload {summaries[name]}")
    # No collapse, and waiting as told pays: of the users whose first attempt was refused, a
    # larger share gets in by waiting out retry-after (with jitter as long again) than by
    # retrying at once. A share, not a count of successes: how many first attempts a burst's
    # refusals hit depends on how fast a contended router takes the calls in, which neither
    # policy chooses (a full-suite run: the naive burst's calls reached admission over ~1.5 s
    # and 25 of 36 first attempts got in, against 11 when they arrive together).
    assert summaries["backoff"]["recovered_share"] > summaries["naive"]["recovered_share"], summaries
