"""When and how far to speculate: per-request draft lengths from measured acceptance, and
speculation only in steps where it pays, judged from live step times.

Each step, before `schedule()`, the speculator looks at the decode-ready requests and asks
the proposer for drafts. How many each gets is one throughput decision:

    without drafts   the step makes B tokens (one per decoding request) in t(T) seconds
    a j-th draft     for request i is accepted with probability a_i^j (a_i: its measured
                     per-draft acceptance), and costs t(T + 1) - t(T) more forward time plus
                     the proposer's seconds per draft
    choose           drafts in order of a_i^j, keeping the prefix that maximises
                     (B + sum a_i^j) / (t(T + K) + K x draft_s); none unless it beats
                     B / t(T) by `MIN_GAIN`

t(T) is the measured forward time of a step of T tokens (`StepCostCurve`, from the
engine's own steps). At batch 1 a CPU forward of 1 + k tokens costs barely more than one
token (the weights are read once either way), so drafts are cheap; at a large batch the step
is compute-bound, t(T + K) grows in proportion and the same rule switches speculation off:
the threshold is the measured curve, not a constant.

Per-request acceptance a_i starts at the method's running mean and follows the request's
own verifications (decayed counts, so a request that stopped matching is re-probed once its
history fades).
"""

from __future__ import annotations

import bisect
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvmesh.core.config import SpeculativeConfig
from kvmesh.worker.engine_loop.draft_proposers import DraftAsk, DraftProposer, NgramProposer
from kvmesh.worker.engine_loop.request import Request

MIN_GAIN = 1.03  # predicted tokens/s must beat plain decoding by 3% (noise margin)
ACCEPTANCE_DECAY = 0.8  # per-step decay of a request's acceptance counts
PRIOR_TRIALS = 1.0  # weight of the method's mean acceptance in a request's estimate


class StepCostCurve:
    """Measured forward seconds against tokens per step, in power-of-two buckets of T (each
    an exponential moving average of T and seconds); t(T) interpolates linearly between
    buckets and extends the nearest slope beyond them. With one bucket it assumes time in
    proportion to tokens (compute-bound: the pessimistic guess, so nothing speculates until
    a second step size has been measured; plain decode steps provide it)."""

    def __init__(self, smoothing: float = 0.2):
        self.smoothing = smoothing
        self._buckets: dict[int, tuple[float, float]] = {}  # log2 bucket -> (mean tokens, mean seconds)
        self._points: list[tuple[float, float]] = []  # the buckets sorted by tokens
        self._tokens: list[float] = []

    def observe(self, num_tokens: int, seconds: float) -> None:
        if num_tokens <= 0 or seconds <= 0:
            return
        key = int(math.log2(num_tokens))
        old = self._buckets.get(key)
        a = self.smoothing
        self._buckets[key] = (num_tokens, seconds) if old is None else \
            ((1 - a) * old[0] + a * num_tokens, (1 - a) * old[1] + a * seconds)
        self._points = sorted(self._buckets.values())
        self._tokens = [t for t, _ in self._points]

    @property
    def known(self) -> bool:
        return bool(self._buckets)

    def seconds(self, num_tokens: float) -> float:
        points = self._points
        if not points:
            return 0.0
        if len(points) == 1:
            return points[0][1] * num_tokens / points[0][0]
        # The segment around num_tokens, or the nearest end segment (extrapolated).
        j = bisect.bisect_left(self._tokens, num_tokens) - 1
        (t0, s0), (t1, s1) = points[min(max(j, 0), len(points) - 2):][:2]
        slope = max(0.0, (s1 - s0) / (t1 - t0)) if t1 > t0 else 0.0
        return max(1e-9, s0 + slope * (num_tokens - t0))


@dataclass
class _Acceptance:
    accepted: float = 0.0
    trials: float = 0.0

    def estimate(self, prior: float) -> float:
        return (self.accepted + PRIOR_TRIALS * prior) / (self.trials + PRIOR_TRIALS)


