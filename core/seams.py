"""Plain dataclasses at the engine's and the worker actor's seams.

These are what the router, the load generator and the CLI see of a worker: no torch, no
protobuf. `SamplingParams.validate` is the single place where per-request parameters are
checked; it raises `InvalidRequestError` with a message a user can act on.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvmesh.core import errors
from kvmesh.core.errors import InvalidRequestError


STRUCTURED_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
MAX_STRUCTURED_SPEC_CHARS = 64 * 1024  # a schema, regex or grammar; larger ones are refused
MAX_CHOICES = 256
MAX_CHOICE_CHARS = 1024


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on what a request may generate (docs/api.md, "Structured output").

    kind          spec                                       choices
    json_schema   the JSON Schema, as JSON text               -
    json_object   "" (any JSON object)                       -
    regex         the pattern (Rust regex syntax, anchored)   -
    choice        ""                                          the allowed outputs, exactly
    grammar       a Lark grammar, or GBNF (llama.cpp)         -

    The engine masks every token the constraint forbids (worker/engine_loop/structured_output.py);
    EOS is allowed only where the constraint is complete."""

    kind: str
    spec: str = ""
    choices: tuple[str, ...] = ()

    def problem(self) -> str | None:
        """The first shape rule this breaks (size, kind, JSON text), or None. Whether the
        schema, regex or grammar compiles is checked by the grammar engine
        (worker/model/grammar.py), at the router before anything is reserved."""
        if self.kind not in STRUCTURED_KINDS:
            return f"structured output kind must be one of {', '.join(STRUCTURED_KINDS)}, got {self.kind!r}"
        if not isinstance(self.spec, str) or len(self.spec) > MAX_STRUCTURED_SPEC_CHARS:
            return f"a structured output {self.kind} must be a string of at most {MAX_STRUCTURED_SPEC_CHARS} characters"
        if self.kind in ("json_schema", "regex", "grammar") and not self.spec.strip():
            return f"structured output {self.kind} must not be empty"
        if self.kind == "choice":
            if not 1 <= len(self.choices) <= MAX_CHOICES:
                return f"structured output choice needs 1 to {MAX_CHOICES} choices, got {len(self.choices)}"
            if any(not isinstance(c, str) or not 0 < len(c) <= MAX_CHOICE_CHARS for c in self.choices):
                return f"each choice must be a non-empty string of at most {MAX_CHOICE_CHARS} characters"
        elif self.choices:
            return f"choices are only for structured output kind 'choice', not {self.kind!r}"
        return None


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_k: int = -1  # -1 = off
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None  # per-request generator: same seed, same output, alone or batched
    repetition_penalty: float = 1.0  # >1 discourages tokens already in prompt or output
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: tuple[str, ...] = ()  # stop strings, matched across token boundaries, not emitted
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False  # benchmarks: generate exactly max_tokens
    min_tokens: int = 0  # EOS and stop strings are ignored before this many tokens
    logprobs: bool = False  # return the chosen token's logprob
    n: int = 1  # parallel samples of one prompt (share the prompt's KV blocks)
    # False = never speculate for this request (the worker's speculative decoding, when on,
    # keeps outputs unchanged in distribution; this opts out of it, e.g. for timing studies).
    speculative: bool = True
    # None = free text; else the output must match it (json schema, regex, choice, grammar).
    structured: StructuredOutput | None = None

    def validate(self, max_new_tokens: int | None = None, max_n: int | None = None) -> None:
        """Raise InvalidRequestError for the first rule in SAMPLING_RULES this breaks.
        `max_new_tokens` / `max_n` are the server's ceilings (scheduler config)."""
        for rule in SAMPLING_RULES:
            problem = rule.check(self, max_new_tokens, max_n)
            if problem:
                raise InvalidRequestError(problem)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


# ---- sampling rules: one function per rule; gRPC and HTTP both reach them through
# SamplingParams.validate (router) and again in the engine. docs/api.md lists them.

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 64


