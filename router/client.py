"""The kvmesh gRPC client library: `KvmeshClient` (blocking) and `AsyncKvmeshClient` (asyncio).

    with KvmeshClient("127.0.0.1:50051", api_key="sk-...") as client:
        for delta in client.generate("Hello", sampling=SamplingParams(max_tokens=16, temperature=0)):
            print(delta.text, end="")

Both yield plain `kvmesh.core.seams.RequestDelta`s (the last one has finished=True, the
finish reason and usage) and raise the typed errors of `kvmesh.core.errors`, rebuilt from
the gRPC status by `router/status_map.py`.

TLS: `KvmeshClient(target, api_key=..., credentials=grpc_channel_credentials(ca_file))`
(router/tls.py; add cert_file/key_file for mutual TLS). An API key is a bearer secret: send
it over TLS whenever the network between client and router is not yours.

Retries (router/retry.py): RESOURCE_EXHAUSTED and UNAVAILABLE only (and a CANCELLED that no
kvmesh handler sent, counted as UNAVAILABLE: status_map.code_to_act_on), exponential backoff
with full jitter on top of the server's `retry-after-ms`, a shared retry budget (gRPC retry
throttling), attempt numbers sent as `x-kvmesh-attempt` so the router puts retries in its
retry lane, and an overall deadline (`timeout_s`) that covers every attempt and the sleeps
between them. One request id is kept across attempts (client-assigned when not given) so
`cancel(request_id)` reaches whichever attempt is running.

Streaming retry semantics (our choice): a stream that failed before delivering any token is
retried: the caller has seen nothing, so a retry is invisible. A single-sample stream (n = 1)
that fails retryably after tokens arrived (its router replica or worker went away:
UNAVAILABLE) is resumed: the request is sent again with the token ids and the length of the
text already received (proto GenerateRequest.resume_token_ids / resume_text_chars, docs/
api.md), and the server sends exactly the missing rest, so the caller sees one stream with
no token repeated or missing (`resume_mid_stream=False` turns this off: the error is raised,
carrying `tokens_received`). Otherwise (n > 1, or resumption off) `restart_mid_stream=True`
restarts such a stream from scratch, and the generator first yields a `StreamRestart` marker:
discard everything received so far. A stream whose final message (every sample's) arrived is
complete, whatever status its call ends with afterwards: nothing is retried or resumed then.

Stopping early (breaking out of the loop, closing the generator, cancelling the consuming
task) cancels the RPC, and the server aborts the request and frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass

import grpc

from kvmesh.proto import kvmesh_pb2 as pb
from kvmesh.proto import kvmesh_pb2_grpc as pb_grpc
from kvmesh.router import convert, status_map
from kvmesh.router.retry import RetryBudget, RetryPolicy, decide_retry
from kvmesh.core.seams import RequestDelta, SamplingParams
from kvmesh.core.errors import DeadlineExceededError, KvmeshError

logger = logging.getLogger(__name__)


def open_channel(target: str, credentials: grpc.ChannelCredentials | None = None, *,
                 own_connection: bool = False, aio: bool = False):
    """A gRPC channel to the router (grpc.aio's when `aio`). With credentials (router/tls.py
    grpc_channel_credentials: the CA to trust, and a client certificate for mutual TLS) it
    speaks TLS.

    `own_connection`: router replicas on one node share the gRPC port, and the kernel spreads
    connections, not calls, over them; gRPC shares one connection among all of a process's
    channels to one target, so without this every channel lands on one replica. A channel
    with a subchannel pool of its own opens its own connection (load generators, and tests
    that need both replicas to take part, want this)."""
    module = grpc.aio if aio else grpc
    options = [("grpc.use_local_subchannel_pool", 1)] if own_connection else None
    if credentials is None:
        return module.insecure_channel(target, options=options)
    return module.secure_channel(target, credentials, options=options)


@dataclass(frozen=True)
class StreamRestart:
    """Yielded when a failed stream restarts from scratch: drop the deltas received so far."""

    attempt: int  # the attempt now starting
    reason: str


class _Call:
    """Per-request retry state shared by the blocking and the asyncio client."""

    def __init__(self, client: "_ClientBase", timeout_s: float | None, trace_context: dict[str, str] | None):
        self.client = client
        self.attempt = 1
        self.deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self.trace_context = dict(trace_context or {})
        self.reconnect_first = False  # the last attempt failed UNAVAILABLE: see RetryPolicy.reconnect_wait_s

    def time_left_s(self) -> float | None:
        if self.deadline is None:
            return None
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise DeadlineExceededError(f"deadline passed after {self.attempt - 1} attempt(s)")
        return left

    def metadata(self) -> tuple[tuple[str, str], ...]:
        meta = convert.CallMetadata(api_key=self.client.api_key, attempt=self.attempt,
                                    trace_context=self.trace_context)
        return convert.call_metadata_to_grpc(meta)

    def on_failure(self, error: grpc.RpcError, tokens_received: int = 0, restart_mid_stream: bool = False,
                   resuming: bool = False) -> float:
        """Seconds to wait before the next attempt, or raise the typed error."""
        code, details, trailing = error.code(), error.details(), error.trailing_metadata()
        if not self.client.closed:  # closing the client cancels its calls: that CANCELLED is ours
            code = status_map.code_to_act_on(code, details, trailing)
        retry_after_s = status_map.retry_after_from_status(trailing, details)
        left = None if self.deadline is None else self.deadline - time.monotonic()
        decision = decide_retry(code, self.attempt, retry_after_s, self.client.policy, self.client.budget,
                                self.client.rng, tokens_received=tokens_received,
                                restart_mid_stream=restart_mid_stream, resuming=resuming, time_left_s=left)
        if not decision.retry:
            typed = status_map.error_from_grpc(code, details, trailing)
            typed.attempts = self.attempt
            typed.tokens_received = tokens_received
            if status_map.is_retryable(code):
                logger.debug("not retrying %s: %s", code.name, decision.reason)
            raise typed from None
        logger.debug("attempt %d failed with %s; retrying in %.3f s", self.attempt, code.name, decision.delay_s)
        self.attempt += 1
        self.reconnect_first = code == grpc.StatusCode.UNAVAILABLE
        return decision.delay_s

    def reconnect_wait_s(self) -> float:
        """How long the next attempt may wait for the channel to connect (0: it need not)."""
        if not self.reconnect_first:
            return 0.0
        left = None if self.deadline is None else self.deadline - time.monotonic()
        return max(0.0, min(self.client.policy.reconnect_wait_s, left if left is not None else float("inf")))


class _Resumption:
    """What one stream has delivered so far, for resuming it after a mid-stream failure."""

    def __init__(self, request: pb.GenerateRequest, enabled: bool):
        self.request = request  # what the next attempt sends
        self.num_samples = max(1, request.sampling.n)  # proto 0 = unset = 1
        self.enabled = enabled and self.num_samples == 1
        self.token_ids: list[int] = list(request.resume_token_ids)
        self.text_chars = request.resume_text_chars
        self.finished_samples: set[int] = set()
        # Messages with tokens or text delivered over all attempts: an attempt that fails before
        # its first token still continues a stream that delivered some earlier (a resumption).
        self.delivered = 0

    def observe(self, delta: RequestDelta) -> None:
        self.delivered += _delivered(delta)
        if not delta.error:
            self.token_ids.extend(delta.token_ids)
            self.text_chars += len(delta.text)
        if delta.finished:
            self.finished_samples.add(delta.sample_index)

    @property
    def complete(self) -> bool:
        """Every sample's final message arrived: the output is whole. The call can still end
        with an error after it (the router replica dies, or is stopped, between sending the
        last message and the call's OK status, while it settles the request's accounting);
        that error is not the stream's, and resuming would ask for more than max_tokens."""
        return len(self.finished_samples) >= self.num_samples

    def after_failure(self, received: int) -> None:
        """The next attempt continues after what arrived (when this attempt delivered any)."""
        if self.enabled and received:
            request = pb.GenerateRequest()
            request.CopyFrom(self.request)
            request.resume_token_ids[:] = self.token_ids
            request.resume_text_chars = self.text_chars
            self.request = request


