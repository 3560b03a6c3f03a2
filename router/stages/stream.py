"""Stage 6: the stream. One admitted request's deltas from its worker's channel
(router/worker_channels.py), with the deadline enforced and the client's message pace kept;
settlement (quota, admission ticket, backlog, metrics, spans) on every exit path, exactly once.

A worker that dies mid-stream (RayActorError) is marked failed in the pool at once. When it
dies before the request's first delta, nothing was streamed, so the router re-routes once by
itself. When output had already reached the client, the router resumes the stream on a
survivor (router.max_stream_resumptions times at most): the request goes out again with the
tokens and the number of text characters streamed so far (GenerateRequest.resume_*), the
survivor recomputes or finds in its caches (pool, host tier) the prompt + those tokens and
streams only what follows, so the client sees one stream, with no token missing or twice
(greedy: the same text as without the failure). When it cannot (resumption off or spent,
n > 1, no survivor), the stream ends with WorkerFailedError (UNAVAILABLE: the client retries).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import sys
from collections.abc import AsyncIterator

from kvmesh.core import telemetry
from kvmesh.core.delta_wire import to_request_deltas
from kvmesh.core.errors import DeadlineExceededError, OverloadedError, RouterReplicaStoppingError, WorkerFailedError
from kvmesh.core.seams import ErrorReport, FinishReason, RequestDelta, Usage, merge_deltas, request_usage
from kvmesh.router import degradation, tracing
from kvmesh.router.metrics import FINISH_TIMEOUT
from kvmesh.router.stages.context import RequestContext
from kvmesh.router.worker_channels import ChannelFailure, ReplicaStopping

logger = logging.getLogger(__name__)

# Re-admissions of one request after workers' own admission refused it (each refusal makes
# the router's view of that worker fresh before it is tried again, see note_refusal).
WORKER_REFUSAL_REROUTES = 2


class RequestStream:
    """One admitted request. Iterate it once for its deltas (request ids as the client sent
    them); leaving the iteration early (client gone, error) aborts the worker's request.

    `core` is the replica's RouterCore (router/router_core.py): the stream reads its shared
    state (in-flight count, pool, channels, admission, metrics) and re-admits through its
    `admitter`."""

    def __init__(self, core, ctx: RequestContext):
        self._core = core
        request = ctx.request
        # The ladder step this request was admitted by ("cap", "fallback"), None = as sent.
        self.degraded = ctx.degraded
        self._on_fallback = ctx.degraded == degradation.STEP_FALLBACK
        self._arrived_s = ctx.arrived_s  # time.time() at the router: the start of TTFT
        self._spans = ctx.spans  # (kvmesh.stream, kvmesh.request): ended, in that order, at the end
        self._request = request
        self.adapter = request.adapter  # the LoRA adapter it runs with (None = base model)
        self.request_id = ctx.inbound.request_id or request.request_id.split("/", 1)[1]  # as the client knows it
        self.decision = ctx.decision
        self._ticket = ctx.ticket
        self._reservation = ctx.reservation
        self.prompt_tokens = len(request.prompt_token_ids)

    @property
    def worker_id(self) -> str:
        return self.decision.worker_id

    async def __aiter__(self) -> AsyncIterator[RequestDelta]:
        core = self._core
        core.count_stream(1)
        streamed_tokens = 0  # by this router, in this request
        # n = 1: the output so far (a client's resumption included), what a resumption starts from
        streamed_ids: list[int] = list(self._request.resume_token_ids)
        streamed_chars = self._request.resume_text_chars
        client_resumed_tokens = len(streamed_ids)  # received before this request: not charged again
        reroutes_left, resumptions_left = 1, core.config.router.max_stream_resumptions
        refusals_left = WORKER_REFUSAL_REROUTES
        final: RequestDelta | None = None
        sample_usages: dict[int, Usage] = {}  # n > 1: each sample's final reports its own
        try:
            while True:
                dispatch_tokens = 0  # from the worker this request was sent to last
                try:
                    async for delta in self._worker_deltas():
                        streamed_tokens += len(delta.token_ids)
                        dispatch_tokens += len(delta.token_ids)
                        streamed_ids.extend(delta.token_ids)
                        streamed_chars += len(delta.text)
                        if delta.finished:
                            final = delta
                            if delta.usage is not None:
                                sample_usages[delta.sample_index] = delta.usage
                        if delta.finished or delta.request_id != self.request_id:
                            # A plain increment comes named for the client already (_worker_deltas).
                            delta = dataclasses.replace(delta, request_id=self.request_id,
                                                        degraded=self.degraded if delta.finished else None)
                        yield delta
                    return
                except (WorkerFailedError, OverloadedError) as exc:
                    others = core.others_routable(self.worker_id, self._on_fallback)
                    # A worker's own admission refused this dispatch before its first token (a
                    # resumption included): re-admitted below, its resume state kept.
                    refused = isinstance(exc, OverloadedError) and not dispatch_tokens
                    if streamed_tokens and not refused:
                        resumable = (isinstance(exc, WorkerFailedError) and resumptions_left > 0
                                     and self._request.sampling.n == 1 and others
                                     and len(streamed_ids) < self._request.sampling.max_tokens)
                        core.metrics.observe_stream_resumption(resumable)
                        if not resumable:
                            raise
                        resumptions_left -= 1
                        logger.warning("worker %s failed after %d tokens of request %s; resuming elsewhere",
                                       self.worker_id, len(streamed_ids), self.request_id)
                        self._request = dataclasses.replace(self._request, resume_token_ids=tuple(streamed_ids),
                                                            resume_text_chars=streamed_chars)
                        if self._spans:
                            self._spans[0].add_event(telemetry.EVENT_STREAM_RESUMED, {
                                telemetry.ATTR_RESUMED_FROM_WORKER: self.worker_id,
                                telemetry.ATTR_RESUMED_TOKENS: len(streamed_ids)})
                    else:
                        # With no other routable worker of its pool a re-route would only queue
                        # for the worker that just refused or failed: the error goes back now.
                        if (refusals_left if refused else reroutes_left) == 0 or not others:
                            raise
                        # Nothing reached the client: re-route rather than fail it. A failed
                        # worker is left out. A worker whose own admission refused (the router's
                        # view of it was behind: its budget filled, or a prefix the router counted
                        # as cached there was evicted) is left out only until its next report:
                        # the request goes to another worker with room, or waits at the router
                        # for one (that worker included, once its report shows room), instead of
                        # bouncing to the client when the other worker is full too. When that
                        # worker holds its prefix it waits for the report first (affinity_wait.py).
                        if refused:
                            logger.warning("worker %s refused request %s (cost %d here): %s", self.worker_id,
                                           self.request_id, self._ticket.cost_tokens,
                                           core.admission.budgets.describe(self.worker_id))
                            refusals_left -= 1
                            core.admission.note_refusal(self.worker_id)
                            core.metrics.observe_spill("worker_refused")
                        else:
                            reroutes_left -= 1
                        logger.warning("worker %s %s before request %s produced output (%s); re-routing",
                                       self.worker_id, "refused" if refused else "failed", self.request_id, exc)
                    self._ticket.release()
                    self.decision, self._ticket, self._request = await core.admitter.admit(
                        self._request, frozenset() if refused else frozenset({self.worker_id}),
                        fallback=self._on_fallback, refused_by=self.worker_id if refused else None)
        finally:
            # Everything synchronous first: a client that goes away cancels this task, and a
            # second cancel arriving during the await below must not skip the metrics or spans.
            failure = sys.exc_info()[1]
            core.count_stream(-1)
            core.live_request_ids.discard(self._request.request_id)
            core.backlog.leave(self._request.tenant_id)
            self._ticket.release()
            usage = request_usage(list(sample_usages.values()))
            # A sample that failed after streaming has no final usage: what reached the client counts.
            used = max((usage.completion_tokens if usage is not None else 0) - client_resumed_tokens, streamed_tokens)
            reason = final.finish_reason if final else FinishReason.ERROR
            timed_out = isinstance(failure, DeadlineExceededError)
            if timed_out:
                core.metrics.observe_timeout(self._request.tenant_id, "stream")
            core.metrics.observe_request_end(self._request.tenant_id, final.timings if final else None, usage,
                                             FINISH_TIMEOUT if timed_out else reason, self._arrived_s)
            if self.adapter is not None:
                core.metrics.observe_adapter_request(self.adapter.name, usage)
            self._record_route_truth(usage)
            self._record_ttft_truth(final.timings if final is not None else None)
            self._learn_output_length(reason, usage)
            for span in self._spans:
                span.set_attribute(tracing.ATTR_FINISH_REASON, FINISH_TIMEOUT if timed_out else reason.value)
                if reason is FinishReason.ERROR:
                    span.set_status(tracing.Status(tracing.StatusCode.ERROR))
                span.end()
            # Failed before any token: refund everything; otherwise pay for what was made.
            # Shielded: if this task is cancelled meanwhile the settlement still completes
            # (else the tenant's slot would stay taken until its lease expires).
            await asyncio.shield(core.settle(self._reservation, used if (used or final is not None) else None))

    def _learn_output_length(self, reason: FinishReason, usage) -> None:
        """A request that ended by itself teaches the expected-output estimate, as on the worker."""
        estimate = self._core.output_estimate
        if (estimate is not None and usage is not None and self._request.sampling.n == 1
                and reason in (FinishReason.STOP, FinishReason.LENGTH) and not self.degraded):
            estimate.observe(self._request.tenant_id, usage.completion_tokens)

    def _record_route_truth(self, usage) -> None:
        """Predicted vs actually hit prefix blocks: a metric, and attributes of kvmesh.stream."""
        info = self._core.pool.any_info()
        if usage is None or info is None:
            return
        predicted, hit = self.decision.matched_blocks, usage.cached_tokens // info.block_size
        self._core.metrics.observe_route_truth(predicted, hit)
        if self._spans:
            self._spans[0].set_attributes({tracing.ATTR_ROUTE_PREDICTED_BLOCKS: predicted,
                                           tracing.ATTR_PREFIX_HIT_BLOCKS: hit})

    def _record_ttft_truth(self, timings) -> None:
        """Predicted vs actual TTFT at the worker (predicted_latency): a metric, and the
        policy's calibration."""
        predicted = self.decision.predicted_ttft_s
        actual = timings.ttft_s if timings is not None else None
        if predicted is None or actual is None:
            return
        self._core.latency.calibration.observe(predicted, actual)
        self._core.metrics.observe_ttft_prediction(predicted, actual)

    async def _worker_deltas(self) -> AsyncIterator[RequestDelta]:
        """The request's deltas from its worker's channel (router/worker_channels.py), with
        the deadline enforced; always leaves the worker with nothing running for this request."""
        core, worker_id, request = self._core, self.worker_id, self._request
        channels = core.channels
        subscription = channels.subscribe(worker_id, request.request_id)
        subscription.expire_at(request.deadline_s)
        if request.kv_source is None and request.attempt == 1 and not request.resume_token_ids:
            # Numbered as it is sent: the worker's poll says whether its figures hold it, and
            # admission stops counting the ticket exactly then (router/admission_budget.py).
            # Not a prefix pull, a retry or a resumption: those can reach the engine after
            # requests sent later (the pull first; ending the run they take over first).
            self._ticket.dispatch_seq = channels.next_dispatch_seq(worker_id)
            request = dataclasses.replace(request, dispatch=(channels.replica_id, self._ticket.dispatch_seq))
        channels.submit(worker_id, request)
        finished = False
        hold_until = None  # the first message is never held back
        try:
            while True:
                items = await subscription.take(hold_until)
                for delta in _merged(to_request_deltas(items, self.request_id)):
                    if isinstance(delta, ReplicaStopping):  # this replica is stopping: the client resumes elsewhere
                        raise RouterReplicaStoppingError("the router replica is stopping; resume on another replica")
                    if isinstance(delta, ChannelFailure):
                        finished = delta.actor_failed  # a dead actor runs nothing: no abort to send
                        if delta.actor_failed:
                            core.pool.mark_failed(worker_id, delta.reason, delta.incarnation)
                        else:
                            logger.error("worker %s failed request %s: %s", worker_id, request.request_id, delta.reason)
                        raise WorkerFailedError(f"worker {worker_id} failed while serving the request; retry")
                    if delta.finish_reason is FinishReason.ERROR and delta.error_type:
                        finished = True  # the worker ended it (refused or failed); surface the typed error
                        raise ErrorReport.from_delta(delta).to_exception()
                    finished = finished or (delta.finished and delta.sample_index >= request.sampling.n - 1)
                    yield delta
                if finished:
                    return
                hold_until = core.pacer.next_tick(core.stream_pace_s())
        finally:
            channels.unsubscribe(worker_id, request.request_id)
            if not finished:  # client gone, deadline, error: the engine must stop and free its blocks
                channels.abort(worker_id, request.request_id)


def _merged(items: list) -> list:
    """Consecutive deltas of a sample as one (what a paced wait let pile up); a ChannelFailure
    stays where it is."""
    out: list = []
    run: list[RequestDelta] = []
    for item in items:
        if isinstance(item, RequestDelta):
            run.append(item)
            continue
        out += merge_deltas(run) + [item]
        run = []
    return out + merge_deltas(run) if run else out
