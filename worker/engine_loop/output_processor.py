"""From sampled tokens to streamed deltas: detokenization, stop conditions, timings.

One `RequestState` per live request holds what the scheduler does not: the detokenizer,
the per-request random generator, the caller's id and sample index, wall-clock timings.
Stop conditions, checked after each new token in this order:

    EOS (unless ignore_eos) or a stop token id   -> STOP  (only once min_tokens are out, or
                                                  when a complete structured output allows
                                                  nothing else)
    a stop string completed in the text          -> STOP  (the stop string is not emitted)
    max_tokens generated                          -> LENGTH
    the context reached max_model_len             -> LENGTH
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from kvmesh.core.seams import FinishReason, RequestDelta, RequestTimings, Usage
from kvmesh.worker.engine_loop.detokenizer import IncrementalDetokenizer
from kvmesh.worker.engine_loop.request import Request
from kvmesh.worker.runner.sampler import SamplingRow


@dataclass
class RequestState:
    external_id: str
    sample_index: int
    detokenizer: IncrementalDetokenizer
    generator: torch.Generator | None
    arrival_wall_s: float
    first_token_wall_s: float | None = None
    first_scheduled_wall_s: float | None = None
    logprobs: list[float] = field(default_factory=list)


class OutputProcessor:
    def __init__(self, tokenizer, eos_token_ids: tuple[int, ...], max_model_len: int):
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len
        self.states: dict[str, RequestState] = {}  # internal request id -> state

    def add(self, request: Request, external_id: str, arrival_wall_s: float) -> None:
        seed = request.sampling.seed
        gen = None
        if seed is not None:
            # n > 1 samples of one seeded request must differ from each other, reproducibly.
            gen = torch.Generator(device="cpu").manual_seed(seed + 1_000_003 * request.sample_index)
        self.states[request.request_id] = RequestState(
            external_id, request.sample_index,
            IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids, request.sampling.stop),
            gen, arrival_wall_s)

    def resume(self, request: Request, text_chars: int) -> None:
        """A failed-over request: its output so far was streamed by another worker. Feed it to
        the detokenizer (context for what follows) without streaming it again."""
        detokenizer = self.states[request.request_id].detokenizer
        for token_id in request.output_token_ids:
            detokenizer.push(token_id)
        detokenizer.mark_emitted(text_chars)

    def sampling_row(self, request: Request, allowed: torch.Tensor | None = None) -> SamplingRow:
        """`allowed`: the request's structured-output mask this step (bool [V]), or None."""
        state = self.states[request.request_id]
        p = request.sampling
        blocked = tuple(self.eos_token_ids | set(p.stop_token_ids)) if p.min_tokens else ()
        if blocked and allowed is not None and len(request.output_token_ids) < p.min_tokens:
            # The grammar wins over min_tokens: where it allows only EOS / stop tokens (its
            # output is complete), blocking them would leave nothing to sample.
            rest = allowed.clone()
            rest[[t for t in blocked if t < rest.numel()]] = False
            if not bool(rest.any()):
                blocked = ()
        return SamplingRow(p, request.prompt_token_ids, request.output_token_ids, state.generator, blocked, allowed)

    def mark_scheduled(self, request: Request) -> None:
        state = self.states.get(request.request_id)
        if state is not None and state.first_scheduled_wall_s is None:
            state.first_scheduled_wall_s = time.time()

    def on_token(self, request: Request, token_id: int, logprob: float | None,
                 num_later: int = 0) -> tuple[RequestDelta, FinishReason | None]:
        """The request already has `token_id` appended, and `num_later` tokens after it (one
        step's accepted drafts: checked in order). Returns its delta and, if it must stop
        now, the finish reason (the engine then finishes it in the scheduler)."""
        state = self.states[request.request_id]
        if state.first_token_wall_s is None:
            state.first_token_wall_s = time.time()
        if logprob is not None:
            state.logprobs.append(logprob)
        p = request.sampling
        n_out = request.num_output_tokens - num_later
        reason = None
        may_stop = n_out >= p.min_tokens
        # A constrained request samples EOS / a stop token before min_tokens only when its
        # grammar allows nothing else (sampling_row lifts the block then): its output is complete.
        may_stop_on_token = may_stop or p.structured is not None
        if may_stop_on_token and ((not p.ignore_eos and token_id in self.eos_token_ids) or token_id in p.stop_token_ids):
            reason = FinishReason.STOP
        else:
            state.detokenizer.push(token_id)
            if may_stop and state.detokenizer.stop_hit is not None and not p.ignore_eos:
                reason = FinishReason.STOP
            elif n_out >= p.max_tokens or request.num_tokens - num_later >= self.max_model_len:
                reason = FinishReason.LENGTH
        text = state.detokenizer.take_delta(finished=reason is not None)
        delta = RequestDelta(
            request_id=state.external_id, text=text, token_ids=(token_id,),
            logprobs=(logprob,) if logprob is not None else None, sample_index=state.sample_index)
        return delta, reason

    def final_delta(self, request: Request, reason: FinishReason, error: str | None = None,
                    error_type: str | None = None, retry_after_s: float | None = None) -> RequestDelta:
        """The closing delta (usage, timings); removes the request's state."""
        state = self.states.pop(request.request_id)
        text = state.detokenizer.take_delta(finished=True) if reason != FinishReason.ERROR else ""
        timings = RequestTimings(
            arrival_time=state.arrival_wall_s, first_scheduled_time=state.first_scheduled_wall_s,
            first_token_time=state.first_token_wall_s, finished_time=time.time(),
            num_preemptions=request.num_preemptions, peak_kv_tokens=request.peak_kv_tokens)
        usage = Usage(prompt_tokens=request.num_prompt_tokens, completion_tokens=request.num_output_tokens,
                      cached_tokens=request.num_cached_tokens)
        return RequestDelta(request_id=state.external_id, text=text, finished=True, finish_reason=reason,
                            usage=usage, timings=timings, error=error, error_type=error_type,
                            retry_after_s=retry_after_s, sample_index=state.sample_index)