@dataclass
class SpeculationCounters:
    """Totals since start, for one method (the metrics and stats read these)."""

    num_steps: int = 0  # steps that verified drafts
    num_verified: int = 0  # request-steps that verified drafts
    num_draft_tokens: int = 0  # drafts scheduled and scored
    num_accepted_tokens: int = 0  # of those, kept
    draft_s: float = 0.0  # time spent proposing

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_per_step(self) -> float:
        """Accepted drafts per speculating request per step (the tokens gained per forward)."""
        return self.num_accepted_tokens / self.num_verified if self.num_verified else 0.0


@dataclass
class Speculator:
    config: SpeculativeConfig
    proposer: DraftProposer
    max_model_len: int
    max_num_batched_tokens: int
    cost: StepCostCurve = field(default_factory=StepCostCurve)
    counters: SpeculationCounters = field(default_factory=SpeculationCounters)
    _acceptance: dict[str, _Acceptance] = field(default_factory=dict)
    # Method-wide running mean, the prior for new requests. It starts optimistic so a method
    # gets tried at all (a pessimistic start never speculates, so never learns otherwise).
    _mean_acceptance: float = 0.8
    _draft_s_per_token: float | None = None  # proposer seconds per token it reads; None = not measured
    clock: Callable[[], float] = time.perf_counter  # the engine's forward clock (same unit as the curve)
    # Requests the engine keeps from speculating (structured output; it counts the reason).
    skip: Callable[[Request], bool] = lambda request: False

    @property
    def method(self) -> str:
        return self.proposer.method

    # ---- before schedule() -------------------------------------------------------------

    def propose(self, running: Sequence[Request]) -> None:
        """Set spec_token_ids on the decode-ready requests worth speculating for this step."""
        decoding = [r for r in running if r.num_tokens_to_compute == 1]
        candidates = [r for r in decoding if self._eligible(r)]
        if not candidates:
            return
        base_tokens = sum(min(r.num_tokens_to_compute, self.max_num_batched_tokens) for r in running)
        base_tokens = min(base_tokens, self.max_num_batched_tokens)
        lengths = self._draft_lengths(candidates, len(decoding), base_tokens)
        asks = [DraftAsk(r, lengths[r.request_id]) for r in candidates if lengths.get(r.request_id)]
        if not asks:
            return
        num_drafts = sum(a.num_tokens for a in asks)
        catch_up = sum(self.proposer.catch_up_forwards(a.request) for a in asks)
        started = self.clock()
        drafts = self.proposer.propose(asks)
        elapsed = self.clock() - started
        self.counters.draft_s += elapsed
        # Learn the cost per draft from steady-state proposals only: a catch-up read (a
        # self-draft reading a whole prompt through int8 kernels whose cost grows with the
        # rows) would price every later draft as if it re-read the prompt.
        if catch_up <= 0.25 * num_drafts:
            a = 1.0 if self._draft_s_per_token is None else 0.2
            self._draft_s_per_token = (1 - a) * (self._draft_s_per_token or 0.0) + a * elapsed / num_drafts
        for ask in asks:
            ask.request.spec_token_ids = list(drafts.get(ask.request.request_id, ()))[:ask.num_tokens]

    def _eligible(self, request: Request) -> bool:
        return request.sampling.speculative and self._room(request) > 0 and not self.skip(request)

    def _room(self, request: Request) -> int:
        """Drafts that stay inside max_tokens (one output token always follows them) and the
        context: never a KV slot or a position the request could not have reached."""
        left_output = request.sampling.max_tokens - request.num_output_tokens - 1
        left_context = self.max_model_len - request.num_tokens - 1
        return max(0, min(self.config.num_tokens, left_output, left_context))

    def _draft_lengths(self, candidates: Sequence[Request], num_decoding: int, base_tokens: int) -> dict[str, int]:
        threshold = self.config.load_threshold_tokens
        if threshold is not None and num_decoding > threshold:
            return {}
        budget = self.max_num_batched_tokens - base_tokens
        options = []  # (probability the draft is kept, tokens the proposer reads for it, request id)
        for r in candidates:
            alpha = self._acceptance.setdefault(r.request_id, _Acceptance()).estimate(self._mean_acceptance)
            # A first draft also pays for catching the proposer up, amortised over the
            # request's remaining output (the investment serves every later step too).
            catch_up = self.proposer.catch_up_forwards(r) / max(1, r.sampling.max_tokens - r.num_output_tokens)
            options += [(alpha ** j, 1.0 + (catch_up if j == 1 else 0.0), r.request_id)
                        for j in range(1, self._room(r) + 1)]
        options.sort(key=lambda o: -o[0])
        options = options[:max(0, budget)]
        if threshold is not None:
            chosen = len(options)  # a fixed threshold: below it, speculate fully
        elif not self.cost.known:
            chosen = 0  # nothing measured yet
        else:
            chosen = self._best_prefix(options, num_decoding, base_tokens)
        lengths: dict[str, int] = {}
        for _, _, rid in options[:chosen]:
            lengths[rid] = lengths.get(rid, 0) + 1
        return lengths

    def _best_prefix(self, options, num_decoding: int, base_tokens: int) -> int:
        """How many of the sorted draft options maximise predicted tokens per second."""
        plain_rate = num_decoding / self.cost.seconds(base_tokens)
        best_rate, best_k = plain_rate * MIN_GAIN, 0
        draft_s = self._draft_s_per_token
        if draft_s is None:  # not measured in a step yet: the proposer's own start-up figure
            draft_s = self.proposer.prior_s_per_token
        gain = fed = 0.0
        for k, (p_kept, tokens, _) in enumerate(options, start=1):
            gain += p_kept
            fed += tokens
            rate = (num_decoding + gain) / (self.cost.seconds(base_tokens + k) + fed * draft_s)
            if rate > best_rate:
                best_rate, best_k = rate, k
        return best_k

    # ---- after the forward ---------------------------------------------------------------

    def observe_step(self, num_tokens: int, forward_s: float, scheduled, accepted_drafts: dict) -> None:
        """A finished step: its cost (T tokens in forward_s) and each speculating request's
        verification (how many of its scheduled drafts were kept)."""
        self.cost.observe(num_tokens, forward_s)
        for stats in self._acceptance.values():
            stats.accepted *= ACCEPTANCE_DECAY
            stats.trials *= ACCEPTANCE_DECAY
        verified = [e for e in scheduled if e.spec_token_ids]
        if not verified:
            return
        c = self.counters
        c.num_steps += 1
        for entry in verified:
            kept = len(accepted_drafts.get(entry.request_id, ()))
            proposed = len(entry.spec_token_ids)
            c.num_verified += 1
            c.num_draft_tokens += proposed
            c.num_accepted_tokens += kept
            # Drafts are kept as a prefix: kept successes, then one failure unless all were kept.
            stats = self._acceptance.setdefault(entry.request_id, _Acceptance())
            trials = kept + (1 if kept < proposed else 0)
            stats.accepted += kept
            stats.trials += trials
            self._mean_acceptance = 0.95 * self._mean_acceptance + 0.05 * (kept / trials)

    def forget(self, request_id: str) -> None:
        self._acceptance.pop(request_id, None)
        self.proposer.forget(request_id)


def build_speculator(config, parts) -> Speculator | None:
    """The speculator `config.speculative` asks for (None = off). parts: the engine's
    EngineParts (the self-draft proposer quantizes the same weights)."""
    spec = config.speculative
    if spec.method == "none":
        return None
    if spec.method == "ngram":
        proposer: DraftProposer = NgramProposer(spec.ngram_min_tokens, spec.ngram_max_tokens)
    else:
        # Only a self-draft engine pays for loading the quantized copy's module.
        from kvmesh.worker.engine_loop.self_draft import SelfDraftProposer
        proposer = SelfDraftProposer.from_config(config, parts)
    return Speculator(spec, proposer, parts.max_model_len, config.scheduler.max_num_batched_tokens)
