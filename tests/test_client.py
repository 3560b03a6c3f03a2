"""router/client.py (+ retry.py, convert.py) against a real grpc.aio server on loopback.

The server here is a scripted test double of a *faulty* kvmesh server (it fails on cue:
RESOURCE_EXHAUSTED with retry-after, UNAVAILABLE mid-stream, too slow for the deadline).
Those faults cannot be produced on demand by the real router; the real server is the serve
engineer's and has its own tests. Everything else is real: gRPC over a TCP socket, the
generated stubs, status_map on the server side and convert on both sides.
"""

from __future__ import annotations

import dataclasses

import asyncio
import collections
import dataclasses
import random
import socket
import threading
import time

import grpc
import pytest

from kvmesh.proto import kvmesh_pb2 as pb
from kvmesh.proto import kvmesh_pb2_grpc as pb_grpc
from kvmesh.router import convert, status_map, tls
from kvmesh.core.config import TlsConfig
from kvmesh.router.client import AsyncKvmeshClient, KvmeshClient, StreamRestart, collect_text
from kvmesh.router.retry import RetryBudget, RetryPolicy, backoff_s, decide_retry
from kvmesh.core.seams import FinishReason, RequestDelta, SamplingParams, Usage, WorkerStats
from kvmesh.core.errors import (
    DeadlineExceededError,
    InvalidRequestError,
    OverloadedError,
    QuotaExceededError,
    RequestCancelledError,
    WorkerFailedError,
)

WORDS = ["The", " quick", " brown", " fox"]
FAST = RetryPolicy(max_attempts=4, initial_backoff_s=0.001, max_backoff_s=0.01)


class ScriptedKvmesh(pb_grpc.KvmeshServicer):
    """Behaviour chosen by the prompt: ok | overload:N | unavailable_mid | unavailable_first |
    unavailable_after_final | invalid | slow | hang | quota | reset_first | cancelled."""

    def __init__(self):
        self.calls: dict[str, list] = collections.defaultdict(list)  # request_id -> [(attempt, meta, t)]
        self.server_cancelled: set[str] = set()
        self.cancel_events: dict[str, asyncio.Event] = {}
        self.list_models_peers: list[str] = []  # the client address ("ipv4:127.0.0.1:PORT") of each call

    async def Generate(self, request, context):
        meta = convert.call_metadata_from_grpc(context.invocation_metadata())
        inp = convert.inbound_from_pb(request)
        self.calls[inp.request_id].append((meta.attempt, meta, time.monotonic(), inp))
        attempt = len(self.calls[inp.request_id])
        script, _, arg = (inp.prompt or "ok").partition(":")
        if script == "overload" and attempt <= int(arg):
            await status_map.abort_grpc(context, OverloadedError("KV budget exhausted", retry_after_s=0.05))
        if script == "quota":
            await status_map.abort_grpc(context, QuotaExceededError("tenant over budget", retry_after_s=7.0))
        if script == "invalid":
            await status_map.abort_grpc(context, InvalidRequestError("max_tokens too large"))
        if script == "unavailable_first" and attempt == 1:
            await status_map.abort_grpc(context, WorkerFailedError("worker died"))
        if script == "reset_first" and attempt == 1:
            # What gRPC core answers for a call that raced its server's shutdown: CANCELLED,
            # no kvmesh error kind (grpc/grpc#41785).
            await context.abort(grpc.StatusCode.CANCELLED, "CANCELLED")
        if script == "cancelled":
            await status_map.abort_grpc(context, RequestCancelledError("cancelled by its owner"))
        if script == "slow":
            await asyncio.sleep(5)
        try:
            # A resumed request continues after the tokens it says it has (one token per word).
            for i, word in list(enumerate(WORDS))[len(inp.resume_token_ids):]:
                if script == "unavailable_mid" and attempt == 1 and i == 2:
                    await status_map.abort_grpc(context, WorkerFailedError("worker died mid-stream"))
                if script == "hang" and i == 1:
                    event = self.cancel_events.setdefault(inp.request_id, asyncio.Event())
                    await event.wait()  # until Cancel RPC; client disconnect cancels this task
                    yield convert.delta_to_pb(RequestDelta(inp.request_id, finished=True,
                                                           finish_reason=FinishReason.ABORT))
                    return
                yield convert.delta_to_pb(RequestDelta(inp.request_id, text=word, token_ids=(i,)))
            yield convert.delta_to_pb(RequestDelta(
                inp.request_id, finished=True, finish_reason=FinishReason.LENGTH,
                usage=Usage(prompt_tokens=3, completion_tokens=len(WORDS), cached_tokens=1)))
            if script == "unavailable_after_final" and attempt == 1:
                # The replica went away after the last message, before the call's OK status.
                await status_map.abort_grpc(context, WorkerFailedError("router replica died"))
        except asyncio.CancelledError:
            self.server_cancelled.add(inp.request_id)
            raise

    async def Cancel(self, request, context):
        event = self.cancel_events.get(request.request_id)
        if event is not None:
            event.set()
        return pb.CancelResponse(found=event is not None)

    async def ListModels(self, request, context):
        self.list_models_peers.append(context.peer())
        return convert.models_to_pb([convert.ModelInfo("smollm2", max_model_len=2048, block_size=16)])

    async def Health(self, request, context):
        if self.calls.get("health-flaky") is None:  # first Health call: UNAVAILABLE, then serve
            self.calls["health-flaky"].append(None)
            await status_map.abort_grpc(context, WorkerFailedError("starting"))
        return convert.health_to_pb(convert.HealthStatus(True, num_workers=2, num_healthy_workers=1))

    async def GetStats(self, request, context):
        workers = [_worker_stats("w0", True), _worker_stats("w1", False)]
        totals = convert.ClusterTotals.from_workers(workers, router_queue_len=3, router_in_flight=5)
        return convert.cluster_stats_to_pb(convert.ClusterStats(tuple(workers), totals))


