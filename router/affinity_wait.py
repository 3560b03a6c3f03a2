"""The affinity wait: a request whose cached prefix lives on a worker with no KV budget left
waits a little for room there, instead of spilling at once to a worker that must compute the
whole prompt.

Why: under load a family's worker is often full for a moment (its running requests end
within a step or two). Routed to whichever worker has room first (a `preferred_full` spill),
the family's next request computes its whole prefix there, and the family lives on both
workers from then on, each caching a copy: with the wait off (affinity_wait_s: 0), the
2-worker routing campaign at 16 in flight splits 4-5 of its 6 families that way, all by full
budgets, none by the load guard (docs/routing.md, "Admission").

The rule, asked by admission (`acquire(hold=...)`) each time it would route the request to
one of the workers with room (router/stages/admit_route.py, on arrival and at every pump of the queue):

- its longest cached prefix is on workers that are not among those offered (no room for it
  now): taking one offered would be a spill;
- the routing policy, shown every healthy worker regardless of budget, would still pick one
  of those preferred workers by prefix match: the load guard (router/routing.py) would not
  move the request anyway. A worker that is really overloaded is left as before;
- then it holds out: the request waits in the admission queue at its place, stepped over by
  the waiters behind it (they may take the other workers), until a preferred worker has
  room (taken at once), or `router.affinity_wait_s` has passed since it first held out
  (under predicted_latency at least the prefill the spill would add, `_recompute_s`, and then
  as long as the preferred worker is predicted to drain and serve it sooner than the spill
  would, `_home_sooner`; never more than half the time left before its deadline, nor half of
  `max_queue_wait_s`), after which it is routed as before (a spill). Those first bounds weigh
  a spill to another of the family's homes (one the spreading rule chose, holding its first
  `spread_family_blocks` blocks); a spill to a worker holding none of the family would start
  it a second home nobody chose, so that request waits as long as a hold may (half the time to
  its deadline, half `max_queue_wait_s`). A degradation ladder's try-now step never holds, nor
  does a request the queue has no slot for.
- a request its prefix's worker refused (that worker's own admission; the router leaves the
  refuser out until its next report) first waits for that report, whatever the load guard
  made of the view the refusal proved stale; then the rule above, holding as long as a hold
  may (as a request of a claimed family does) while the refuser stays the family's worker.

So a hold between the family's homes costs at most `affinity_wait_s` (plus one stats
refresh, the next pump) of TTFT, or under predicted_latency what the prediction says a spill
would cost anyway; a hold that keeps the family on its one home costs at most the hold's
bound, and saves the other worker a whole-prompt prefill and a second copy of the prefix.
Measured on the 2-worker campaign: with only the first bounds, every family split left was a
spill after the wait for a home that was really full ran out. 0 turns it off.
"""

from __future__ import annotations

import enum
import math
import random
import time
from collections.abc import Callable, Mapping, Sequence

from kvmesh.core.config import RouterConfig
from kvmesh.core.seams import WorkerStats
from kvmesh.router.latency import uncached_prompt_tokens
from kvmesh.router.routing import (PredictedLatencyState, RouteRequest, RoutingPath, choose_worker,
                                   preferred_workers)


class AffinityWaitOutcome(str, enum.Enum):
    ROOM = "room"  # a preferred worker had room within the wait: the request went there
    TIMED_OUT = "timed_out"  # the wait ran out: the request spilled


# (healthy workers, the router's in-flight tokens per worker, its mean admitted request)
ClusterLoad = tuple[Sequence[WorkerStats], Mapping[str, int], float]