class _ClientBase:
    def __init__(self, api_key: str | None, retry_policy: RetryPolicy | None, rng: random.Random | None,
                 restart_mid_stream: bool, resume_mid_stream: bool = True):
        self.api_key = api_key
        self.policy = retry_policy or RetryPolicy()
        self.budget = RetryBudget(self.policy.budget_max_tokens, self.policy.budget_token_ratio)
        self.rng = rng or random.Random()
        self.restart_mid_stream = restart_mid_stream
        self.resume_mid_stream = resume_mid_stream
        self.closed = False  # close() called: a call it cancelled is not retried

    @staticmethod
    def build_request(prompt: str | None, messages: Sequence[dict] | None, prompt_token_ids: Sequence[int] | None,
                      sampling: SamplingParams | None, model: str, request_id: str | None,
                      priority: int) -> pb.GenerateRequest:
        chat = None if messages is None else tuple(convert.ChatMessage(m["role"], m["content"]) for m in messages)
        request = convert.InboundRequest(
            request_id=request_id or uuid.uuid4().hex, model=model, prompt=prompt, messages=chat,
            prompt_token_ids=None if prompt_token_ids is None else tuple(prompt_token_ids),
            sampling=sampling or SamplingParams(), priority=priority)
        return convert.inbound_to_pb(request)


