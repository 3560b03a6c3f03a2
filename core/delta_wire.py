"""What one worker-channel message holds, and its bytes (worker/runtime/delta_channel.py ->
router/worker_channels.py).

A message is one engine step's output for every request of one router replica on a worker.
Almost every item of it is a plain token increment, so those travel as a `TokenDelta`
(request id, sample, text, token ids: four fields, a tuple) and only the rest (a final
delta with usage and timings, an error, a delta with logprobs) as the full RequestDelta:

    worker: [RequestDelta, RequestDelta, ...] per request  ──pack──>  [TokenDelta("t/a", 0, "ab", (5, 6)),
                                                                        RequestDelta("t/b", finished=True, ...)]
            ──encode──> bytes ══ Ray ══> decode ──> fan-out per request id ──to_request_deltas──> one
                                                                        RequestDelta per sample run

Why not the list of RequestDelta itself: Ray pickles with cloudpickle, whose per-object hook
runs in Python for every dataclass (14 fields each), and Ray's streaming reader fetches a
ready item twice; one bytes object per message, pickled here with the C pickler, makes both
a copy. The token run of a request that lagged is joined here once, not one dataclass copy
per token (as vLLM's output collector merges a lagging request's outputs into one).
"""

from __future__ import annotations

import pickle
from typing import NamedTuple

from kvmesh.core.seams import RequestDelta, merge_deltas


class TokenDelta(NamedTuple):
    """A plain increment of one sample: no finish, error, logprobs, usage or timings."""

    request_id: str
    sample_index: int
    text: str
    token_ids: tuple[int, ...]


def is_plain(delta: RequestDelta) -> bool:
    """True when `delta` says nothing a TokenDelta cannot."""
    return (not delta.finished and delta.finish_reason is None and delta.error_type is None and delta.error is None
            and delta.logprobs is None and delta.usage is None and delta.timings is None and delta.degraded is None)


def pack(deltas: list[RequestDelta]) -> list:
    """One request's deltas since its previous message, in order: each run of plain deltas of
    one sample as one TokenDelta; a final (or any other) delta as RequestDelta, carrying the
    tokens of the run just before it when merge_deltas would join them."""
    if len(deltas) == 1:  # the reader keeps up: the usual case
        delta = deltas[0]
        return [TokenDelta(delta.request_id, delta.sample_index, delta.text, delta.token_ids) if is_plain(delta)
                else delta]
    out: list = []
    run: list[RequestDelta] = []  # plain deltas of one sample, not yet packed
    others: list[RequestDelta] = []  # consecutive other deltas, not yet merged
    for delta in deltas:
        if is_plain(delta):
            if others:
                out += _merged(others)
                others = []
            if run and run[-1].sample_index != delta.sample_index:
                out.append(_token_delta(run))
                run = []
            run.append(delta)
            continue
        if run:
            if run[-1].sample_index == delta.sample_index:
                others.append(_joined(run))
            else:
                out.append(_token_delta(run))
            run = []
        others.append(delta)
    out += _merged(others)
    if run:
        out.append(_token_delta(run))
    return out


def _merged(deltas: list[RequestDelta]) -> list:
    """merge_deltas, with what stays plain (tokens an error delta did not take) as TokenDelta."""
    return [_token_delta([d]) if is_plain(d) else d for d in merge_deltas(deltas)]


def _joined(run: list, request_id: str | None = None) -> RequestDelta:
    """A run of one sample's increments (TokenDelta or plain RequestDelta) as one RequestDelta,
    named `request_id` when given (else the run's own)."""
    return _joined_as(_plain_request_delta, run, request_id)


def _token_delta(run: list) -> TokenDelta:
    """The same run as one TokenDelta."""
    return _joined_as(TokenDelta, run)


def _joined_as(make, run: list, request_id: str | None = None):
    first = run[0]
    request_id = request_id or first.request_id
    if len(run) == 1:
        return make(request_id, first.sample_index, first.text, first.token_ids)
    return make(request_id, first.sample_index, "".join(i.text for i in run),
                tuple(t for i in run for t in i.token_ids))


def _plain_request_delta(request_id: str, sample_index: int, text: str, token_ids: tuple[int, ...]) -> RequestDelta:
    return RequestDelta(request_id, text=text, token_ids=token_ids, sample_index=sample_index)


def encode(items: list) -> bytes:
    return pickle.dumps(items, protocol=pickle.HIGHEST_PROTOCOL)


def decode(message: bytes) -> list:
    """The items of a message from a worker of this cluster (the same trust as Ray's own pickles)."""
    return pickle.loads(message)


def request_id_of(item) -> str:
    return item[0] if type(item) is TokenDelta else item.request_id


def to_request_deltas(items: list, request_id: str | None = None) -> list:
    """A request's items as RequestDelta: each run of one sample's TokenDeltas joined into
    one (named `request_id` when given: the id the client knows, so the router's stream
    passes it on as it is); RequestDelta and anything else (a ChannelFailure) as they are, in
    order."""
    out: list = []
    run: list[TokenDelta] = []
    for item in items:
        if type(item) is TokenDelta:
            if run and run[-1].sample_index != item.sample_index:
                out.append(_joined(run, request_id))
                run = []
            run.append(item)
            continue
        if run:
            out.append(_joined(run, request_id))
            run = []
        out.append(item)
    if run:
        out.append(_joined(run, request_id))
    return out