def _worker_stats(worker_id, healthy):
    return WorkerStats(worker_id=worker_id, healthy=healthy, block_size=16, num_blocks_total=100,
                       num_blocks_used=10, num_blocks_cached=5, num_blocks_free=85, kv_tokens_used=160,
                       kv_tokens_capacity=1600, kv_tokens_reserved=400, num_running=2, num_waiting=1,
                       queued_prompt_tokens=30, prefix_cache_hit_rate=0.25, output_tokens_per_s=42.5,
                       prefix_event_seq=7)


class ServerThread:
    """The aio server on its own event loop thread, so blocking clients can call it too."""

    def __init__(self, tls_config: TlsConfig = TlsConfig(), port: int = 0):
        self.servicer = ScriptedKvmesh()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.port = asyncio.run_coroutine_threadsafe(self._start(tls_config, port), self.loop).result(10)
        # A TLS client checks the name: the test certificates are for localhost.
        self.target = f"{'localhost' if tls_config.enabled else '127.0.0.1'}:{self.port}"

    async def _start(self, tls_config: TlsConfig, port: int):
        self.server = grpc.aio.server()
        pb_grpc.add_KvmeshServicer_to_server(self.servicer, self.server)
        port = tls.add_grpc_port(self.server, f"127.0.0.1:{port}", tls_config)  # plaintext unless configured
        await self.server.start()
        return port

    def stop(self):
        asyncio.run_coroutine_threadsafe(self.server.stop(None), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def server():
    srv = ServerThread()
    yield srv
    srv.stop()


def wait_until(predicate, timeout_s=5.0):
    end = time.monotonic() + timeout_s
    while not predicate() and time.monotonic() < end:
        time.sleep(0.01)
    return predicate()


# ---- blocking client ---------------------------------------------------------------------

def test_stream_yields_plain_deltas_and_sends_key_attempt_and_trace(server):
    trace = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}
    with KvmeshClient(server.target, api_key="sk-test", retry_policy=FAST) as client:
        deltas = list(client.generate("ok", sampling=SamplingParams(max_tokens=4, temperature=0.0),
                                      request_id="r-ok", trace_context=trace))
    assert all(isinstance(d, RequestDelta) for d in deltas)
    assert collect_text(deltas) == "".join(WORDS)
    final = deltas[-1]
    assert final.finished and final.finish_reason is FinishReason.LENGTH
    assert final.usage == Usage(prompt_tokens=3, completion_tokens=4, cached_tokens=1)
    [(attempt, meta, _, inp)] = server.servicer.calls["r-ok"]
    assert (attempt, meta.api_key, meta.trace_context) == (1, "sk-test", trace)
    assert inp.sampling.temperature == 0.0 and inp.sampling.max_tokens == 4