class AffinityHold:
    """One request's affinity wait, asked by admission whenever it would route the request."""

    def __init__(self, matched_blocks: Mapping[str, int], config: RouterConfig, exclude: frozenset[str] = frozenset(),
                 deadline_s: float | None = None, clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time, request: RouteRequest | None = None,
                 state: PredictedLatencyState | None = None, refused_by: str | None = None,
                 awaiting_report: Callable[[str], bool] | None = None):
        self._matched = matched_blocks
        # The worker whose own admission refused this request, and whether the router still
        # waits for that worker's next report (admission.note_refusal): see `_awaits_refuser`.
        self._refused_by, self._awaiting_report = refused_by, awaiting_report
        self._report_wait_until: float | None = None
        self._request, self._state = request, state  # the predicted_latency policy's (else None)
        self._config = config
        self._exclude = exclude
        self._deadline_s = deadline_s  # the request's, absolute wall clock
        self._clock = clock
        self._wall_clock = wall_clock
        self._preferred = preferred_workers(matched_blocks, exclude) if config.affinity_wait_s > 0 else set()
        # A new family with several router replicas: its worker is the one its rendezvous
        # placement picks from every healthy worker (routing._place_by_rendezvous), and it waits
        # for room there as a cached prefix's request does (`_place_new_family`).
        self._placing = (not self._preferred and config.affinity_wait_s > 0 and config.num_replicas > 1
                         and config.policy == "predicted_latency" and request is not None
                         and request.family_key is not None and state is not None)
        self._until: float | None = None  # when the hold runs out; -inf once it never applies
        self._longest_s = 0.0  # the longest it may hold (set with `_until`)
        self.started_at: float | None = None  # when it first held out (None: it never did)
        self.declined: str | None = None  # why it never held out though it would spill (`describe`)

    def holds(self, offered: Sequence[WorkerStats], view: Callable[[], ClusterLoad], rng: random.Random) -> bool:
        """True: hold out rather than take one of `offered` (the workers with room now).
        `view()`: every healthy worker with the router's in-flight tokens and mean admitted
        request, for the load guard's verdict without the budgets (asked only the first time
        the request would spill: the common case, its worker has room, costs a set lookup)."""
        if self._placing:
            self._place_new_family(view, rng)
        if not self._preferred or self._preferred & {w.worker_id for w in offered}:
            return False
        now = self._clock()
        if self._awaits_refuser(now):
            return True
        if self._until is None:  # first time it would spill: only for budget's sake
            healthy, in_flight_tokens, mean_request_tokens = view()
            candidates = [w for w in healthy if w.worker_id not in self._exclude]
            decision = choose_worker(self._matched, candidates, self._config, rng, None, in_flight_tokens,
                                     mean_request_tokens, request=self._request, state=self._state)
            expected = RoutingPath.NO_PREFIX if self._matched_nothing() else RoutingPath.PREFIX_MATCH
            if decision.path is expected and decision.worker_id in self._preferred:
                wait_s = max(self._config.affinity_wait_s, self._recompute_s(offered))
                self._longest_s = self._longest_hold_s()
                claimed = self._request is not None and self._request.claimed_worker in self._preferred
                if claimed or self._refused_by in self._preferred or not self._spill_joins_a_home(offered):
                    # The replicas' shared claim names its worker: sent elsewhere, this request
                    # starts the family a second home while the other replicas' requests go to
                    # the claimed one (a split). Or its home refused it: the home's report since
                    # still leaves it the family's worker by the load guard, and only its budget
                    # is short for now. Or no worker with room holds the family at all: the
                    # spill would start it a second home that the spreading rule (the load
                    # guard's verdict above) did not choose. Each way it waits for room at home
                    # as long as a hold may.
                    wait_s = self._longest_s
                wait_s = min(wait_s, self._longest_s)
                self._until = now + wait_s if wait_s > 0 else -math.inf
                self.started_at = now if wait_s > 0 else None
            else:
                self._until = -math.inf  # the load guard moves it anyway: waiting only delays the spill
                self.declined = f"the policy sends it to {decision.worker_id} ({decision.path.value})"
        if now < self._until:
            return True
        return self.started_at is not None and now - self.started_at < self._longest_s \
            and self._home_sooner(offered, view)

    def _spill_joins_a_home(self, offered: Sequence[WorkerStats]) -> bool:
        """Some worker with room already holds the family (its first `spread_family_blocks`
        prompt blocks, or as much as the preferred worker holds when that is fewer): a spill
        there adds work to a home the family has, chosen once by the spreading rule, and the
        ski-rental and drain rules below weigh its wait. A spill anywhere else starts a second
        home nobody chose: on the 2-worker campaign every split left was such a spill after the
        wait for a home that was really full ran out (docs/routing.md)."""
        home_blocks = max((self._matched.get(w, 0) for w in self._preferred), default=0)
        family_blocks = min(self._config.spread_family_blocks, home_blocks)
        return family_blocks > 0 and any(self._matched.get(w.worker_id, 0) >= family_blocks for w in offered)

    def _matched_nothing(self) -> bool:
        return not any(self._matched.get(w, 0) for w in self._matched)

    def _place_new_family(self, view: Callable[[], ClusterLoad], rng: random.Random) -> None:
        """Once: the worker the several-replica placement picks from every healthy worker
        becomes the preferred one. Among the workers with room only, one replica whose own
        burst had filled that worker's budget in its view sent the family elsewhere while the
        other replica sent it there (3 families of 6 split at 16 in flight on the two-replica
        campaign)."""
        self._placing = False
        healthy, in_flight_tokens, mean_request_tokens = view()
        candidates = [w for w in healthy if w.worker_id not in self._exclude]
        if not candidates:
            return
        decision = choose_worker(self._matched, candidates, self._config, rng, None, in_flight_tokens,
                                 mean_request_tokens, request=self._request, state=self._state)
        if decision.path is RoutingPath.NO_PREFIX:
            self._preferred = {decision.worker_id}

    def _longest_hold_s(self) -> float:
        """Half the time left before the deadline at most (a spill must still make it), and
        half the queue's own bound (a holder is refused as overloaded past it)."""
        longest_s = self._config.max_queue_wait_s / 2
        if self._deadline_s is not None:
            longest_s = min(longest_s, (self._deadline_s - self._wall_clock()) / 2)
        return longest_s

    def _awaits_refuser(self, now: float) -> bool:
        """A request its prefix's worker refused (that worker's own admission: the router's
        view of it was behind) waits for that worker's next report, within `_longest_hold_s`
        (the request's deadline), whatever the load guard says of the stale view; the report
        then decides by the rule above, and while it leaves the refuser the family's worker
        the request waits for room there as long as a hold may. Left out until that report,
        the refuser was never offered, and the request spilled at once to a worker that
        computed its whole prefix: the family then lived on both workers (measured on the
        2-worker campaign at 16 in flight, one family of six split that way); waiting for the
        report only `affinity_wait_s`, or for room after it only as a full worker's request
        does, a loaded box's late polls and a home still full for a moment split two."""
        if self._refused_by not in self._preferred or self._awaiting_report is None \
                or not self._awaiting_report(self._refused_by):
            return False
        if self._report_wait_until is None:
            self._report_wait_until = now + self._longest_hold_s()
            if self.started_at is None and self._report_wait_until > now:
                self.started_at = now
        return now < self._report_wait_until

    def _home_sooner(self, offered: Sequence[WorkerStats], view: Callable[[], ClusterLoad]) -> bool:
        """predicted_latency, once the wait above has run out: keep waiting while the prefix's
        worker is predicted to drain and serve the request sooner than the best worker with
        room would serve it, the prefix it would compute counted (the wait tracks the home's
        drain instead of a fixed bound). Past capacity every worker queues for seconds: a
        spill then waits out a queue of its own and adds a whole prefix's prefill to a
        saturated cluster. False for the other policies.

        The prediction counts output still to come at the prefill rate (the stats do not split
        it from running requests' prompts still to compute), so where outputs are long the
        home drains later than predicted and the hold can last to its bound, half of
        `max_queue_wait_s`. Counting that remainder at the worker's decode rate wrongly
        charged running requests' chunked prefill as decode: spills rose from 9 to 14 on the
        llm-d shape at 16 qps."""
        if self._request is None or self._state is None or not offered:
            return False
        healthy, in_flight_tokens, _ = view()
        prompt, block = self._request.num_prompt_tokens, self._request.block_size

        def predicted_s(worker: WorkerStats) -> float:
            uncached = uncached_prompt_tokens(prompt, self._matched.get(worker.worker_id, 0), block)
            return self._state.predict_s(worker, in_flight_tokens.get(worker.worker_id, 0), uncached)

        home = [predicted_s(w) for w in healthy if w.worker_id in self._preferred]
        return bool(home) and min(home) < min(predicted_s(w) for w in offered)

    def _recompute_s(self, offered: Sequence[WorkerStats]) -> float:
        """predicted_latency: the prefill a spill would add, the prompt tokens cached on the
        preferred worker but not on the best offered one, at the step-cost model's rate (0.0
        for the other policies). Wait up to what the alternative costs, then take it (the
        ski-rental rule): under load the wait usually ends first, as the worker's running
        requests finish and free its budget, and the prefix is not computed twice."""
        if self._request is None or self._state is None or not offered:
            return 0.0
        prompt, block = self._request.num_prompt_tokens, self._request.block_size
        home = min(uncached_prompt_tokens(prompt, self._matched.get(w, 0), block) for w in self._preferred)
        elsewhere = min(uncached_prompt_tokens(prompt, self._matched.get(w.worker_id, 0), block) for w in offered)
        return max(0, elsewhere - home) * self._state.cost.prefill_s_per_token

    def describe(self, now: float | None = None) -> str:
        """How the hold went, for a spill's log line."""
        if self.started_at is not None:
            return f"held {(self._clock() if now is None else now) - self.started_at:.2f}s of at most {self._longest_s:.2f}s"
        if self.declined is not None:
            return f"not held: {self.declined}"
        if self._until is None:
            return "not held: never asked (a try-now, no queue slot, or its home was offered)"
        return "not held: no time left to hold (its deadline)"

    def outcome(self, chosen: str) -> AffinityWaitOutcome | None:
        """How the wait ended for a request routed to `chosen` (None: it never waited)."""
        if self.started_at is None:
            return None
        return AffinityWaitOutcome.ROOM if chosen in self._preferred else AffinityWaitOutcome.TIMED_OUT

