"""The engine-internal, mutable state of one request.

There is no prefill phase and no decode phase as separate code paths (vLLM v1's rule):

    all_token_ids       = prompt_token_ids + output_token_ids
    num_computed_tokens = tokens whose KV is in the cache; each step it catches up with
                          num_tokens by num_scheduled_tokens. A fresh request starts at 0
                          (or at its prefix-cache hit), a recomputed one restarts at 0 with
                          its earlier outputs treated as prompt, a decode step schedules 1.

The status only reports where a request is; the scheduler never branches on "is this a
prefill": it looks at num_tokens - num_computed_tokens.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from kvmesh.core.seams import AdapterRef, SamplingParams


class RequestStatus(enum.IntEnum):
    QUEUED = 0  # waiting: new, preempted (recompute) or swapped out
    PREFILLING = 1  # running, more than one known token still to compute
    DECODING = 2  # running, one token per step
    # Finished states last, so `is_finished` is one comparison.
    FINISHED = 3  # stop condition or max_tokens
    CANCELLED = 4  # aborted by the client or the router
    REJECTED = 5  # never served (queue timeout)
    FAILED = 6  # the forward or the engine failed

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED


@dataclass(eq=False)  # identity semantics: a request is a live object, not a value
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    arrival_time: float  # scheduler clock (monotonic seconds), not wall time
    priority: int = 0  # lower value = more important
    priority_class: int | None = None  # what priority preemption compares; None = priority
    tenant_id: str = "default"  # whose compute the request's rows are (per-tenant cost metrics)
    # kv.hashing.block_extra_keys(model, revision, kv dtype, tenant salt), built by the engine.
    extra_keys: tuple[str, ...] = ()
    # The LoRA adapter it runs with (None = base model) and, while it is admitted, the worker
    # slot holding that adapter (pinned until the request ends; worker/engine_loop/adapter_gate.py).
    adapter: AdapterRef | None = None
    lora_slot: int | None = None
    # n > 1: the engine submits n children with one group_id and sample_index 0..n-1.
    group_id: str | None = None
    sample_index: int = 0

    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.QUEUED
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    block_ids: list[int] = field(default_factory=list)  # the block table (device blocks)
    block_hashes: list[bytes] = field(default_factory=list)  # chain hashes of full blocks of all_token_ids
    num_preemptions: int = 0
    num_priority_preemptions: int = 0  # of those, for a more important waiting request
    is_swapped: bool = False  # its KV sits in CPU swap space (owned by the KV manager)
    reserved_kv_tokens: int = 0  # admission reservation: kv_cost.request_kv_tokens less its pinned prefix
    reserved_output_tokens: int = 0  # the output that reservation covers (max_tokens, or an estimate)
    # Its reservation, taken by a more important request (priority preemption of KV
    # reservations): reserved again before it resumes; 0 while it holds reserved_kv_tokens.
    owed_kv_tokens: int = 0
    outgrew_estimate: bool = False  # produced more output than first reserved for it
    num_pinned_tokens: int = 0  # resident prefix held for it from admission (kv_cache_manager.pin_prefix)
    num_reserved_cached_tokens: int = 0  # prompt tokens its reservation left out (pinned + shared with others)

    # Timings on the scheduler clock; the engine maps them to api.RequestTimings.
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    peak_kv_tokens: int = 0

    # Speculative decoding: drafts proposed for the next step (the engine's speculator sets
    # them before `schedule()`, which schedules them after the last known token when the
    # request decodes and budget and blocks allow; they never join all_token_ids unverified).
    spec_token_ids: list[int] = field(default_factory=list)

    _all_token_ids: list[int] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        self.prompt_token_ids = list(self.prompt_token_ids)
        # Its own list: n > 1 siblings built from one resumed-output list must not share it.
        self.output_token_ids = list(self.output_token_ids)
        self._all_token_ids = self.prompt_token_ids + list(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt then output tokens. Read-only by convention: grow it via append_output_token."""
        return self._all_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def importance_class(self) -> int:
        """Lower = more important; only a strictly lower class may preempt this request."""
        return self.priority if self.priority_class is None else self.priority_class

    @property
    def num_tokens_to_compute(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self._all_token_ids.append(token_id)

    def truncate_output(self, num_output_tokens: int) -> None:
        """Drop output past `num_output_tokens`: a stop condition met partway through tokens
        accepted in one step (speculative decoding). The request finishes right after, so
        the KV of the dropped tokens is freed with it."""
        drop = self.num_output_tokens - num_output_tokens
        if drop > 0:
            del self.output_token_ids[num_output_tokens:]
            del self._all_token_ids[len(self._all_token_ids) - drop:]
            self.num_computed_tokens = min(self.num_computed_tokens, self.num_tokens)