def test_overloaded_twice_then_success_retries_with_attempt_numbers_after_retry_after(server):
    waits_s: list[float] = []
    with KvmeshClient(server.target, retry_policy=FAST, sleep=waits_s.append) as client:
        deltas = list(client.generate("overload:2", request_id="r-over"))
    assert collect_text(deltas) == "".join(WORDS)
    calls = server.servicer.calls["r-over"]
    assert [c[0] for c in calls] == [1, 2, 3]
    # The server's retry-after-ms (50) is a floor, FAST's jitter (at most 10 ms) goes on top.
    assert len(waits_s) == 2 and all(0.05 <= w <= 0.06 for w in waits_s), waits_s


def test_non_retryable_errors_raise_the_typed_error_after_one_attempt(server):
    with KvmeshClient(server.target, retry_policy=FAST) as client:
        with pytest.raises(InvalidRequestError, match="max_tokens too large") as info:
            list(client.generate("invalid", request_id="r-invalid"))
    assert info.value.attempts == 1 and len(server.servicer.calls["r-invalid"]) == 1


def test_failure_before_any_token_is_retried_transparently(server):
    with KvmeshClient(server.target, retry_policy=FAST) as client:
        deltas = list(client.generate("unavailable_first", request_id="r-first"))
    assert not any(isinstance(d, StreamRestart) for d in deltas)
    assert collect_text(deltas) == "".join(WORDS)


def test_a_cancelled_no_kvmesh_handler_sent_is_retried_and_a_kvmesh_cancel_is_not(server):
    with KvmeshClient(server.target, retry_policy=FAST) as client:
        deltas = list(client.generate("reset_first", request_id="r-reset"))
        assert collect_text(deltas) == "".join(WORDS) and len(server.servicer.calls["r-reset"]) == 2
        with pytest.raises(RequestCancelledError):
            list(client.generate("cancelled", request_id="r-cancelled"))
    assert len(server.servicer.calls["r-cancelled"]) == 1


def test_mid_stream_failure_resumes_with_what_was_received_no_token_twice(server):
    with KvmeshClient(server.target, retry_policy=FAST) as client:
        deltas = list(client.generate("unavailable_mid", request_id="r-resume"))
    assert not any(isinstance(d, StreamRestart) for d in deltas)
    assert [t for d in deltas for t in d.token_ids] == list(range(len(WORDS)))  # none missing, none twice
    assert collect_text(deltas) == "".join(WORDS)
    first, second = [call[3] for call in server.servicer.calls["r-resume"]]
    assert first.resume_token_ids == () and second.resume_token_ids == (0, 1)
    assert second.resume_text_chars == len(WORDS[0] + WORDS[1])
    assert second.prompt == first.prompt and second.sampling == first.sampling
    # n > 1 is never resumed (which sample would it continue?): it raises as before.
    with KvmeshClient(server.target, retry_policy=FAST) as client:
        with pytest.raises(WorkerFailedError):
            list(client.generate("unavailable_mid", request_id="r-resume-n2", sampling=SamplingParams(n=2)))


