"""The router's view of each worker's KV budget (router admission's half that needs no
queue): what each worker has committed per its latest report plus what this router sent it
since, and whether a request of a given cost and class fits there. RouterAdmission
(router/admission.py) asks it; it keeps no waiters and makes no decisions about order.

Budget (the articles' rule, per worker, from its latest `WorkerStats`):

    committed_w = kv_tokens_reserved_w            prompt + reserved output of everything the
                                                  worker runs or queues (its stats)
                + in_flight_w                     tokens this router admitted to w after
                                                  those stats were taken (not in them yet)
    a request of cost C_w = n x K x (ceil((prompt + max_tokens) / K) - cached_w) fits on w when
                                                  committed_w + C_w <= kv_tokens_capacity_w

where cached_w is the prompt blocks the prefix index says w already holds (`cost_for`), and
max_tokens is the router's estimate of the output instead when the workers reserve on
expected output (scheduler.admission_reserve: expected; the router learns it per tenant
as the workers do, from finished requests' usage): a
worker reserves only the blocks it will newly allocate, and counts the shared ones once
(worker/engine_loop/admission.py). The router's estimate may be stale; the worker's own check is exact,
and a worker that refuses is spilled over by the router (router/stages/stream.py).

With class-aware KV admission on the workers (scheduler.kv_reserved_fraction f, classes >= c
limited to (1 - f) of the budget; worker/engine_loop/admission.py):

    class >= c:  committed_w + C_w <= (1 - f) x capacity_w
    class <  c:  committed_w - max(0, shared_w - (1 - f) x capacity_w) + C_w <= capacity_w

The first line is stricter than the worker (which caps only what classes >= c hold): f of
the capacity stays free for the next important arrival even while important requests run,
which is what lets one be admitted on arrival when several overlap. (Measured: applying the
worker's looser cap at the router let the flood fill the room the running important
requests left: their TTFT P99 17x idle in one priority campaign run, docs/load-testing.md.)
shared_w is what classes >= c hold per the worker's report (WorkerStats.
kv_tokens_reserved_shared) plus this router's tickets for them since. The second line: the
worker never lets those classes past their limit, so what the router counts for them beyond
it (a flood's tickets the stats already hold, counted twice for a refresh, see below) is
not there, and an important request is admitted on arrival instead of after the next refresh.

With priority preemption of KV reservations on the workers (scheduler.priority_preemption
and priority_preempts_kv_reservations: a worker the budget refuses for a request takes the
reservations of less important classes, worker/engine_loop/admission.py), the second line
lets an important request past all that the sharing classes hold, kept share or not:

    class <  c:  committed_w - shared_w + C_w <= capacity_w

so it is sent at once to a worker that can make room, instead of queueing here for a
flood's reservations to drain (what held its TTFT P99 at 8.8x idle in the KV-bound priority
campaign). The sharing classes keep the first line: a flood is still held back here.

The cluster budget is the sum over healthy workers; a request is admitted when at least one
worker has room, and routing then chooses among the workers that do (the `route` callback).
Capacity is whatever the workers measure and report: nothing here is a hard-coded threshold.

In-flight accounting: a burst arriving between two stats refreshes would all see the same
stale figures and over-admit. Each admission is recorded against its worker with the time it
was sent; `update_stats(stats, taken_at)` forgets the ones sent at least one
`stats_refresh_s` before `taken_at` (the worker counts them by then), and a ticket released
early removes its own. Why the extra refresh period: the request and the stats poll are
separate calls to the worker actor, and a poll sent just after a request can be answered
before the engine has queued that request. Measured on the cluster (tests/
test_overload_e2e.py): forgetting at `taken_at` itself let the router over-admit under a
burst, and the workers' own admission turned those requests away after they had crossed
the cluster. Keeping them one period longer errs on the side of counting a request twice.

Released requests: a ticket released (its request ended on the worker) after the report
that surely counts it (it was already forgotten) gives its cost back at once: it is
credited against that report until one requested after the release, which no longer holds
it. Without the credit a worker that had just finished its requests still looked full for
the rest of the refresh period, and a family's next request, a cache hit there, was sent to
the other worker as a whole-prompt miss (a `preferred_full` spill that put the family on
both workers: the 2-worker routing campaign at 16 in flight, docs/routing.md). The credit is
what the worker frees (`AdmissionTicket.freed_on_release`): the request's blocks less the
prompt blocks other requests running there still hold, per the router's prefix index. So a
family's first request ending while a follower runs frees only its tail (the follower keeps
the prefix pinned), and the last one to end frees the prefix too, whoever was charged for
it (the worker counts a pinned prefix once, to whoever holds it). A credit that is still too
large (another router replica's requests) is caught by the worker's own admission, and the
router re-routes.

Counted exactly where the workers say (`DispatchReport`): each request a replica sends a
worker carries that replica's next dispatch number for the worker (`AdmissionTicket.
dispatch_seq`, `GenerateRequest.dispatch`), and a worker's poll says, read with its figures,
the highest number its engine took in and which of those still run or wait there. A ticket
numbered at or below it is in the report exactly when it is live there, and is dropped from
the pending ones either way (not live: it ended, nothing is left to count); one above it is
not in the report and stays counted, however long the poll took. A ticket released after
the report that holds it is credited until a report no longer holds it. Only tickets without
a number (a worker that does not say, a request pulling its prefix first, the simulator) keep
the time rule above. The time rule's extra period counted a request twice whenever the poll
came back quickly: the family's worker looked full in the router's view and the family's
next request spilled to the other worker (the affinity-wait e2e test's control case).

Cached but not held: a prompt block the worker has cached costs a newcomer nothing there only
while a live request holds it (pinned, in its table, or about to compute it: that one's
reservation or the shared pins already count it). A cached block nobody holds, the newcomer
pins, and the worker adds it to its committed total (pinned, paid by nobody). Charged as free,
a family's request after a pause cost 32 tokens here and 560 on the worker, whose figures then
passed the router's by a prefix per family woken up: on the 2-worker campaign at 16 in flight
the workers refused 5-24 requests a run the router had admitted, and the refused requests split
families. So the cost on a worker (`cost_on_worker`) charges the cached blocks no live request
holds, where held means: claimed by one of this router's requests in flight there not yet ended
(its prefix index), or in the worker's report (`WorkerStats.held_block_hashes`) and not of a
request this router has seen end since.

Several replicas: between two reports each router replica counts only its own dispatches,
so two replicas sending the same worker requests both filled the room its report left, and the
worker refused what the second sent (8-10 requests a run on the two-replica campaign at 16 in
flight, with everything else counted exactly). Each replica therefore takes an equal share of
the room a report leaves, `capacity - kv_tokens_reserved`, among the replicas sending that
worker requests (its DispatchLog: those with dispatches live there or taken in since its
previous poll, `WorkerPool.replicas_sharing`): with k others, the other k / (k + 1) of the room
is kept for them until the next report (`kept_for_other_replicas`). A replica's own releases
since the report stay its own credit. Alone on a worker (one replica, or the others quiet
there) a replica has all of it, as before.

Single-owner state on the replica's event loop: no locks.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable, Mapping, Sequence

from kvmesh.core.config import RouterConfig
from kvmesh.core.seams import DispatchReport, SamplingParams, WorkerStats
from kvmesh.kv.kv_cost import request_kv_tokens
from kvmesh.router.routing import RequestSizeMeter

# cost_for(worker id) -> KV tokens the request would newly reserve there (its cached prefix off)
CostFn = Callable[[str], int]


def _numbered(ticket: "AdmissionTicket", report: DispatchReport | None) -> bool:
    """The ticket's worker says which of this replica's dispatches its report holds, and the
    ticket has a number: counted as the worker says, not by time."""
    return report is not None and ticket.dispatch_seq > 0


def request_cost_tokens(prompt_tokens: int, sampling: SamplingParams, block_size: int,
                        output_tokens: int | None = None) -> int:
    """KV tokens the worker will reserve for a request, as its admission counts them: each of
    the n samples reserves prompt + max_tokens rounded up to whole blocks (K x ceil(S / K)).
    `block_size` is the workers' (no default: an unrounded cost admits more than they take).
    `output_tokens`: the output the worker reserves when not max_tokens (admission_reserve:
    expected, the router's estimate of it)."""
    output = sampling.max_tokens if output_tokens is None else output_tokens
    return request_kv_tokens(prompt_tokens, output, block_size, n=sampling.n)


def _excluding(cost_for: CostFn, exclude: frozenset[str]) -> CostFn:
    """A cost no worker can hold on the excluded workers, so they are never eligible."""
    return lambda worker_id: math.inf if worker_id in exclude else cost_for(worker_id)


def cost_with_cached_prefix(prompt_tokens: int, sampling: SamplingParams, block_size: int,
                            cached_blocks: int, output_tokens: int | None = None) -> int:
    """The cost on a worker that holds `cached_blocks` leading prompt blocks. Capped as the
    worker's prefix match is: the last prompt token is always computed."""
    cached_blocks = min(cached_blocks, (prompt_tokens - 1) // block_size)
    output = sampling.max_tokens if output_tokens is None else output_tokens
    return request_kv_tokens(prompt_tokens, output, block_size, n=sampling.n,
                             cached_prompt_tokens=cached_blocks * block_size)


def cost_on_worker(prompt_tokens: int, sampling: SamplingParams, block_size: int, cached_blocks: int,
                   held_blocks: int, output_tokens: int | None = None) -> int:
    """What the worker adds to its committed KV for a request whose first `cached_blocks`
    prompt blocks it has (cached, or claimed by a request in flight there), of which its live
    requests hold the first `held_blocks` ("Cached but not held"): the request's own blocks,
    plus the cached blocks nobody holds, which it pins and nobody's reservation pays for."""
    cached_blocks = min(cached_blocks, (prompt_tokens - 1) // block_size)
    unheld_blocks = max(0, cached_blocks - held_blocks)
    return (cost_with_cached_prefix(prompt_tokens, sampling, block_size, cached_blocks, output_tokens)
            + unheld_blocks * block_size * sampling.n)


class AdmissionTicket:
    """An admitted request's reservation on one worker; release it exactly when it ends."""

    def __init__(self, release_to: Callable[["AdmissionTicket"], None], worker_id: str, cost_tokens: int,
                 attempt: int, sent_at: float, queue_wait_s: float):
        self._release_to = release_to  # the admission that issued it (RouterAdmission._release)
        self.worker_id = worker_id
        self.cost_tokens = cost_tokens
        # What it adds to its worker's load (the tokens it computes there): its KV cost but for
        # a cached prefix no live request holds, which costs KV and no work (acquire's load_for).
        self.load_tokens = cost_tokens
        self.attempt = attempt
        self.sent_at = sent_at  # monotonic clock of the controller
        self.queue_wait_s = queue_wait_s
        self.shared_class = False  # of a class sharing the rest of a kept KV share (see WorkerBudgets.fits)
        # KV tokens its worker frees when it ends (its blocks less those other requests running
        # there still hold), when the router knows better than the cost; read at release.
        self.freed_on_release: Callable[[], int] | None = None
        # This replica's number for the dispatch to its worker (0: none, the time rule counts it),
        # set as the request is sent (router/stages/stream.py); see "Counted exactly".
        self.dispatch_seq = 0
        # Its prompt's full-block hashes (router/stages/admit_route.py): once it is credited on
        # release, the worker's report no longer proves them held ("Cached but not held").
        self.block_hashes: tuple = ()
        self.released = False
        self._on_release: list[Callable[[], None]] = []

    def on_release(self, callback: Callable[[], None]) -> None:
        """Run `callback` once when the ticket is released (at once if it already was)."""
        if self.released:
            callback()
        else:
            self._on_release.append(callback)

    def release(self) -> None:
        if not self.released:
            self.released = True
            self._release_to(self)
            for callback in self._on_release:
                callback()

    def __enter__(self) -> "AdmissionTicket":
        return self

    def __exit__(self, *exc_info) -> None:
        self.release()

    async def __aenter__(self) -> "AdmissionTicket":
        return self

    async def __aexit__(self, *exc_info) -> None:
        self.release()


class WorkerBudgets:
    """Each healthy worker's KV budget as this router sees it (see the module docstring)."""

    def __init__(self, config: RouterConfig, clock: Callable[[], float], kv_reserved_fraction: float = 0.0,
                 kv_reserved_below_class: int = 1, workers_preempt_kv_reservations: bool = False):
        self._config = config
        self._clock = clock
        # The workers' class-aware KV admission (scheduler.kv_reserved_fraction): requests of
        # a class >= kv_reserved_below_class fit only within (1 - fraction) of a worker's
        # capacity, counted against what those classes hold (WorkerStats.kv_tokens_reserved_shared
        # plus this router's tickets for them since), as the worker counts (see fits).
        self._shared_class_fraction = 1.0 - kv_reserved_fraction
        self._reserved_below_class = kv_reserved_below_class
        # The workers take the sharing classes' reservations for a more important request.
        self._workers_preempt_kv_reservations = workers_preempt_kv_reservations
        self._stats: dict[str, WorkerStats] = {}
        self._reported_at: dict[str, float] = {}  # worker id -> when its current stats were requested
        # Workers whose own admission just refused a request this router thought fitted: their
        # figures are known wrong, so nothing goes there until a report requested after that.
        self._refused_at: dict[str, float] = {}
        self._pending: dict[str, list[AdmissionTicket]] = collections.defaultdict(list)  # sent since refresh
        # Tickets released after the worker's report surely counted them (see "Released
        # requests"): credited against that report until a report requested after the release.
        self._released: dict[str, list[tuple[float, AdmissionTicket, int]]] = collections.defaultdict(list)
        # Numbered tickets the worker's current report holds (live there), no longer pending:
        # released, they are credited against that report ("Counted exactly").
        self._held: dict[str, set[AdmissionTicket]] = collections.defaultdict(set)
        # worker id -> which of this replica's dispatches its current report holds (None: it does not say)
        self._dispatches: Mapping[str, DispatchReport | None] = {}
        # worker id -> how many other router replicas send it requests ("Several replicas")
        self._replicas_sharing: Mapping[str, int] = {}
        # The load guard's unit (routing.imbalance_margin_tokens): the mean cost of recent
        # tickets, the same tokens `in_flight_tokens` adds to a worker's load.
        self._admitted_sizes = RequestSizeMeter()

    # ---- inputs ---------------------------------------------------------------------------

    def update_stats(self, workers: Sequence[WorkerStats], taken_at: float,
                     dispatches: Mapping[str, DispatchReport | None] | None = None,
                     replicas_sharing: Mapping[str, int] | None = None) -> None:
        """Replace the workers' figures. `taken_at` (the admission clock) is when the stats
        were requested: admissions sent before it are assumed counted by the workers, unless
        `dispatches` (worker id -> which of this replica's dispatches those stats hold, read
        with them) says exactly which are ("Counted exactly"). `replicas_sharing`: worker id
        -> the other router replicas sending it requests ("Several replicas")."""
        self._replicas_sharing = replicas_sharing or {}
        for w in workers:  # a worker whose figures did not change keeps its own report time
            if self._stats.get(w.worker_id) is not w:
                self._reported_at[w.worker_id] = taken_at
        self._stats = {w.worker_id: w for w in workers}
        self._dispatches = dispatches or {}
        for worker_id in [w for w, at in self._refused_at.items() if at <= taken_at]:
            del self._refused_at[worker_id]
        for worker_id in list(self._released):
            reported_at = self._reported_at.get(worker_id, -math.inf) if worker_id in self._stats else math.inf
            report = self._dispatches.get(worker_id)
            kept_released = [entry for entry in self._released[worker_id]
                             if (entry[1].dispatch_seq in report.live_seqs if _numbered(entry[1], report)
                                 else entry[0] >= reported_at)]
            if kept_released:
                self._released[worker_id] = kept_released
            else:
                del self._released[worker_id]
        for worker_id in list(self._held):
            report = self._dispatches.get(worker_id)
            held = {t for t in self._held[worker_id] if report is not None and t.dispatch_seq in report.live_seqs}
            if held and worker_id in self._stats:
                self._held[worker_id] = held
            else:
                del self._held[worker_id]
        for worker_id in list(self._pending):
            if worker_id not in self._stats:
                del self._pending[worker_id]
                continue
            self._drop_counted(worker_id)

    def _drop_counted(self, worker_id: str) -> None:
        """Forget the pending tickets the worker's new report counts: numbered ones as it says
        ("Counted exactly"), the others one refresh after the report that surely counts them
        ("In-flight accounting")."""
        report = self._dispatches.get(worker_id)
        counted_before = self._reported_at[worker_id] - self._config.stats_refresh_s
        kept = []
        for ticket in self._pending[worker_id]:
            if _numbered(ticket, report):
                if ticket.dispatch_seq > report.seen_seq:
                    kept.append(ticket)  # not taken in when the figures were read
                elif ticket.dispatch_seq in report.live_seqs:
                    self._held[worker_id].add(ticket)
            elif ticket.sent_at >= counted_before:
                kept.append(ticket)
        if kept:
            self._pending[worker_id] = kept
        else:
            del self._pending[worker_id]

    def note_refusal(self, worker_id: str) -> None:
        """The worker's own admission refused a request this router sent it: its figures here
        are behind (a full budget, or a prefix it has evicted), so no request goes there until
        its next report (requested after now) shows what it really holds."""
        self._refused_at[worker_id] = self._clock()

    def describe(self, worker_id: str) -> str:
        """This router's view of the worker's budget, for a refusal's log line: the worker's
        own message says what it counted, this what the router did."""
        stats = self._stats.get(worker_id)
        if stats is None:
            return "no report"
        credited = sum(credit for _, _, credit in self._released.get(worker_id, ()))
        pending = self._pending.get(worker_id, ())
        return (f"router's view: {stats.kv_tokens_reserved} reported - {credited} credited + "
                f"{sum(t.cost_tokens for t in pending)} in {len(pending)} tickets of {stats.kv_tokens_capacity}")

    def held_blocks(self, worker_id: str, block_hashes) -> int:
        """Leading blocks of `block_hashes` the worker's live requests held per its report
        (`WorkerStats.held_block_hashes`), less those of requests this router has seen end
        since (credited on release: the worker may have let them go)."""
        stats = self._stats.get(worker_id)
        if stats is None or not stats.held_block_hashes:
            return 0
        released = self._released.get(worker_id)
        let_go = {h for _, t, _ in released for h in t.block_hashes} if released else ()
        held = 0
        for block_hash in block_hashes:
            if block_hash not in stats.held_block_hashes or block_hash in let_go:
                break
            held += 1
        return held

    def awaiting_report(self, worker_id: str) -> bool:
        """The worker refused a request and has not reported since (`note_refusal`)."""
        return worker_id in self._refused_at

    def record(self, ticket: AdmissionTicket) -> None:
        """A request just sent to `ticket.worker_id`: counted there until its report does."""
        self._pending[ticket.worker_id].append(ticket)
        self._admitted_sizes.observe(ticket.load_tokens)

    def forget(self, ticket: AdmissionTicket) -> None:
        """A ticket released: no longer counted, or, when the worker's report surely counts it
        already, its freed tokens credited against that report (see "Released requests")."""
        pending = self._pending.get(ticket.worker_id)
        if pending and ticket in pending:
            pending.remove(ticket)
            if not pending:
                del self._pending[ticket.worker_id]
        elif _numbered(ticket, self._dispatches.get(ticket.worker_id)):
            held = self._held.get(ticket.worker_id)
            if held and ticket in held:  # the worker's report holds it: what it frees is credited
                held.discard(ticket)
                freed = ticket.freed_on_release() if ticket.freed_on_release is not None else ticket.cost_tokens
                self._released[ticket.worker_id].append((self._clock(), ticket, freed))
        elif ticket.worker_id in self._stats:  # forgotten: the worker's report surely counts it
            freed = ticket.freed_on_release() if ticket.freed_on_release is not None else ticket.cost_tokens
            self._released[ticket.worker_id].append((self._clock(), ticket, freed))

    # ---- queries --------------------------------------------------------------------------

    def healthy(self) -> list[WorkerStats]:
        return [w for w in self._stats.values() if w.healthy]

    def in_flight_tokens(self) -> dict[str, int]:
        """Tokens admitted per worker since its stats were taken (add them to its load)."""
        return {w: sum(t.load_tokens for t in ts) for w, ts in self._pending.items()}

    def mean_admitted_tokens(self) -> float:
        """Mean cost of the recent tickets (0.0 before any): what one admitted request adds to
        its worker's load, cache hits at their uncached cost. The imbalance margin's unit."""
        return self._admitted_sizes.mean_tokens()

    def committed(self, worker_id: str, as_reported: bool = False, shared_classes: bool = False) -> int:
        """Reserved per the worker's stats plus this router's admissions since. `as_reported`:
        only those sent after the stats were requested (the ones before may be in them already:
        a lower bound, used only to tell a refusal from a double count, never to admit).
        `shared_classes`: only what the classes sharing the rest of a kept KV share hold."""
        tickets = self._pending.get(worker_id, ())
        if as_reported:
            reported_at = self._reported_at.get(worker_id, -math.inf)
            tickets = [t for t in tickets if t.sent_at >= reported_at]
        stats = self._stats[worker_id]
        released = self._released.get(worker_id, ())
        if shared_classes:
            return (max(0, stats.kv_tokens_reserved_shared - sum(credit for _, t, credit in released if t.shared_class))
                    + sum(t.cost_tokens for t in tickets if t.shared_class))
        return max(0, stats.kv_tokens_reserved - sum(credit for _, _, credit in released)) + sum(t.cost_tokens for t in tickets)

    def kept_for_other_replicas(self, worker: WorkerStats) -> float:
        """The part of the room the worker's report leaves that the other replicas sending it
        requests may fill before its next report: k / (k + 1) of it with k of them."""
        others = self._replicas_sharing.get(worker.worker_id, 0)
        if others <= 0:
            return 0.0
        room = max(0, worker.kv_tokens_capacity - worker.kv_tokens_reserved)
        return room * others / (others + 1)

    def in_shared_class(self, priority_class: int) -> bool:
        return priority_class >= self._reserved_below_class

    def fits(self, worker: WorkerStats, cost_tokens: float, priority_class: int, as_reported: bool = False) -> bool:
        """See the module docstring. A request of the sharing classes only while everything
        committed stays within (1 - f) of the capacity (all of it with no kept share), so f
        of it is free for the next important arrival. A more important one within the
        capacity, less what the sharing classes hold when the workers preempt their
        reservations, else less what this router counts for them beyond their limit (the
        worker never lets them past it, so those are tickets its stats already hold)."""
        capacity = worker.kv_tokens_capacity
        committed = self.committed(worker.worker_id, as_reported)
        committed += self.kept_for_other_replicas(worker)  # this replica's room is its share
        shared_limit = self._shared_class_fraction * capacity
        if self.in_shared_class(priority_class):
            return committed + cost_tokens <= shared_limit
        if self._workers_preempt_kv_reservations:
            preemptible = self.committed(worker.worker_id, as_reported, shared_classes=True)
        elif self._shared_class_fraction < 1.0:
            preemptible = max(0.0, self.committed(worker.worker_id, as_reported, shared_classes=True) - shared_limit)
        else:
            preemptible = 0
        return committed - preemptible + cost_tokens <= capacity

    def eligible(self, cost_tokens: int, cost_for: CostFn | None, priority_class: int,
                  as_reported: bool = False) -> tuple[list[WorkerStats], dict[str, int]]:
        """The healthy workers the request fits on (within its class's share), and its cost on each."""
        costs = {w.worker_id: cost_for(w.worker_id) if cost_for else cost_tokens for w in self.healthy()}
        eligible = [w for w in self.healthy() if w.worker_id not in self._refused_at
                    and self.fits(w, costs[w.worker_id], priority_class, as_reported)]
        return eligible, costs

    def num_pending(self, worker_id: str) -> int:
        """Tickets counted on top of the worker's report (tests, and the double count's check)."""
        return len(self._pending.get(worker_id, ()))

    def with_most_room(self, eligible: list[WorkerStats]) -> str:
        """The worker whose capacity less what it has committed is largest (no routing policy)."""
        return max(eligible, key=lambda w: w.kv_tokens_capacity - self.committed(w.worker_id)).worker_id