def _delivered(delta: RequestDelta) -> bool:
    return bool(delta.token_ids or delta.text)


class KvmeshClient(_ClientBase):
    """Blocking client over one gRPC channel. Thread-safe like the channel it wraps."""

    def __init__(self, target: str, *, api_key: str | None = None, retry_policy: RetryPolicy | None = None,
                 rng: random.Random | None = None, restart_mid_stream: bool = False,
                 channel: grpc.Channel | None = None, sleep: Callable[[float], None] = time.sleep,
                 credentials: grpc.ChannelCredentials | None = None, resume_mid_stream: bool = True,
                 own_connection: bool = False):
        super().__init__(api_key, retry_policy, rng, restart_mid_stream, resume_mid_stream)
        self._sleep = sleep  # the wait between attempts (tests inject one to see the delays)
        self._channel = channel or open_channel(target, credentials, own_connection=own_connection)
        self._stub = pb_grpc.KvmeshStub(self._channel)

    def generate(self, prompt: str | None = None, *, messages: Sequence[dict] | None = None,
                 prompt_token_ids: Sequence[int] | None = None, sampling: SamplingParams | None = None,
                 model: str = "", request_id: str | None = None, priority: int = 0,
                 timeout_s: float | None = None, trace_context: dict[str, str] | None = None,
                 ) -> Iterator[RequestDelta | StreamRestart]:
        request = self.build_request(prompt, messages, prompt_token_ids, sampling, model, request_id, priority)
        resumption = _Resumption(request, self.resume_mid_stream)
        call = _Call(self, timeout_s, trace_context)
        while True:
            received = 0
            stream = self._stub.Generate(resumption.request, metadata=call.metadata(), timeout=call.time_left_s())
            try:
                for message in stream:
                    delta = convert.delta_from_pb(message)
                    received += _delivered(delta)
                    resumption.observe(delta)
                    yield delta
                self.budget.record_success()
                return
            except grpc.RpcError as error:
                if resumption.complete:
                    logger.debug("stream complete; its call then ended %s", error.code().name)
                    self.budget.record_success()
                    return
                delay_s = call.on_failure(error, resumption.delivered, self.restart_mid_stream, resumption.enabled)
            finally:
                stream.cancel()  # no-op once finished; aborts the request if the caller stopped early
            self._sleep(delay_s)
            self._wait_for_connection(call.reconnect_wait_s())
            resumption.after_failure(received)
            if received and not resumption.enabled:
                yield StreamRestart(call.attempt, "stream failed mid-way; restarted from scratch")

    def cancel(self, request_id: str, timeout_s: float | None = None) -> bool:
        return self._unary(self._stub.Cancel, pb.CancelRequest(request_id=request_id), timeout_s).found

    def list_models(self, timeout_s: float | None = None) -> list[convert.ModelInfo]:
        return convert.models_from_pb(self._unary(self._stub.ListModels, pb.ListModelsRequest(), timeout_s))

    def health(self, timeout_s: float | None = None) -> convert.HealthStatus:
        return convert.health_from_pb(self._unary(self._stub.Health, pb.HealthRequest(), timeout_s))

    def get_stats(self, timeout_s: float | None = None) -> convert.ClusterStats:
        return convert.cluster_stats_from_pb(self._unary(self._stub.GetStats, pb.GetStatsRequest(), timeout_s))

    def _unary(self, method, request, timeout_s: float | None):
        call = _Call(self, timeout_s, None)
        while True:
            try:
                response = method(request, metadata=call.metadata(), timeout=call.time_left_s())
                self.budget.record_success()
                return response
            except grpc.RpcError as error:
                self._sleep(call.on_failure(error))
                self._wait_for_connection(call.reconnect_wait_s())

    def _wait_for_connection(self, timeout_s: float) -> None:
        """Until the channel connects or `timeout_s` passes (the attempt then runs anyway)."""
        if timeout_s > 0:
            try:
                grpc.channel_ready_future(self._channel).result(timeout=timeout_s)
            except grpc.FutureTimeoutError:
                pass

    def close(self) -> None:
        self.closed = True
        self._channel.close()

    def __enter__(self) -> "KvmeshClient":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