def test_an_error_after_the_final_message_leaves_the_stream_complete(server):
    """The call ends UNAVAILABLE after the final message arrived (the router replica died
    while settling the request): the output is whole, so nothing is resumed or retried (a
    resumption would carry all max_tokens tokens, which the server refuses)."""
    with KvmeshClient(server.target, retry_policy=FAST) as client:
        deltas = list(client.generate("unavailable_after_final", request_id="r-after-final"))
    assert [t for d in deltas for t in d.token_ids] == list(range(len(WORDS)))
    assert [d.finished for d in deltas] == [False] * len(WORDS) + [True]
    assert len(server.servicer.calls["r-after-final"]) == 1

    async def main():
        async with AsyncKvmeshClient(server.target, retry_policy=FAST) as client:
            return [d async for d in client.generate("unavailable_after_final", request_id="a-after-final")]
    assert collect_text(asyncio.run(main())) == "".join(WORDS)
    assert len(server.servicer.calls["a-after-final"]) == 1


def test_mid_stream_failure_raises_without_resumption_and_restarts_when_asked(server):
    with KvmeshClient(server.target, retry_policy=FAST, resume_mid_stream=False) as client:
        received = []
        with pytest.raises(WorkerFailedError) as info:
            for delta in client.generate("unavailable_mid", request_id="r-mid"):
                received.append(delta)
    assert info.value.tokens_received == 2 and len(received) == 2
    assert len(server.servicer.calls["r-mid"]) == 1

    with KvmeshClient(server.target, retry_policy=FAST, restart_mid_stream=True, resume_mid_stream=False) as client:
        items = list(client.generate("unavailable_mid", request_id="r-mid-restart"))
    restarts = [i for i in items if isinstance(i, StreamRestart)]
    assert len(restarts) == 1 and restarts[0].attempt == 2
    assert items.index(restarts[0]) == 2  # after the two deltas of the failed attempt
    assert collect_text(items) == "".join(WORDS)


def test_deadline_raises_deadline_exceeded(server):
    with KvmeshClient(server.target, retry_policy=FAST) as client:
        with pytest.raises(DeadlineExceededError):
            list(client.generate("slow", request_id="r-slow", timeout_s=0.2))


def test_retry_budget_stops_retries_in_a_sustained_overload(server):
    tight = RetryPolicy(max_attempts=5, initial_backoff_s=0.001, max_backoff_s=0.01, budget_max_tokens=3.0)
    with KvmeshClient(server.target, retry_policy=tight) as client:
        with pytest.raises(OverloadedError) as info:
            list(client.generate("overload:100", request_id="r-storm"))
        # 3 tokens: the first failure leaves 2 (> 1.5, retry), the second 1 (<= 1.5, stop)
        assert len(server.servicer.calls["r-storm"]) == 2
        assert info.value.retry_after_s == pytest.approx(0.05)
        assert client.budget.tokens == 1.0


def test_quota_exceeded_comes_back_typed_with_its_retry_after(server):
    policy = RetryPolicy(max_attempts=1)
    with KvmeshClient(server.target, retry_policy=policy) as client:
        with pytest.raises(QuotaExceededError) as info:
            list(client.generate("quota", request_id="r-quota"))
    assert info.value.retry_after_s == 7.0


def test_cancel_rpc_and_stopping_early_both_reach_the_server(server):
    with KvmeshClient(server.target, retry_policy=FAST) as client:
        stream = client.generate("hang", request_id="r-hang")
        assert next(stream).text == "The"
        assert wait_until(lambda: "r-hang" in server.servicer.cancel_events)
        assert client.cancel("r-hang") is True
        rest = list(stream)
        assert rest[-1].finish_reason is FinishReason.ABORT
        assert client.cancel("unknown-id") is False

        stream = client.generate("hang", request_id="r-walk-away")
        next(stream)
        stream.close()  # the caller stops reading: the RPC is cancelled, the server notices
    assert wait_until(lambda: "r-walk-away" in server.servicer.server_cancelled)


