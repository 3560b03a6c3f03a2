"""One step being planned: the token budgets it draws on, the requests and block copies it
collects, and what an admission attempt answered (worker/engine_loop/scheduler.py builds it)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from kvmesh.worker.engine_loop.request import Request
from kvmesh.worker.engine_loop.scheduler_output import ScheduledRequest


@dataclass
class StepBudget:
    tokens_left: int  # max_num_batched_tokens
    prefill_tokens_left: int  # max_prefill_tokens_per_step

    def grant(self, num_tokens_to_compute: int) -> int:
        """Tokens a request with this many tokens left to compute may run this step.
        More than one left = a prefill chunk, which also draws on the prefill budget."""
        granted = min(num_tokens_to_compute, self.tokens_left)
        if num_tokens_to_compute > 1:
            granted = min(granted, self.prefill_tokens_left)
        return granted

    def consume(self, num_tokens_to_compute: int, num_tokens: int) -> None:
        self.tokens_left -= num_tokens
        if num_tokens_to_compute > 1:
            self.prefill_tokens_left -= num_tokens

    def give_back(self, num_tokens_to_compute: int, num_tokens: int) -> None:
        self.consume(num_tokens_to_compute, -num_tokens)


@dataclass
class StepPlan:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    scheduled_ids: set[str] = field(default_factory=set)
    preempted_ids: list[str] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    copy_blocks: list[tuple[int, int]] = field(default_factory=list)

    def remove(self, request: Request) -> ScheduledRequest:
        """Take a request back out of this step (priority preemption of an already
        scheduled one); the caller returns its budget and blocks."""
        entry = next(s for s in self.scheduled if s.request is request)
        self.scheduled.remove(entry)
        self.scheduled_ids.discard(request.request_id)
        return entry

    def add(self, request: Request, num_tokens: int, drafts: tuple[int, ...] = ()) -> None:
        """Schedule `num_tokens` known tokens from num_computed_tokens on, then `drafts`."""
        start = request.num_computed_tokens
        self.scheduled.append(ScheduledRequest(
            request=request, num_scheduled_tokens=num_tokens + len(drafts), num_computed_tokens=start,
            token_ids=tuple(request.all_token_ids[start:start + num_tokens]) + drafts,
            block_ids=tuple(request.block_ids), sample=start + num_tokens == request.num_tokens,
            spec_token_ids=drafts))
        self.scheduled_ids.add(request.request_id)


class AdmitOutcome(enum.Enum):
    """What trying to start one waiting request this step answered."""

    ADMITTED = 1
    SKIPPED = 2  # not this one yet (an n > 1 sibling waiting for its prompt); try the next
    BLOCKED = 3  # out of budget or blocks: stop admitting this step