class AsyncKvmeshClient(_ClientBase):
    """asyncio client (grpc.aio). Create and use it on one event loop."""

    def __init__(self, target: str, *, api_key: str | None = None, retry_policy: RetryPolicy | None = None,
                 rng: random.Random | None = None, restart_mid_stream: bool = False,
                 channel: grpc.aio.Channel | None = None, credentials: grpc.ChannelCredentials | None = None,
                 resume_mid_stream: bool = True, own_connection: bool = False):
        super().__init__(api_key, retry_policy, rng, restart_mid_stream, resume_mid_stream)
        self._channel = channel or open_channel(target, credentials, own_connection=own_connection, aio=True)
        self._stub = pb_grpc.KvmeshStub(self._channel)

    async def generate(self, prompt: str | None = None, *, messages: Sequence[dict] | None = None,
                       prompt_token_ids: Sequence[int] | None = None, sampling: SamplingParams | None = None,
                       model: str = "", request_id: str | None = None, priority: int = 0,
                       timeout_s: float | None = None, trace_context: dict[str, str] | None = None,
                       ) -> AsyncIterator[RequestDelta | StreamRestart]:
        request = self.build_request(prompt, messages, prompt_token_ids, sampling, model, request_id, priority)
        resumption = _Resumption(request, self.resume_mid_stream)
        call = _Call(self, timeout_s, trace_context)
        while True:
            received = 0
            stream = self._stub.Generate(resumption.request, metadata=call.metadata(), timeout=call.time_left_s())
            try:
                async for message in stream:
                    delta = convert.delta_from_pb(message)
                    received += _delivered(delta)
                    resumption.observe(delta)
                    yield delta
                self.budget.record_success()
                return
            except grpc.RpcError as error:
                if resumption.complete:
                    logger.debug("stream complete; its call then ended %s", error.code().name)
                    self.budget.record_success()
                    return
                delay_s = call.on_failure(error, resumption.delivered, self.restart_mid_stream, resumption.enabled)
            finally:
                stream.cancel()
            await asyncio.sleep(delay_s)
            await self._wait_for_connection(call.reconnect_wait_s())
            resumption.after_failure(received)
            if received and not resumption.enabled:
                yield StreamRestart(call.attempt, "stream failed mid-way; restarted from scratch")

    async def cancel(self, request_id: str, timeout_s: float | None = None) -> bool:
        return (await self._unary(self._stub.Cancel, pb.CancelRequest(request_id=request_id), timeout_s)).found

    async def list_models(self, timeout_s: float | None = None) -> list[convert.ModelInfo]:
        return convert.models_from_pb(await self._unary(self._stub.ListModels, pb.ListModelsRequest(), timeout_s))

    async def health(self, timeout_s: float | None = None) -> convert.HealthStatus:
        return convert.health_from_pb(await self._unary(self._stub.Health, pb.HealthRequest(), timeout_s))

    async def get_stats(self, timeout_s: float | None = None) -> convert.ClusterStats:
        response = await self._unary(self._stub.GetStats, pb.GetStatsRequest(), timeout_s)
        return convert.cluster_stats_from_pb(response)

    async def _unary(self, method, request, timeout_s: float | None):
        call = _Call(self, timeout_s, None)
        while True:
            try:
                response = await method(request, metadata=call.metadata(), timeout=call.time_left_s())
                self.budget.record_success()
                return response
            except grpc.RpcError as error:
                await asyncio.sleep(call.on_failure(error))
                await self._wait_for_connection(call.reconnect_wait_s())

    async def _wait_for_connection(self, timeout_s: float) -> None:
        """Until the channel connects or `timeout_s` passes (the attempt then runs anyway)."""
        if timeout_s > 0:
            try:
                await asyncio.wait_for(self._channel.channel_ready(), timeout_s)
            except asyncio.TimeoutError:
                pass

    async def close(self) -> None:
        self.closed = True
        await self._channel.close()

    async def __aenter__(self) -> "AsyncKvmeshClient":
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()


def collect_text(deltas: Sequence[RequestDelta | StreamRestart]) -> str:
    """The final text of a finished stream's deltas, honouring restarts (sample 0)."""
    text: list[str] = []
    for item in deltas:
        if isinstance(item, StreamRestart):
            text.clear()
        elif item.sample_index == 0:
            text.append(item.text)
    return "".join(text)


__all__ = ["AsyncKvmeshClient", "KvmeshClient", "KvmeshError", "StreamRestart", "collect_text"]