def test_unary_rpcs_convert_and_retry_unavailable(server):
    with KvmeshClient(server.target, retry_policy=FAST) as client:
        assert client.list_models() == [convert.ModelInfo("smollm2", "kvmesh", 2048, 16)]
        assert client.health() == convert.HealthStatus(True, 2, 1)  # first call failed, retried
        stats = client.get_stats()
    assert stats.workers == (_worker_stats("w0", True), _worker_stats("w1", False))
    assert stats.totals.num_healthy_workers == 1 and stats.totals.kv_tokens_capacity == 1600
    assert (stats.totals.router_queue_len, stats.totals.router_in_flight) == (3, 5)


def test_own_connection_channels_reach_the_server_from_connections_of_their_own(server):
    """Router replicas share the gRPC port and the kernel spreads connections over them: a
    client with its own connection is what lets a load generator reach more than one."""
    peers = server.servicer.list_models_peers

    def peers_of(**kwargs) -> set[str]:
        del peers[:]
        clients = [KvmeshClient(server.target, **kwargs) for _ in range(3)]
        for client in clients:
            client.list_models()
        for client in clients:
            client.close()
        return set(peers)

    assert len(peers_of()) == 1  # gRPC's shared subchannel pool: one connection for all three
    assert len(peers_of(own_connection=True)) == 3


def test_connection_refused_is_unavailable_and_typed():
    policy = RetryPolicy(max_attempts=2, initial_backoff_s=0.001, max_backoff_s=0.001)
    with KvmeshClient("127.0.0.1:1", retry_policy=policy) as client:
        with pytest.raises(WorkerFailedError) as info:
            list(client.generate("ok", timeout_s=5))
    assert info.value.attempts == 2