def _finite_float(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _count_within(name: str, value, ceiling: int | None, unit: str = "") -> str | None:
    """An integer >= 1 and at most the server's ceiling (None = no ceiling)."""
    if not _int(value) or value < 1:
        return f"{name} must be an integer >= 1, got {value!r}"
    if ceiling is not None and value > ceiling:
        return f"{name} = {value} exceeds this server's limit of {ceiling}{unit}"
    return None


def _rule_max_tokens(p: "SamplingParams", max_new_tokens: int | None, max_n: int | None) -> str | None:
    return _count_within("max_tokens", p.max_tokens, max_new_tokens)


def _rule_temperature(p: "SamplingParams", *_) -> str | None:
    if not _finite_float(p.temperature) or p.temperature < 0:
        return f"temperature must be a finite number >= 0, got {p.temperature!r}"
    return None


def _rule_top_p(p: "SamplingParams", *_) -> str | None:
    if not _finite_float(p.top_p) or not 0.0 < p.top_p <= 1.0:
        return f"top_p must be in (0, 1], got {p.top_p!r}"
    return None


def _rule_top_k(p: "SamplingParams", *_) -> str | None:
    if not _int(p.top_k) or p.top_k < -1 or p.top_k == 0:
        return f"top_k must be -1 (off) or >= 1, got {p.top_k!r}"
    return None


def _rule_min_p(p: "SamplingParams", *_) -> str | None:
    if not _finite_float(p.min_p) or not 0.0 <= p.min_p <= 1.0:
        return f"min_p must be in [0, 1], got {p.min_p!r}"
    return None


def _rule_repetition_penalty(p: "SamplingParams", *_) -> str | None:
    if not _finite_float(p.repetition_penalty) or p.repetition_penalty <= 0:
        return f"repetition_penalty must be a finite number > 0, got {p.repetition_penalty!r}"
    return None


def _rule_presence_penalty(p: "SamplingParams", *_) -> str | None:
    if not _finite_float(p.presence_penalty) or not -2.0 <= p.presence_penalty <= 2.0:
        return f"presence_penalty must be in [-2, 2], got {p.presence_penalty!r}"
    return None


def _rule_frequency_penalty(p: "SamplingParams", *_) -> str | None:
    if not _finite_float(p.frequency_penalty) or not -2.0 <= p.frequency_penalty <= 2.0:
        return f"frequency_penalty must be in [-2, 2], got {p.frequency_penalty!r}"
    return None


def _rule_min_tokens(p: "SamplingParams", *_) -> str | None:
    if not _int(p.min_tokens) or p.min_tokens < 0 or p.min_tokens > p.max_tokens:
        return f"min_tokens must be in [0, max_tokens], got {p.min_tokens!r}"
    return None


def _rule_n(p: "SamplingParams", max_new_tokens: int | None, max_n: int | None) -> str | None:
    return _count_within("n", p.n, max_n, " samples per request")


def _rule_seed(p: "SamplingParams", *_) -> str | None:
    if p.seed is not None and (not _int(p.seed) or not -(2 ** 63) <= p.seed < 2 ** 63):
        return f"seed must be a 64-bit integer, got {p.seed!r}"
    return None


def _rule_stop(p: "SamplingParams", *_) -> str | None:
    if len(p.stop) > MAX_STOP_STRINGS:
        return f"at most {MAX_STOP_STRINGS} stop strings, got {len(p.stop)}"
    if any(not isinstance(s, str) or not 0 < len(s) <= MAX_STOP_STRING_CHARS for s in p.stop):
        return f"stop strings must be non-empty strings of at most {MAX_STOP_STRING_CHARS} characters"
    return None


def _rule_stop_token_ids(p: "SamplingParams", *_) -> str | None:
    if len(p.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        return f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids, got {len(p.stop_token_ids)}"
    if any(not _int(t) or t < 0 for t in p.stop_token_ids):
        return "stop_token_ids must be integers >= 0"
    return None


def _rule_structured(p: "SamplingParams", *_) -> str | None:
    if p.structured is None:
        return None
    if not isinstance(p.structured, StructuredOutput):
        return f"structured must be a StructuredOutput, got {type(p.structured).__name__}"
    return p.structured.problem()


@dataclass(frozen=True)
class SamplingRule:
    """One documented check of SamplingParams; `check` returns the problem or None."""

    name: str
    check: Callable[["SamplingParams", int | None, int | None], str | None]


SAMPLING_RULES: tuple[SamplingRule, ...] = (
    SamplingRule("max_tokens", _rule_max_tokens),
    SamplingRule("temperature", _rule_temperature),
    SamplingRule("top_p", _rule_top_p),
    SamplingRule("top_k", _rule_top_k),
    SamplingRule("min_p", _rule_min_p),
    SamplingRule("repetition_penalty", _rule_repetition_penalty),
    SamplingRule("presence_penalty", _rule_presence_penalty),
    SamplingRule("frequency_penalty", _rule_frequency_penalty),
    SamplingRule("min_tokens", _rule_min_tokens),
    SamplingRule("n", _rule_n),
    SamplingRule("seed", _rule_seed),
    SamplingRule("stop", _rule_stop),
    SamplingRule("stop_token_ids", _rule_stop_token_ids),
    SamplingRule("structured", _rule_structured),
)
def check_fits_context(prompt_tokens: int, max_tokens: int, max_model_len: int) -> None:
    """The one rule "prompt + max_tokens <= max_model_len": a request that cannot fit the model's
    context is refused whole (InvalidRequestError), never truncated."""
    if prompt_tokens >= max_model_len:
        raise InvalidRequestError(
            f"the prompt has {prompt_tokens} tokens; this model accepts at most {max_model_len - 1} "
            f"(max_model_len {max_model_len} includes at least one generated token)")
    if prompt_tokens + max_tokens > max_model_len:
        raise InvalidRequestError(
            f"prompt ({prompt_tokens} tokens) + max_tokens ({max_tokens}) exceeds max_model_len {max_model_len}, "
            f"the model's context length; nothing was truncated")


@dataclass(frozen=True)
class AdapterRef:
    """A LoRA adapter as a worker loads it: its registered name and the PEFT folder every
    worker can read (adapter_config.json + adapter_model.safetensors). The router resolves a
    requested name to this from its registry (router/adapters.py)."""

    name: str
    path: str


@dataclass(frozen=True)
class RequestBudget:
    """What one request may consume, computed once where it enters (the router's validate
    stage, router/stages/validate.py; Engine.validate for a request handed to an engine
    directly) and carried with it. Later layers read these figures; the worker checks the
    carried budget against the request it serves (kv/kv_cost.check_budget) and refuses a
    mismatch with RequestBudgetMismatchError instead of deriving its own.

        prompt_tokens   the prompt as tokenized where the request entered
        max_tokens      per sample, as admitted (a degradation cap lowers it, with a new budget)
        n               samples
        block_size      K: the workers' block size the KV figure is rounded to
        kv_tokens       n x K x ceil((prompt + max_tokens) / K): the most KV it reserves
        output_tokens   max_tokens x n: the output the tenant's quota reserves
    """

    prompt_tokens: int
    max_tokens: int
    n: int
    block_size: int
    kv_tokens: int

    @property
    def output_tokens(self) -> int:
        return self.max_tokens * self.n


@dataclass(frozen=True)
class GenerateRequest:
    """One generation request as a worker receives it.

    Exactly one of `prompt` (text) and `prompt_token_ids` is set; `chat` messages are
    rendered to `prompt` by the caller (router or CLI) with the model's chat template.
    """

    request_id: str
    prompt: str | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    priority: int = 0  # lower value = more important; ties by arrival
    # The class priority preemption compares (lower = more important); None = `priority`.
    # The router sets it: its `priority` also carries the tenant's fair rank (fairness.py),
    # which orders the queue but must not let one tenant preempt another of the same class.
    priority_class: int | None = None
    tenant_id: str = "default"
    cache_salt: str | None = None  # tenant cache isolation: part of the block hash extra keys
    deadline_s: float | None = None  # absolute time.time() deadline
    attempt: int = 1  # 1 = first attempt; >1 = client retry
    trace_context: dict[str, str] = field(default_factory=dict)  # W3C traceparent carrier
    # Failover (router/stages/stream.py): the request's output streamed so far by a worker that
    # died. The engine continues it as a request preempted by recompute would be (prompt +
    # these tokens computed again, or found in its caches) and streams only what follows:
    # the text after the first `resume_text_chars` characters, the tokens after these.
    resume_token_ids: tuple[int, ...] = ()
    resume_text_chars: int = 0
    # Transfer hint (router/stages/admit_route.py): the Ray actor name of a worker holding more of
    # this prompt's prefix than the chosen one. The chosen worker may pull those blocks into
    # its host tier first, when its cost model says that beats recomputing them.
    kv_source: str | None = None
    # The LoRA adapter this request runs with (None = the base model). Part of the block hash
    # extra keys: two adapters never share KV.
    adapter: AdapterRef | None = None
    # Computed once at the edge (router/stages/validate.py) and verified by the worker; None:
    # the engine is the edge (a request handed to it directly) and computes it itself.
    budget: RequestBudget | None = None
    # (router replica id, that replica's sequence number of its dispatches to this worker),
    # set by the router as it sends the request: the worker's poll says which of them its
    # figures hold (`DispatchReport`), so the router stops counting exactly those. None: not
    # sent by a router replica's channel (the engine's own callers, the simulator).
    dispatch: tuple[str, int] | None = None


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, stop token id or stop string
    LENGTH = "length"  # max_tokens reached
    ABORT = "abort"  # cancelled by the client or the router
    ERROR = "error"  # failed; see RequestDelta.error


@dataclass(frozen=True)
class Usage:
    """One sample's figures, on its final delta: with n > 1 each sample reports its own
    completion_tokens (and the request's prompt); `request_usage` adds them up for the
    request (what OpenAI's response `usage` and the tenant's quota count)."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens served from the prefix cache


def request_usage(sample_usages: Sequence[Usage]) -> Usage | None:
    """The whole request's usage from its samples' final usages: the prompt once, the
    completions summed. cached_tokens is the smallest sample's: the prompt's own cache hit,
    before later samples forked from the first one's prompt blocks."""
    if not sample_usages:
        return None
    return Usage(prompt_tokens=sample_usages[0].prompt_tokens,
                 completion_tokens=sum(u.completion_tokens for u in sample_usages),
                 cached_tokens=min(u.cached_tokens for u in sample_usages))


@dataclass(frozen=True)
class RequestTimings:
    """Per-request figures the articles ask for (seconds, absolute times from time.time())."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    peak_kv_tokens: int = 0

    @property
    def queue_time_s(self) -> float | None:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass(frozen=True)
class RequestDelta:
    """One streamed increment of a request's output.

    `text` is valid UTF-8 (bytes of a partial character are held back until complete);
    the last delta of a request has `finished=True`, a finish reason and usage.
    """

    request_id: str
    text: str = ""
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[float, ...] | None = None
    finished: bool = False
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    timings: RequestTimings | None = None
    error: str | None = None  # set with finish_reason=ERROR
    # With finish_reason=ERROR: which kvmesh.core.errors class the failure maps to
    # ("OverloadedError" for a queue timeout, "WorkerFailedError" for a failed forward, ...)
    # and, for retryable ones, when to retry.
    error_type: str | None = None
    retry_after_s: float | None = None
    sample_index: int = 0  # which of the n samples this delta belongs to
    # On a final delta: the router's degradation-ladder step that admitted the request
    # ("cap" | "fallback"; router/degradation.py), None = served as sent.
    degraded: str | None = None


@dataclass(frozen=True)
class WorkerStats:
    """Load and KV figures a worker reports for routing and admission."""

    worker_id: str
    healthy: bool
    block_size: int
    num_blocks_total: int
    num_blocks_used: int  # referenced by running requests
    num_blocks_cached: int  # unreferenced, holding reusable prefix KV (evictable)
    num_blocks_free: int
    kv_tokens_used: int  # tokens held by running requests
    kv_tokens_capacity: int  # max_total_kv_tokens (or the pool's token capacity)
    # committed KV: uncached prompt + output of running and waiting requests, shared prefix once
    kv_tokens_reserved: int
    num_running: int
    num_waiting: int
    queued_prompt_tokens: int  # prompt tokens waiting requests must still compute (cached prefix excluded)
    prefix_cache_hit_rate: float  # cached prompt tokens / prompt tokens, since start
    output_tokens_per_s: float  # recent decode throughput (drain rate), for retry-after
    num_preemptions_recompute: int = 0
    num_preemptions_swap: int = 0
    num_preemptions_priority: int = 0  # of those, made for a more important waiting request
    num_outgrown_estimates: int = 0  # admission_reserve=expected: requests that produced more than estimated
    prefix_event_seq: int = 0  # sequence number of the newest prefix-cache event
    # forward-pass tokens still to run for its running and waiting requests: prompt not yet
    # computed (cached prefix left out) + output still to come; the router's load signal
    tokens_to_compute: int = 0
    # Of kv_tokens_reserved, what requests of the classes sharing (1 - kv_reserved_fraction)
    # of the budget hold (scheduler.kv_reserved_below_class and less important; the whole
    # budget with no kept share): what a more important request may preempt.
    kv_tokens_reserved_shared: int = 0
    # of num_preemptions_priority, KV reservations taken (scheduler.priority_preempts_kv_reservations)
    num_preemptions_priority_kv: int = 0
    # LoRA (worker/runner/lora_slots.py): slots, the adapters in them (names), loads and
    # evictions since start, requests waiting for their adapter's load (also in num_waiting)
    lora_slots_total: int = 0
    resident_adapters: tuple[str, ...] = ()
    num_adapter_loads: int = 0
    num_adapter_evictions: int = 0
    num_waiting_for_adapter: int = 0
    # Hashes of the full prompt blocks the worker's live requests hold (pinned, in their block
    # tables, or about to be computed by one of them). A request whose cached prefix is among
    # them adds only its own blocks to kv_tokens_reserved; one reusing cached blocks outside
    # them adds those too, pinned and paid by nobody (worker/engine_loop/admission.py): the
    # router charges it the same (router/admission_budget.py, "Cached but not held"). At most
    # the live requests' prompt blocks, deduplicated.
    held_block_hashes: frozenset[bytes] = frozenset()


@dataclass(frozen=True)
class DispatchReport:
    """Which of one router replica's dispatches a worker's figures (its `WorkerStats` of the
    same poll, read at the same moment) hold. The replica numbers its dispatches to each
    worker 1, 2, ... in the order its channel sends them (`GenerateRequest.dispatch`).

    `seen_seq`: the highest sequence number the engine has taken in (queued, or refused);
    `live_seqs`: those of them still running or waiting there, i.e. counted in the figures.
    A dispatch numbered above `seen_seq` is not in the figures yet; one at or below it is in
    them exactly when it is live (one not live has ended: nothing of it is left to count)."""

    seen_seq: int = 0
    live_seqs: frozenset[int] = frozenset()


class PrefixEventKind(str, enum.Enum):
    STORED = "stored"  # blocks with these hashes became reusable on this worker
    EVICTED = "evicted"  # blocks with these hashes are gone
    CLEARED = "cleared"  # everything is gone (restart, cache reset)


@dataclass(frozen=True)
class PrefixEvent:
    seq: int
    kind: PrefixEventKind
    block_hashes: tuple[bytes, ...] = ()


@dataclass(frozen=True)
class PrefixEventBatch:
    """Events after a sequence number. `reset` means the caller missed events (the worker's
    ring buffer moved on, or the worker restarted) and must drop what it knows of this
    worker; `all_hashes` then carries the worker's current cached block hashes."""

    worker_id: str
    next_seq: int
    events: tuple[PrefixEvent, ...] = ()
    reset: bool = False
    all_hashes: tuple[bytes, ...] = ()


@dataclass(frozen=True)
class ErrorReport:
    """A kvmesh error as a value: what crosses Ray (as the fields of a final error delta, the
    one channel for errors from a worker) and is rebuilt into the typed error on the far side.
    Ray wraps raised exceptions and drops constructor arguments such as retry_after_s."""

    error_type: str  # class name in kvmesh.core.errors
    message: str
    retry_after_s: float | None = None

    @classmethod
    def from_exception(cls, exc: errors.KvmeshError) -> "ErrorReport":
        return cls(type(exc).__name__, exc.message, getattr(exc, "retry_after_s", None))

    @classmethod
    def from_delta(cls, delta: RequestDelta) -> "ErrorReport":
        return cls(delta.error_type or "WorkerFailedError", delta.error or "", delta.retry_after_s)

    def as_delta(self, request_id: str) -> RequestDelta:
        """The request's final delta carrying this error (finish_reason ERROR)."""
        return RequestDelta(request_id=request_id, finished=True, finish_reason=FinishReason.ERROR,
                            error=self.message, error_type=self.error_type, retry_after_s=self.retry_after_s)

    def to_exception(self) -> errors.KvmeshError:
        error_class = getattr(errors, self.error_type, None)
        if not (isinstance(error_class, type) and issubclass(error_class, errors.KvmeshError)):
            return errors.WorkerFailedError(f"{self.error_type}: {self.message}")
        if self.retry_after_s is not None:
            return error_class(self.message, self.retry_after_s)
        return error_class(self.message)


def merge_deltas(batch: list[RequestDelta]) -> list[RequestDelta]:
    """Consecutive deltas of one sample as one delta (text, token ids and logprobs joined, the
    later delta's other fields); an error delta stays apart and nothing joins a final one."""
    merged: list[RequestDelta] = []
    for delta in batch:
        last = merged[-1] if merged else None
        if (last is None or last.finished or last.sample_index != delta.sample_index or delta.error_type
                or (last.logprobs is None) != (delta.logprobs is None)):
            merged.append(delta)
            continue
        logprobs = None if delta.logprobs is None else last.logprobs + delta.logprobs
        merged[-1] = dataclasses.replace(delta, text=last.text + delta.text, token_ids=last.token_ids + delta.token_ids,
                                         logprobs=logprobs)
    return merged
