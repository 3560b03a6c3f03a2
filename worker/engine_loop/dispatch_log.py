"""Which router dispatches an engine's figures hold, per router replica (`DispatchReport`).

A router replica counts each request it sent a worker on top of that worker's last report
until a report holds it (router/admission_budget.py). By time alone it cannot tell: the
request and the poll are separate messages, so it kept every request one extra poll period,
and a report that already held one counted it twice (the family's worker looked full and the
next request of the family spilled to the other worker). So the worker says which it holds:

    router replica r sends request x as dispatch (r, 7)     GenerateRequest.dispatch
    engine takes x in (queued, or refused)    ->  seen[r] = 7; live[r] = {.., 7} if queued
    x ends (finished, aborted, failed)        ->  7 leaves live[r]
    poll: WorkerStats + report(), read under the same engine lock as the figures

Lives in the engine's step thread (under the lock that also guards the figures), so a report
and the figures read with it always agree. One entry per router replica that sent something,
bounded (replicas come and go with redeploys): the least recently heard from is dropped first.
"""

from __future__ import annotations

import collections

from kvmesh.core.seams import DispatchReport, GenerateRequest

MAX_REPLICAS = 64  # router replicas remembered; a replica gone that long has no tickets left


class DispatchLog:
    def __init__(self, max_replicas: int = MAX_REPLICAS) -> None:
        self._max_replicas = max_replicas
        self._seen: collections.OrderedDict[str, int] = collections.OrderedDict()  # replica -> highest seq
        self._live: dict[str, set[int]] = {}  # replica -> seqs running or waiting here
        self._of_request: dict[str, tuple[str, int]] = {}  # request id -> its dispatch, while live

    def note_taken(self, request: GenerateRequest, queued: bool) -> None:
        """The engine took `request` in: queued it (`queued`), or refused it."""
        if request.dispatch is None:
            return
        replica, seq = request.dispatch
        self._seen[replica] = max(seq, self._seen.get(replica, 0))
        self._seen.move_to_end(replica)
        if queued:
            self._live.setdefault(replica, set()).add(seq)
            self._of_request[request.request_id] = request.dispatch
        while len(self._seen) > self._max_replicas:
            gone, _ = self._seen.popitem(last=False)
            if self._live.pop(gone, None):
                self._of_request = {r: d for r, d in self._of_request.items() if d[0] != gone}

    def note_ended(self, request_id: str) -> None:
        """The request (all its samples) ended: nothing of it is in the figures any more."""
        dispatch = self._of_request.pop(request_id, None)
        if dispatch is not None:
            self._live.get(dispatch[0], set()).discard(dispatch[1])

    def report(self) -> dict[str, DispatchReport]:
        return {replica: DispatchReport(seen, frozenset(self._live.get(replica, ())))
                for replica, seen in self._seen.items()}
