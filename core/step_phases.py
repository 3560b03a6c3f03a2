"""Per-phase timing of one engine step, and what the step ran, handed to observers.

The engine and the model runner mark phase boundaries on one `StepPhaseClock`; at the end of
a step that ran something the clock builds a `StepReport` and gives it to every observer
(the worker's Prometheus metrics, the per-request step log for traces). No observer, no
report is built: the engine pays five perf_counter() calls per step.

    clock = StepPhaseClock()
    clock.observers.append(lambda report: print(report.phase_s))
    clock.begin()
    sched_out = scheduler.schedule();  clock.lap("schedule")
    inputs = StepInputs.build(...);    clock.lap("prepare")      # in the runner
    logits = forward(inputs);          clock.lap("forward")      # in the runner
    tokens = sample(logits);           clock.lap("sample")       # in the runner
    detokenize, stop checks, finish;   clock.lap("output")
    clock.end(sched_out)               # or clock.end(sched_out, failure=exc)

Phases are wall-clock seconds. On CUDA the forward phase ends when the logits reach the
host, so it holds the GPU time of the step. Observers run on the engine's step thread and
must be quick and thread-safe; an observer that raises is logged, never fails the step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

logger = logging.getLogger(__name__)

PHASES = ("schedule", "prepare", "forward", "sample", "output")


@dataclass(frozen=True)
class StepRow:
    """One request's share of a step."""

    request_id: str  # the engine's internal id (`<external>` or `<external>#k/i` for n > 1)
    tenant_id: str
    num_tokens: int
    is_prefill: bool  # prompt (or recomputed) tokens, not the one decode token
    num_draft_tokens: int = 0  # speculative decoding: drafts scored in this row (in num_tokens)
    num_accepted_tokens: int = 0  # of those, kept
    adapter: str = ""  # the LoRA adapter the row runs with; "" = the base model


@dataclass(frozen=True)
class StepReport:
    started_at: float  # time.time() at the step's start
    phase_s: dict[str, float]  # phase -> seconds (phases the step did not reach are absent)
    rows: tuple[StepRow, ...]
    token_budget: int  # max_num_batched_tokens of the step
    failure: BaseException | None = None  # the forward raised: every row of the step failed
    speculative_method: str = ""  # the engine's proposer (ngram, self_draft) when speculation is on

    @property
    def total_s(self) -> float:
        return sum(self.phase_s.values())

    @property
    def prefill_tokens(self) -> int:
        return sum(r.num_tokens for r in self.rows if r.is_prefill)

    @property
    def decode_tokens(self) -> int:
        return sum(r.num_tokens for r in self.rows if not r.is_prefill)

    @property
    def lora_rows(self) -> int:
        """Token rows of the step that carry a LoRA adapter."""
        return sum(r.num_tokens for r in self.rows if r.adapter)

    @property
    def token_fill_ratio(self) -> float:
        """Tokens in the step / the step's token budget (0..1)."""
        return (self.prefill_tokens + self.decode_tokens) / self.token_budget if self.token_budget else 0.0


def _adapter_name(request) -> str:
    adapter = getattr(request, "adapter", None)  # AdapterRef; draft rows have none
    return adapter.name if adapter is not None else ""


def is_out_of_memory(exc: BaseException | None) -> bool:
    """torch.OutOfMemoryError (CUDA) or a host MemoryError, without importing torch here."""
    return exc is not None and (isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError")


class StepPhaseClock:
    def __init__(self) -> None:
        self.observers: list[Callable[[StepReport], None]] = []
        self._started_at = 0.0
        self._mark = 0.0
        self._laps: dict[str, float] = {}
        self.speculative_method = ""  # set by an engine that speculates (metric label)

    def begin(self) -> None:
        self._started_at = time.time()
        self._mark = time.perf_counter()
        self._laps = {}

    def lap(self, phase: str) -> None:
        """The time since the previous mark belongs to `phase`."""
        now = time.perf_counter()
        self._laps[phase] = self._laps.get(phase, 0.0) + now - self._mark
        self._mark = now

    def end(self, sched_out, failure: BaseException | None = None,
            accepted_drafts: dict[str, tuple[int, ...]] | None = None) -> None:
        """Report a step that ran `sched_out` (a SchedulerOutput); idle steps are not reported.
        accepted_drafts: request id -> drafts the target kept (speculating requests)."""
        if not self.observers:
            return
        accepted_drafts = accepted_drafts or {}
        rows = tuple(StepRow(e.request_id, e.request.tenant_id, e.num_scheduled_tokens,
                             e.num_scheduled_tokens - len(e.spec_token_ids) > 1
                             or e.num_computed_tokens < e.request.num_prompt_tokens,
                             len(e.spec_token_ids), len(accepted_drafts.get(e.request_id, ())),
                             _adapter_name(e.request))
                     for e in sched_out.scheduled)
        report = StepReport(self._started_at, dict(self._laps), rows, sched_out.token_budget, failure,
                            self.speculative_method)
        for observer in self.observers:
            try:
                observer(report)
            except Exception:  # telemetry must never fail a step
                logger.exception("step observer %r failed", observer)
