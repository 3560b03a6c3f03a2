"""router/stages/stream.py's re-admission rules, each dispatch's outcome scripted: a worker
whose own admission refuses a request (its KV budget, which the router's view of it was
behind) cannot be made to do so on cue on a real cluster (a CI run met it once, resuming a
drained worker's streams), so the stream's worker side is a script here and the router core a
stand-in that records what the stream asks of it."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from types import SimpleNamespace
from unittest import mock

from kvmesh.core.errors import OverloadedError, WorkerFailedError
from kvmesh.core.seams import FinishReason, GenerateRequest, RequestDelta, SamplingParams
from kvmesh.router.admission_budget import AdmissionTicket
from kvmesh.router.convert import InboundRequest
from kvmesh.router.routing import RoutingDecision, RoutingPath
from kvmesh.router.stages.context import RequestContext
from kvmesh.router.stages.stream import RequestStream


@dataclass
class Dispatch:
    """What the worker a dispatch went to does: stream these tokens, then fail with `error`
    (None: finish)."""

    tokens: tuple[int, ...]
    error: Exception | None = None


class ScriptedStream(RequestStream):
    def __init__(self, core, ctx, script: list[Dispatch]):
        super().__init__(core, ctx)
        self.script = list(script)
        self.sent: list[tuple[str, tuple[int, ...]]] = []  # (worker, resume_token_ids) per dispatch

    async def _worker_deltas(self):
        self.sent.append((self.worker_id, self._request.resume_token_ids))
        dispatch = self.script.pop(0)
        for token in dispatch.tokens:
            yield RequestDelta(self._request.request_id, text="x", token_ids=(token,))
        if dispatch.error is not None:
            raise dispatch.error
        yield RequestDelta(self._request.request_id, finished=True, finish_reason=FinishReason.LENGTH)


def _decision(worker_id: str) -> RoutingDecision:
    return RoutingDecision(worker_id, 0, list(RoutingPath)[0], 0)


def _ticket(worker_id: str) -> AdmissionTicket:
    return AdmissionTicket(lambda ticket: None, worker_id, 64, 1, sent_at=0.0, queue_wait_s=0.0)


def _run(script: list[Dispatch], readmit_to: list[str]) -> tuple[ScriptedStream, list, list]:
    """Streams a request first sent to w0; each re-admission goes to the next of `readmit_to`."""
    request = GenerateRequest("t/r1", prompt_token_ids=(1, 2, 3),
                              sampling=SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    readmissions = []

    async def admit(req, exclude, fallback=False, refused_by=None):
        readmissions.append((exclude, refused_by, req.resume_token_ids))
        worker_id = readmit_to[len(readmissions) - 1]
        return _decision(worker_id), _ticket(worker_id), req

    core = mock.MagicMock()
    core.config.router.max_stream_resumptions = 1
    core.others_routable.return_value = True
    core.admitter = SimpleNamespace(admit=admit)
    core.settle = mock.AsyncMock()
    core.output_estimate = None
    core.pool.any_info.return_value = None
    ctx = RequestContext(InboundRequest(request_id="r1"), arrived_s=0.0, root_span=None, parent=None,
                         request=request, decision=_decision("w0"), ticket=_ticket("w0"))
    stream = ScriptedStream(core, ctx, script)

    async def consume():
        out = []
        async for delta in stream:
            out.extend(delta.token_ids)
        return out

    return stream, asyncio.run(consume()), readmissions


def test_a_resumption_its_new_worker_refuses_is_admitted_again_with_what_was_streamed():
    # w0 fails after 3 tokens; the stream resumes on w1, whose own admission refuses it before
    # its first token; re-admitted (w1 not excluded: only until its next report), it ends on w2.
    stream, tokens, readmissions = _run(
        [Dispatch((10, 11, 12), WorkerFailedError("w0 died")),
         Dispatch((), OverloadedError("KV budget: 3936 of 4096 tokens committed", 0.1)),
         Dispatch((13, 14, 15, 16, 17))],
        readmit_to=["w1", "w2"])
    assert tokens == [10, 11, 12, 13, 14, 15, 16, 17]  # one stream, nothing lost or repeated
    assert stream.sent == [("w0", ()), ("w1", (10, 11, 12)), ("w2", (10, 11, 12))]
    assert readmissions[1] == (frozenset(), "w1", (10, 11, 12))  # as a refusal: left out until its report


def test_a_refusal_after_the_dispatch_streamed_is_not_taken_for_a_refusal():
    # An OverloadedError after tokens of this very dispatch: not resumable (only a failed
    # worker is), so the stream ends with it, as before.
    try:
        _run([Dispatch((10, 11), OverloadedError("preempted beyond its budget", 0.1))], readmit_to=["w1"])
    except OverloadedError:
        return
    raise AssertionError("the stream did not end with the worker's error")
