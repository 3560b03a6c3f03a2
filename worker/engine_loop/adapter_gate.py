"""Holds back requests whose LoRA adapter is not resident yet; pins the slot of those admitted.

    add_request(adapter a) --a resident--> pin a's slot, into the scheduler now
                           --not yet-----> start the read (loader thread), wait here
    each step (poll)       reads that finished are installed in a slot; the requests waiting
                           on them are pinned and go to the scheduler; a failed read ends them
    request ends (any way) its pin drops; an unpinned adapter becomes evictable (LRU)

A request holds its adapter's slot from admission to its end, as vLLM's scheduler keeps the
adapters of its running batch loaded: the batch mixes at most lora.max_loras adapters, and
a request of a further adapter waits until a slot's last user ends. Base-model requests
never wait here.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

from kvmesh.core.seams import AdapterRef
from kvmesh.worker.engine_loop.request import Request
from kvmesh.worker.runner.lora_slots import AdapterSlots


@dataclass(frozen=True)
class AdapterUsage:
    """Per adapter name, since the worker started: requests admitted and tokens computed."""

    num_requests: int
    num_prompt_tokens: int
    num_output_tokens: int


class AdapterGate:
    def __init__(self, slots: AdapterSlots):
        self.slots = slots
        self._waiting: dict[AdapterRef, list[Request]] = {}
        self._requests: collections.Counter[str] = collections.Counter()
        self._prompt_tokens: collections.Counter[str] = collections.Counter()
        self._output_tokens: collections.Counter[str] = collections.Counter()

    @property
    def num_waiting(self) -> int:
        return sum(len(group) for group in self._waiting.values())

    def waiting_requests(self) -> list[Request]:
        return [r for group in self._waiting.values() for r in group]

    def admit(self, members: list[Request]) -> bool:
        """True: the members' adapter is resident and now pinned for each (add them to the
        scheduler); False: they wait here for the adapter's read."""
        ref = members[0].adapter
        if self.slots.slot_of(ref) is not None:
            for member in members:
                self._pin(member)
            return True
        self._waiting.setdefault(ref, []).extend(members)
        self.slots.start_load(ref)
        return False

    def poll(self) -> tuple[list[Request], list[tuple[Request, BaseException]]]:
        """(requests whose adapter is now resident, pinned; (request, read error) for failed reads)."""
        _, failed = self.slots.poll()
        ready: list[Request] = []
        for ref in list(self._waiting):
            if self.slots.slot_of(ref) is not None:
                for member in self._waiting.pop(ref):
                    self._pin(member)
                    ready.append(member)
            elif not self.slots.is_loading(ref) and ref not in failed:
                self.slots.start_load(ref)  # evicted between its read and this poll: read again
        lost = [(r, exc) for ref, exc in failed.items() for r in self._waiting.pop(ref, [])]
        return ready, lost

    def remove_waiting(self, request_ids: set[str]) -> list[Request]:
        """Take these requests out of the wait (an abort); returns the ones that were waiting."""
        removed: list[Request] = []
        for ref, group in list(self._waiting.items()):
            removed += [r for r in group if r.request_id in request_ids]
            group[:] = [r for r in group if r.request_id not in request_ids]
            if not group:
                del self._waiting[ref]
        return removed

    def release(self, request: Request) -> None:
        """The request ended: drop its pin and count its tokens."""
        if request.lora_slot is None:
            return
        self.slots.unpin(request.adapter)
        request.lora_slot = None
        name = request.adapter.name
        self._prompt_tokens[name] += request.num_prompt_tokens
        self._output_tokens[name] += request.num_output_tokens

    def _pin(self, request: Request) -> None:
        request.lora_slot = self.slots.pin(request.adapter)
        self._requests[request.adapter.name] += 1

    def usage(self) -> dict[str, AdapterUsage]:
        return {name: AdapterUsage(n, self._prompt_tokens[name], self._output_tokens[name])
                for name, n in self._requests.items()}
