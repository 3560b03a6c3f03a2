"""The scheduler: queues, per-step token budgets, admission order, preemption.

One step (`schedule()`), composed of small pieces:

    reject_expired     waiting requests never scheduled within max_queue_time_s -> REJECTED
    return taken       running requests whose KV reservation a more important request took
                       (add_request, priority preemption of reservations) are preempted
    schedule_running   running requests, decodes before prefill chunks, each in (priority,
                       arrival) order: a decode token or the next prefill chunk each; a
                       request that cannot get a block preempts the newest lowest-priority
                       running request not yet scheduled this step (possibly itself)
    schedule_waiting   only when nothing was preempted this step: the batching policy names
                       the candidates, admitted in order while max_num_seqs, the step's token
                       budget, the prefill budget and free blocks allow; the first that does
                       not fit stops admission (no overtaking: priority order holds).
                       With scheduler.priority_preemption, a candidate that does not fit
                       (no slot, budget or blocks) may first preempt running requests of a
                       strictly less important class (see _preempt_for_priority). A
                       request that owes its reservation reserves it again first, or
                       is passed over until the budget has room for it; one that is not
                       `is_ready` (its structured-output grammar still compiling) is
                       passed over, and others behind it may start

then the engine runs the SchedulerOutput and calls `update_from_output`, which advances
num_computed_tokens, appends the sampled tokens and offers newly full blocks to the prefix
cache. The engine checks stop conditions and calls `finish_requests`. Running out of blocks
only ever means waiting or preempting; no exception.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable

from kvmesh.core.config import SchedulerConfig
from kvmesh.kv.kv_cache_manager import KVCacheManager
from kvmesh.worker.engine_loop.admission import EngineAdmission, BatchingPolicy, RateMeter, make_batching_policy
from kvmesh.core.errors import InvalidRequestError
from kvmesh.worker.engine_loop.request import Request, RequestStatus
from kvmesh.worker.engine_loop.request_order import (known_tokens_to_compute, priority_victim_order, running_order,
                                                     tokens_left_to_compute, waiting_order)
from kvmesh.worker.engine_loop.scheduler_output import FinishedRequest, SchedulerOutput
from kvmesh.worker.engine_loop.scheduler_stats import SchedulerStats, StepWindow
from kvmesh.worker.engine_loop.shared_prompt_blocks import SharedPromptBlocks
from kvmesh.worker.engine_loop.step_plan import AdmitOutcome, StepBudget, StepPlan

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_manager: KVCacheManager, *,
                 clock: Callable[[], float] = time.monotonic, stats_window_s: float = 30.0):
        config.validate()
        self.config = config
        self.kv = kv_manager
        self.clock = clock
        self.policy: BatchingPolicy = make_batching_policy(config)
        self.admission = EngineAdmission(config, kv_manager.capacity_tokens, kv_manager.block_size,
                                             clock=clock, window_s=stats_window_s)
        self.requests: dict[str, Request] = {}  # every unfinished request
        self.shared_blocks = SharedPromptBlocks(kv_manager)  # prompt blocks live requests hold or will compute
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self._groups: dict[str, list[Request]] = {}  # n > 1: unfinished members by group_id
        self._newly_finished: list[FinishedRequest] = []
        self.num_preemptions = {"recompute": 0, "swap": 0}
        self.num_priority_preemptions = 0
        self.num_priority_preemptions_kv = 0  # of those, KV reservations taken
        self._num_steps = 0
        self._output_tokens = RateMeter(stats_window_s, clock)
        self._step_window = StepWindow(stats_window_s)
        # May a waiting request start? The engine's structured outputs answer False while the
        # request's grammar compiles in its own thread (worker/engine_loop/structured_output.py).
        self.is_ready: Callable[[Request], bool] = lambda request: True

    # ---- requests in and out ---------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a request, or raise InvalidRequestError (never fits) / OverloadedError (retry)."""
        if request.request_id in self.requests:
            raise InvalidRequestError(f"request id {request.request_id!r} is already in flight")
        self.admission.check_valid(request)
        # Its resident prefix is pinned first (held until it ends), so the blocks admission
        # counts as cached cannot be evicted before it runs; a refusal unpins them. Blocks
        # an admitted request is about to compute (same chain hash in its prompt) are not
        # reserved twice either: this one waits for them (SharedPromptBlocks.in_progress) and shares.
        pinned_tokens = self.kv.pin_prefix(request).num_tokens
        cached_tokens = pinned_tokens + self.shared_blocks.claimed_blocks_after(request, pinned_tokens) * self.kv.block_size
        try:
            taken = self.admission.check_capacity(request, len(self.waiting), cached_tokens, self._shared_tokens(),
                                                  self._reservations_to_take(request), self._shared_tokens_without)
        except BaseException:
            self.kv.unpin(request)
            raise
        self._take_reservations(taken, request)
        self.admission.reserve(request, cached_tokens)
        request.num_pinned_tokens = pinned_tokens
        request.num_reserved_cached_tokens = cached_tokens
        self.shared_blocks.claim(request, +1)
        request.status = RequestStatus.QUEUED
        self.kv.update_block_hashes(request)
        self.requests[request.request_id] = request
        self.waiting.append(request)
        if request.group_id is not None:
            self._groups.setdefault(request.group_id, []).append(request)

    def abort_requests(self, request_ids: str | Iterable[str],
                       status: RequestStatus = RequestStatus.CANCELLED) -> list[Request]:
        """Stop requests wherever they are and free their blocks. Unknown ids are ignored
        (the request may have finished a moment earlier)."""
        return self._finish_many(request_ids, status)

    def finish_requests(self, request_ids: str | Iterable[str],
                        status: RequestStatus = RequestStatus.FINISHED) -> list[Request]:
        """The engine saw a stop condition (FINISHED) or a failure (FAILED)."""
        return self._finish_many(request_ids, status)

    def _reservations_to_take(self, request: Request) -> list[Request]:
        """Requests whose KV reservation `request` may take when the budget refuses it, the
        first to take first: of a strictly less important class, preempted for priority fewer
        than max_priority_preemptions times, least important and most recently started first
        (one still waiting to start first of all: it loses no work). Empty when off."""
        if not (self.config.priority_preemption and self.config.priority_preempts_kv_reservations):
            return []
        victims = [r for r in self.requests.values() if r.reserved_kv_tokens
                   and r.importance_class > request.importance_class
                   and r.num_priority_preemptions < self.config.max_priority_preemptions]
        return sorted(victims, key=priority_victim_order, reverse=True)

    def _take_reservations(self, victims: list[Request], request: Request) -> None:
        """`request` takes the victims' reservations: each owes its own from now on; a
        running one is preempted at the start of the next step (schedule), never mid-step.
        Their pinned prefixes are let go too: pinned blocks no reservation covers count as
        committed, and a waiting victim holding them kept important requests out (the
        KV-bound priority campaign: a fourth important request waited 7 s behind them)."""
        for victim in victims:
            self.admission.take(victim)
            self.kv.unpin(victim)
            victim.num_pinned_tokens = victim.num_reserved_cached_tokens = 0
            victim.num_priority_preemptions += 1
            self.num_priority_preemptions += 1
            self.num_priority_preemptions_kv += 1
            logger.debug("%s (class %d) took the KV reservation of %s (class %d)", request.request_id,
                         request.importance_class, victim.request_id, victim.importance_class)

    def _finish_many(self, request_ids: str | Iterable[str], status: RequestStatus) -> list[Request]:
        if not status.is_finished:
            raise InvalidRequestError(f"{status.name} is not a terminal status")
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        done = []
        for request_id in ids:
            request = self.requests.get(request_id)
            if request is not None:
                self._finish(request, status)
                done.append(request)
        return done

    def _finish(self, request: Request, status: RequestStatus) -> None:
        (self.running if request in self.running else self.waiting).remove(request)
        self.shared_blocks.pin_for_claimants(self.waiting)
        self.kv.free(request)
        self.kv.unpin(request)
        self.shared_blocks.claim(request, -1)
        request.is_swapped = False
        if status is RequestStatus.FINISHED:
            self.admission.observe_finished(request)
        self.admission.release(request)
        if request.group_id is not None:
            members = self._groups[request.group_id]
            members.remove(request)
            if not members:
                del self._groups[request.group_id]
        self.policy.on_finished(request)
        request.status = status
        request.finished_time = self.clock()
        del self.requests[request.request_id]
        self._newly_finished.append(FinishedRequest(request.request_id, status))

    def _shared_tokens(self) -> int:
        return self.kv.num_pinned_blocks_unowned() * self.kv.block_size

    def _shared_tokens_without(self, requests: Iterable[Request]) -> int:
        """_shared_tokens once `requests` let their pins and blocks go (their reservations taken)."""
        return self.kv.num_pinned_blocks_unowned(without={r.request_id for r in requests}) * self.kv.block_size

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ---- one step --------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        now = self.clock()
        self._num_steps += 1
        for request in [r for r in self.waiting if self.admission.is_expired(r, now)]:
            logger.info("request %s rejected: queued over %.1f s", request.request_id, self.config.max_queue_time_s)
            self._finish(request, RequestStatus.REJECTED)
        budget = StepBudget(self.config.max_num_batched_tokens, self.config.max_prefill_tokens_per_step)
        plan = StepPlan()
        for request in [r for r in self.running if r.owed_kv_tokens]:
            self._preempt(request, plan)  # its reservation was taken (add_request): it may not grow
        num_owing_preempted = len(plan.preempted_ids)
        self._schedule_running(budget, plan)
        if len(plan.preempted_ids) == num_owing_preempted:  # blocks freed for lack of blocks go
            self._schedule_waiting(budget, plan, now)  # to the preempted first, not to newcomers
        self.kv.flush_events()
        tier = self.kv.take_tier_copies()
        output = SchedulerOutput(
            step=self._num_steps, scheduled=tuple(plan.scheduled), preempted_ids=tuple(plan.preempted_ids),
            swap_out=tuple(plan.swap_out), swap_in=tuple(plan.swap_in), copy_blocks=tuple(plan.copy_blocks),
            finished=tuple(self._newly_finished), token_budget=self.config.max_num_batched_tokens,
            tier_stores=tier.stores, tier_loads=tier.loads)
        self._newly_finished = []
        self._record_step(output, now)
        return output

    def _schedule_running(self, budget: StepBudget, plan: StepPlan) -> None:
        self.running.sort(key=running_order)
        # Decode tokens first, then prefill chunks (each group in priority order), so a long
        # prompt can never take the step's budget from requests that are generating.
        for request in sorted(self.running, key=lambda r: r.num_tokens_to_compute > 1):
            if request.status is RequestStatus.QUEUED:  # preempted earlier in this loop
                continue
            remaining = request.num_tokens_to_compute
            num_tokens = budget.grant(remaining)
            if num_tokens == 0:
                continue
            drafts = self._drafts_that_fit(request, remaining, budget)
            while not self.kv.can_append(request, num_tokens):
                victim = max((r for r in self.running if r.request_id not in plan.scheduled_ids), key=running_order)
                self._preempt(victim, plan)
                if victim is request:
                    break
            else:
                self.kv.append(request, num_tokens + len(drafts))
                budget.consume(remaining, num_tokens + len(drafts))
                plan.add(request, num_tokens, drafts)
        for request in self.running:
            request.spec_token_ids = []  # proposals are for this step only

    def _drafts_that_fit(self, request: Request, remaining: int, budget: StepBudget) -> tuple[int, ...]:
        """The drafts a decoding request runs this step: as many as the step's token budget
        and the free blocks allow beyond its one decode token. Drafts never preempt anyone:
        a request short of blocks decodes plainly (or preempts for that one token)."""
        if remaining != 1 or not request.spec_token_ids:
            return ()
        drafts = request.spec_token_ids[:max(0, budget.tokens_left - 1)]
        while drafts and not self.kv.can_append(request, 1 + len(drafts)):
            drafts = drafts[:-1]
        return tuple(drafts)

    def _preempt(self, request: Request, plan: StepPlan) -> None:
        self.running.remove(request)
        mode = self.config.preemption_mode
        if mode == "swap":
            pairs = self.kv.swap_out(request)
            if pairs is None:
                mode = "recompute"  # swap space full
            else:
                plan.swap_out.extend(pairs)
                request.is_swapped = True
        if mode == "recompute":
            self.shared_blocks.pin_for_claimants(self.waiting)
            self.kv.free(request)
            request.num_computed_tokens = 0  # its outputs so far are recomputed as prompt
        request.status = RequestStatus.QUEUED
        request.num_preemptions += 1
        self.num_preemptions[mode] += 1
        self.waiting.append(request)
        plan.preempted_ids.append(request.request_id)
        logger.debug("preempted %s (%s)", request.request_id, mode)

    def _schedule_waiting(self, budget: StepBudget, plan: StepPlan, now: float) -> None:
        candidates = self.policy.admission_candidates(sorted(self.waiting, key=waiting_order), now)
        for request in candidates:
            if request.owed_kv_tokens and not self._reserve_again(request):
                continue  # its reservation was taken: it waits for the budget, others may run
            while True:
                full = len(self.running) >= self.config.max_num_seqs or budget.tokens_left == 0
                admission = AdmitOutcome.BLOCKED if full else self._try_admit(request, budget, plan, now)
                if admission is not AdmitOutcome.BLOCKED:
                    break
                if not self._preempt_for_priority(request, budget, plan):
                    return  # the first that does not fit stops admission

    def _preempt_for_priority(self, request: Request, budget: StepBudget, plan: StepPlan) -> bool:
        """Make room for a blocked waiting `request` by preempting one running request of a
        strictly less important class (largest priority_victim_order) that has been
        preempted for priority fewer than max_priority_preemptions times. One victim per
        call: the caller retries the admission and calls again while it is still blocked.
        A victim already scheduled this step is taken out of the step first (its budget
        given back; its blocks go with the preemption). False = no victim, or off.

        Why the limit: without it a stream of important arrivals could preempt the same
        request forever (starvation) and each preemption recomputes its whole prefix
        (thrashing); past the limit a request is never chosen again and runs to the end."""
        if not self.config.priority_preemption:
            return False
        if budget.grant(known_tokens_to_compute(request)) == 0 and not any(
                r.request_id in plan.scheduled_ids and r.importance_class > request.importance_class
                for r in self.running):
            return False  # out of step budget, and no victim would give any back: wait a step
        victims = [r for r in self.running if r.importance_class > request.importance_class
                   and r.num_priority_preemptions < self.config.max_priority_preemptions]
        if not victims:
            return False
        victim = max(victims, key=priority_victim_order)
        if victim.request_id in plan.scheduled_ids:
            entry = plan.remove(victim)
            budget.give_back(victim.num_tokens_to_compute, entry.num_scheduled_tokens)
        self._preempt(victim, plan)
        victim.num_priority_preemptions += 1
        self.num_priority_preemptions += 1
        logger.debug("preempted %s (class %d) for %s (class %d)", victim.request_id, victim.importance_class,
                     request.request_id, request.importance_class)
        return True

    def _try_admit(self, request: Request, budget: StepBudget, plan: StepPlan, now: float) -> AdmitOutcome:
        if request.is_swapped:
            remaining = request.num_tokens_to_compute
            num_tokens = budget.grant(remaining)
            if num_tokens == 0 or not self.kv.can_swap_in(request, num_tokens):
                return AdmitOutcome.BLOCKED
            plan.swap_in.extend(self.kv.swap_in(request, num_tokens))
            request.is_swapped = False
            return self._start_running(request, remaining, num_tokens, budget, plan, now)
        if not self.is_ready(request):
            return AdmitOutcome.SKIPPED  # its grammar compiles: the ones behind it may start
        must_wait, fork_source = self._group_gate(request)
        if must_wait:
            return AdmitOutcome.SKIPPED
        if fork_source is not None:
            num_tokens = budget.grant(1)  # a forked child recomputes only its last prompt token
            if num_tokens == 0 or not self.kv.can_fork(fork_source, request, num_tokens):
                return AdmitOutcome.BLOCKED
            plan.copy_blocks.extend(self.kv.fork(fork_source, request, num_tokens))
            self._note_cache_hit(request, request.num_computed_tokens)
            return self._start_running(request, 1, num_tokens, budget, plan, now)
        match = self.kv.match_prefix(request)
        if self.shared_blocks.in_progress(request, len(match.block_ids), self.running):
            return AdmitOutcome.SKIPPED  # a running request is computing its next blocks: share them
        match = self.kv.match_tier(request, match)  # blocks past the pool's hits, in host memory
        remaining = request.num_tokens - match.num_tokens
        num_tokens = budget.grant(remaining)
        if num_tokens == 0 or not self.kv.can_allocate(request, num_tokens, match):
            return AdmitOutcome.BLOCKED
        self._settle_reservation(request, match.resident())
        match = self.kv.allocate(request, num_tokens, match)
        self._note_cache_hit(request, match.num_tokens)
        return self._start_running(request, request.num_tokens - match.num_tokens, num_tokens, budget, plan, now)

    def _reserve_again(self, request: Request) -> bool:
        """A request whose reservation was taken reserves again before it resumes: its
        resident prefix pinned again (as on admission) and the rest reserved, if the budget
        has room for it (what is owed ahead of it counted); else nothing is held."""
        pinned_tokens = self.kv.pin_prefix(request).num_tokens
        needed = self.admission.reservation_for(request, pinned_tokens, request.reserved_output_tokens)
        if not self.admission.fits_again(request, needed, self._shared_tokens()):
            self.kv.unpin(request)
            return False
        self.admission.reserve_again(request, needed)
        request.num_pinned_tokens = request.num_reserved_cached_tokens = pinned_tokens
        return True

    def _settle_reservation(self, request: Request, match) -> None:
        """At its start, pin the shared blocks the request was admitted against (so they stay
        counted once its first owner finishes), and if fewer are there than admission
        counted (the other request was cancelled or preempted first), reserve the rest
        now. That top-up may pass the budget for a while: preemption is the safety valve."""
        self.kv.extend_pin(request, match)
        request.num_pinned_tokens = max(request.num_pinned_tokens, match.num_tokens)
        shortfall = request.num_reserved_cached_tokens - match.num_tokens
        if shortfall > 0:
            self.admission.top_up(request, shortfall)
            request.num_reserved_cached_tokens = match.num_tokens

    def _group_gate(self, request: Request) -> tuple[bool, Request | None]:
        """n > 1 siblings wait until one of them has computed the prompt, then fork from it.
        (must_wait, fork_source). The lowest sample_index left unfinished never waits, so a
        group cannot deadlock when its first child is cancelled or preempted."""
        if request.group_id is None or request.num_output_tokens > 0:
            return False, None
        members = [m for m in self._groups[request.group_id] if m is not request]
        for member in members:
            if self.kv.holds(member) and member.num_computed_tokens >= request.num_prompt_tokens:
                return False, member
        return any(m.sample_index < request.sample_index for m in members), None

    def _note_cache_hit(self, request: Request, num_cached_tokens: int) -> None:
        if request.first_scheduled_time is None:  # first admission only: recomputes are not hits
            request.num_cached_tokens = num_cached_tokens
            self.kv.record_prefix_query(request.num_prompt_tokens, num_cached_tokens)

    def _start_running(self, request: Request, remaining: int, num_tokens: int, budget: StepBudget,
                       plan: StepPlan, now: float) -> AdmitOutcome:
        self.waiting.remove(request)
        self.running.append(request)
        resumed_decode = request.num_output_tokens > 0 and request.num_tokens_to_compute == 1
        request.status = RequestStatus.DECODING if resumed_decode else RequestStatus.PREFILLING
        if request.first_scheduled_time is None:
            request.first_scheduled_time = now
        budget.consume(remaining, num_tokens)
        plan.add(request, num_tokens)
        return AdmitOutcome.ADMITTED

    # ---- after the forward -----------------------------------------------------------------

    def update_from_output(self, output: SchedulerOutput, sampled_token_ids: dict[str, int],
                           accepted_drafts: dict[str, tuple[int, ...]] | None = None) -> None:
        """Advance each scheduled request by its scheduled tokens; append the sampled token
        where the chunk reached the end of the known tokens. A speculating request advances
        by its known token and the drafts the target accepted (appended before the sampled
        token); the slots of rejected drafts are given back (`kv.trim`), so only accepted
        tokens ever reach a full block's prefix-cache hash. Requests aborted since
        `schedule()` are skipped (their blocks are already free)."""
        now = self.clock()
        accepted_drafts = accepted_drafts or {}
        for scheduled in output.scheduled:
            request = scheduled.request
            if self.requests.get(request.request_id) is not request or not self.kv.holds(request):
                continue
            assert request.num_computed_tokens == scheduled.num_computed_tokens, "update for a stale output"
            accepted = accepted_drafts.get(request.request_id, ()) if scheduled.spec_token_ids else ()
            assert tuple(scheduled.spec_token_ids[:len(accepted)]) == tuple(accepted), "accepted a non-draft"
            num_rejected = len(scheduled.spec_token_ids) - len(accepted)
            request.num_computed_tokens += scheduled.num_scheduled_tokens - num_rejected
            if num_rejected:
                self.kv.trim(request)
            if scheduled.sample:
                if request.request_id not in sampled_token_ids:
                    raise KeyError(f"no sampled token for {request.request_id}, which was due to sample")
                for token_id in (*accepted, sampled_token_ids[request.request_id]):
                    request.append_output_token(token_id)
                self.admission.grow_for_output(request)
                self._output_tokens.add(1 + len(accepted))
                request.status = RequestStatus.DECODING
                if request.first_token_time is None:
                    request.first_token_time = now
            self.kv.cache_full_blocks(request)
            request.peak_kv_tokens = max(request.peak_kv_tokens, request.num_computed_tokens)
        self.kv.flush_events()

    # ---- figures and invariants --------------------------------------------------------------

    def _record_step(self, output: SchedulerOutput, now: float) -> None:
        kv_tokens = sum(r.num_computed_tokens for r in self.running) + output.total_num_scheduled_tokens
        self._step_window.record(now, kv_tokens, output.total_num_scheduled_tokens / output.token_budget)

    def stats(self) -> SchedulerStats:
        kv_stats = self.kv.stats()
        window = self._step_window
        shared_tokens = self._shared_tokens()  # walks every pin and block table: once per report
        return SchedulerStats(
            num_running=len(self.running), num_waiting=len(self.waiting),
            num_swapped=sum(r.is_swapped for r in self.waiting),
            queued_prompt_tokens=sum(known_tokens_to_compute(r) for r in self.waiting),
            kv_tokens_used=kv_stats.kv_tokens_used,
            # owed reservations included: the router must not offer their room to newcomers
            kv_tokens_reserved=self.admission.committed_tokens(shared_tokens) + self.admission.owed_tokens,
            kv_tokens_budget=self.admission.budget_tokens,
            peak_kv_tokens=window.peak_kv_tokens(), mean_kv_tokens=window.mean_kv_tokens(),
            batch_fill_rate=window.mean_fill_rate(),
            num_preemptions_recompute=self.num_preemptions["recompute"],
            num_preemptions_swap=self.num_preemptions["swap"],
            num_preemptions_priority=self.num_priority_preemptions,
            num_outgrown_estimates=self.admission.num_outgrown_estimates,
            prefix_cache_hit_rate=kv_stats.prefix_hit_rate, output_tokens_per_s=self._output_tokens.rate(),
            drain_tokens_per_s=self.admission.drain.rate(), num_steps=self._num_steps, kv=kv_stats,
            tokens_to_compute=sum(tokens_left_to_compute(r) for r in self.requests.values()),
            num_preemptions_priority_kv=self.num_priority_preemptions_kv,
            kv_tokens_reserved_shared=self._shared_class_committed_tokens(shared_tokens),
            held_block_hashes=self.shared_blocks.held_block_hashes())

    def _shared_class_committed_tokens(self, shared_tokens: int) -> int:
        """What the classes sharing the rest of a kept KV share commit: their reservations,
        what they owe, and the pinned blocks only they hold (all a more important request
        could free by taking their reservations). `shared_tokens`: `_shared_tokens()` now."""
        sharing = [r for r in self.requests.values() if self.admission.in_shared_class(r)]
        pinned_only_by_them = shared_tokens - self._shared_tokens_without(sharing) if sharing else 0
        # (negative when their tables hold blocks others pinned: taking them would add those)
        return max(0, self.admission.shared_class_reserved_tokens + self.admission.shared_class_owed_tokens
                   + pinned_only_by_them)

    def check_integrity(self) -> None:
        self.kv.check_integrity()
        waiting_ids = {r.request_id for r in self.waiting}
        running_ids = {r.request_id for r in self.running}
        assert len(waiting_ids) == len(self.waiting) and len(running_ids) == len(self.running), "duplicate entry"
        assert not (waiting_ids & running_ids), "a request both waiting and running"
        assert waiting_ids | running_ids == self.requests.keys(), "requests lost or unknown"
        assert len(self.running) <= self.config.max_num_seqs
        for request in self.running:
            assert request.status in (RequestStatus.PREFILLING, RequestStatus.DECODING), request.status
            assert self.kv.holds(request) and not request.is_swapped
            assert request.num_tokens_to_compute >= 1, f"{request.request_id} has nothing left to compute"
        for request in self.waiting:
            assert request.status is RequestStatus.QUEUED and not self.kv.holds(request)
            assert request.is_swapped == self.kv.is_swapped(request)
            assert request.is_swapped or request.num_computed_tokens == 0
        assert self.admission.reserved_tokens == sum(r.reserved_kv_tokens for r in self.requests.values())
        owing = [r for r in self.requests.values() if r.owed_kv_tokens]
        assert not any(r.reserved_kv_tokens for r in owing), "a request both holding and owing a reservation"
        assert self.admission.num_reservations == len(self.requests) - len(owing)
        assert self.admission.owed_tokens == sum(r.owed_kv_tokens for r in owing)
        assert self.admission.shared_class_reserved_tokens == sum(
            r.reserved_kv_tokens for r in self.requests.values() if self.admission.in_shared_class(r))
        grouped = [m for members in self._groups.values() for m in members]
        assert all(self.requests.get(m.request_id) is m for m in grouped), "a finished request left in a group"