def test_a_retry_after_a_failed_connection_waits_for_the_channel_to_connect():
    """The first attempt finds no server (connection refused); one is listening before the
    retry. gRPC's channel waits out its reconnect backoff (~1 s) and fails every call sent
    meanwhile at once: retries sent without waiting for the connection would all fail (as a
    killed router replica's resumptions did while the other replica served the port)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    servers = []

    def sleep_then_serve(delay_s: float) -> None:  # the client's wait before its first retry
        if not servers:
            servers.append(ServerThread(port=port))
        time.sleep(delay_s)

    policy = RetryPolicy(max_attempts=4, initial_backoff_s=0.01, max_backoff_s=0.05)
    try:
        with KvmeshClient(f"127.0.0.1:{port}", retry_policy=policy, sleep=sleep_then_serve) as client:
            assert collect_text(client.generate("ok", request_id="r-reconnect", timeout_s=30)) == "".join(WORDS)

        servers.pop().stop()

        async def main():  # the asyncio client: the server starts once its first attempt was refused
            async with AsyncKvmeshClient(f"127.0.0.1:{port}", retry_policy=policy, own_connection=True) as client:
                async def collect():
                    return [d async for d in client.generate("ok", request_id="a-reconnect", timeout_s=30)]
                task = asyncio.create_task(collect())
                deadline = time.monotonic() + 10
                while (client._channel.get_state() != grpc.ChannelConnectivity.TRANSIENT_FAILURE
                       and not task.done() and time.monotonic() < deadline):
                    await asyncio.sleep(0.002)
                servers.append(await asyncio.get_running_loop().run_in_executor(None, ServerThread, TlsConfig(), port))
                return await task
        assert collect_text(asyncio.run(main())) == "".join(WORDS)
        assert [call[0] for call in servers[0].servicer.calls["a-reconnect"]][-1] > 1  # a retry got through
    finally:
        for srv in servers:
            srv.stop()


# ---- asyncio client ----------------------------------------------------------------------

def test_async_client_streams_retries_and_cancels(server):
    async def main():
        async with AsyncKvmeshClient(server.target, api_key="sk-async", retry_policy=FAST) as client:
            deltas = [d async for d in client.generate("overload:1", request_id="a-over")]
            assert collect_text(deltas) == "".join(WORDS)
            assert [c[0] for c in server.servicer.calls["a-over"]] == [1, 2]
            assert server.servicer.calls["a-over"][1][1].api_key == "sk-async"

            resumed = [d async for d in client.generate("unavailable_mid", request_id="a-mid")]
            assert [t for d in resumed for t in d.token_ids] == list(range(len(WORDS)))

            async def consume():
                async for _ in client.generate("hang", request_id="a-hang"):
                    pass

            task = asyncio.ensure_future(consume())
            while "a-hang" not in server.servicer.cancel_events:
                await asyncio.sleep(0.01)
            task.cancel()  # the consuming task goes away: the RPC is cancelled
            with pytest.raises(asyncio.CancelledError):
                await task

            with pytest.raises(DeadlineExceededError):
                async for _ in client.generate("slow", timeout_s=0.2):
                    pass
            assert (await client.health()).serving
            assert (await client.get_stats()).totals.num_workers == 2
    asyncio.run(main())
    assert wait_until(lambda: "a-hang" in server.servicer.server_cancelled)


# ---- retry policy and conversions on their own --------------------------------------------

def test_full_jitter_backoff_stays_in_its_window_and_honours_retry_after():
    policy = RetryPolicy(initial_backoff_s=0.1, max_backoff_s=1.0, multiplier=2.0)
    rng = random.Random(0)
    for retry_number, cap in [(1, 0.1), (2, 0.2), (3, 0.4), (4, 0.8), (5, 1.0), (9, 1.0)]:
        samples = [backoff_s(retry_number, policy, rng) for _ in range(200)]
        assert all(0 <= s <= cap for s in samples)
        assert max(samples) > 0.8 * cap and min(samples) < 0.2 * cap  # spread over the whole window
    # Retry-after is the floor, and the jitter window is at least as long as it (up to the
    # max): clients told the same wait come back spread over it, not within 0.1 s of each other.
    told = [backoff_s(1, RetryPolicy(max_backoff_s=5.0), rng, retry_after_s=2.0) for _ in range(200)]
    assert all(2.0 <= s <= 4.0 for s in told) and max(told) > 3.6 and min(told) < 2.4
    assert all(2.0 <= backoff_s(1, policy, rng, retry_after_s=2.0) <= 3.0 for _ in range(50))  # max_backoff_s 1


def test_retry_budget_limits_retries_to_a_fraction_of_successes():
    def run(fail_every):
        budget, retries, successes = RetryBudget(max_tokens=10, token_ratio=0.1), 0, 0
        for i in range(1000):
            if i % fail_every == 0:
                budget.record_retryable_failure()
                retries += budget.allows_retry()
            else:
                budget.record_success()
                successes += 1
        return retries, successes

    # rare failures (5%): 19 successes refill 1.9 tokens per failure, every retry is allowed
    assert run(20) == (50, 950)
    # half the requests fail: retries are capped near token_ratio x successes (+ the half bucket)
    retries, successes = run(2)
    assert retries <= 0.1 * successes + 5 and retries < 500 * 0.15
    storm = RetryBudget(max_tokens=10, token_ratio=0.1)
    allowed = 0
    for _ in range(100):  # everything fails
        storm.record_retryable_failure()
        allowed += storm.allows_retry()
    assert allowed == 4  # 9, 8, 7, 6 tokens allowed; from 5 (= half) on, no more retries


def test_decide_retry_rules():
    policy, rng = FAST, random.Random(0)
    no = decide_retry(grpc.StatusCode.INVALID_ARGUMENT, 1, None, policy, RetryBudget(), rng)
    assert not no.retry
    assert not decide_retry(grpc.StatusCode.UNAVAILABLE, 4, None, policy, RetryBudget(), rng).retry
    assert not decide_retry(grpc.StatusCode.UNAVAILABLE, 1, None, policy, RetryBudget(), rng, tokens_received=3).retry
    assert decide_retry(grpc.StatusCode.UNAVAILABLE, 1, None, policy, RetryBudget(), rng, tokens_received=3,
                        restart_mid_stream=True).retry
    late = decide_retry(grpc.StatusCode.RESOURCE_EXHAUSTED, 1, 5.0, policy, RetryBudget(), rng, time_left_s=1.0)
    assert not late.retry and "deadline" in late.reason


def test_resumptions_neither_spend_nor_wait_for_the_retry_budget():
    """A replica that stops breaks all its streams at once: one client carrying 16 of them
    resumes every one (a restart from scratch, or a failure before any token, still pays)."""
    policy, rng, budget = FAST, random.Random(0), RetryBudget(max_tokens=10.0)
    for _ in range(16):
        assert decide_retry(grpc.StatusCode.UNAVAILABLE, 1, None, policy, budget, rng, tokens_received=3,
                            resuming=True).retry
    assert budget.tokens == 10.0
    assert not decide_retry(grpc.StatusCode.UNAVAILABLE, 4, None, policy, budget, rng, tokens_received=3,
                            resuming=True).retry  # max_attempts still bounds it
    for _ in range(5):
        decide_retry(grpc.StatusCode.UNAVAILABLE, 1, None, policy, budget, rng, resuming=True)  # nothing received
    assert budget.tokens == 5.0
    assert not decide_retry(grpc.StatusCode.UNAVAILABLE, 1, None, policy, budget, rng, tokens_received=3,
                            restart_mid_stream=True).retry  # a restart is refused work again: throttled
    assert decide_retry(grpc.StatusCode.UNAVAILABLE, 1, None, policy, budget, rng, tokens_received=3,
                        resuming=True).retry


def test_sampling_and_delta_conversions_round_trip():
    sampling = SamplingParams(max_tokens=7, temperature=0.0, top_k=5, top_p=0.9, seed=123, stop=("\n",),
                              stop_token_ids=(2,), logprobs=True, n=2, min_tokens=1, ignore_eos=True)
    assert convert.sampling_from_pb(convert.sampling_to_pb(sampling)) == sampling
    assert convert.sampling_from_pb(pb.SamplingParams()) == SamplingParams()
    delta = RequestDelta("r", text="é", token_ids=(5, 6), logprobs=(-0.5, -1.25), finished=True,
                         finish_reason=FinishReason.STOP, usage=Usage(3, 2, 1), sample_index=1)
    assert convert.delta_from_pb(convert.delta_to_pb(delta)) == delta
    capped = dataclasses.replace(delta, finish_reason=FinishReason.LENGTH, degraded="cap")  # the ladder's flag
    assert convert.delta_to_pb(capped).degraded == "cap" and convert.delta_from_pb(convert.delta_to_pb(capped)) == capped


def test_inbound_request_and_metadata_validation():
    with pytest.raises(InvalidRequestError):
        convert.inbound_from_pb(pb.GenerateRequest(request_id="x"))
    with pytest.raises(InvalidRequestError):
        convert.inbound_to_pb(convert.InboundRequest("x", "", prompt="a", prompt_token_ids=(1,)))
    chat = convert.InboundRequest("x", "m", messages=(convert.ChatMessage("user", "hi"),))
    assert convert.inbound_from_pb(convert.inbound_to_pb(chat)) == chat
    # The call metadata joins the message in the one inbound form; the message never carries it.
    call = convert.CallMetadata(api_key="sk-1", attempt=2, trace_context={"traceparent": "00-ab-cd-01"})
    full = convert.inbound_from_pb(convert.inbound_to_pb(chat), call, deadline_s=123.0)
    assert full == dataclasses.replace(chat, api_key="sk-1", attempt=2, deadline_s=123.0,
                                       trace_context={"traceparent": "00-ab-cd-01"})
    assert convert.inbound_to_pb(full) == convert.inbound_to_pb(chat)
    with pytest.raises(InvalidRequestError):
        convert.call_metadata_from_grpc([("x-kvmesh-attempt", "zero")])
    meta = convert.call_metadata_from_grpc([("authorization", "Bearer  sk-1 "), ("x-kvmesh-attempt", "3")])
    assert (meta.api_key, meta.attempt) == ("sk-1", 3)
    assert convert.call_metadata_from_grpc([("authorization", "Basic abc")]).api_key is None
