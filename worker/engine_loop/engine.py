"""The synchronous engine: requests in, one scheduler step at a time, deltas out.

    engine = Engine.from_config(KvmeshConfig())
    engine.add_request(GenerateRequest("r1", prompt="Hello", sampling=SamplingParams(max_tokens=8)))
    while engine.has_unfinished():
        for delta in engine.step():
            print(delta.text, end="")

One step (the whole loop is these lines; policy lives in the scheduler, tensors in the runner):

    [propose drafts] -> schedule -> [token masks] -> block copies (swap/COW) -> forward + sample (+ verify drafts)
             -> scheduler bookkeeping -> detokenize + stop checks -> finish stopped requests -> deltas

With speculative decoding on (config `speculative`, worker/engine_loop/speculator.py) a
decoding request may gain several tokens in one step; they go through the stop checks one
by one and whatever follows a stop is dropped, so EOS, stop strings, max_tokens and
min_tokens hold exactly as without it. Its tokens of one step form one delta.

A forward that raises fails only the requests of that step (FAILED, blocks freed, an error
delta each) and the engine keeps serving. Not thread-safe: one owner drives it (the
AsyncEngine's step thread, or a script).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time

from kvmesh.core.config import KvmeshConfig
from kvmesh.core.kv_tier_metrics import KVTierFigures
from kvmesh.kv.hashing import adapter_key, block_extra_keys
from kvmesh.kv.kv_cost import check_budget, request_budget
from kvmesh.core.seams import (AdapterRef, DispatchReport, FinishReason, GenerateRequest, PrefixEventBatch,
                               RequestBudget, RequestDelta, WorkerStats, check_fits_context)
from kvmesh.worker.engine_loop.engine_setup import EngineParts, build_engine_parts
from kvmesh.core.errors import InvalidRequestError, KvmeshError
from kvmesh.worker.engine_loop.adapter_gate import AdapterGate
from kvmesh.worker.engine_loop.dispatch_log import DispatchLog
from kvmesh.worker.engine_loop.output_processor import OutputProcessor
from kvmesh.worker.engine_loop.request import Request, RequestStatus
from kvmesh.worker.engine_loop.scheduler import Scheduler
from kvmesh.worker.engine_loop.speculator import Speculator, build_speculator
from kvmesh.worker.engine_loop.structured_output import StructuredOutputs
from kvmesh.worker.model.grammar import check_structured_output
from kvmesh.core.step_phases import StepPhaseClock

logger = logging.getLogger(__name__)


class Engine:
    def __init__(self, config: KvmeshConfig, parts: EngineParts, worker_id: str = "worker-0"):
        self.config = config
        self.worker_id = worker_id
        self.parts = parts
        self.runner = parts.runner
        self.tokenizer = parts.tokenizer
        self.model_name = parts.model_name
        self.max_model_len = parts.max_model_len
        self.block_size = parts.plan.block_size
        self.scheduler = Scheduler(config.scheduler, parts.kv_manager)
        self.outputs = OutputProcessor(parts.tokenizer, parts.eos_token_ids, parts.max_model_len)
        self._live: dict[str, Request] = {}  # internal id -> request, until its final delta
        self._children: dict[str, list[str]] = {}  # external id -> internal ids (n > 1)
        self.dispatches = DispatchLog()  # which router dispatches the figures hold (dispatch_log.py)
        self._vocab_size = int(parts.hf_config.vocab_size)
        self._ids = itertools.count()
        self.num_forward_tokens = 0  # tokens run through the model since start (tests count these)
        self.num_failed_steps = 0
        self.last_step_idle = False  # the last step ran nothing (batching window open, n > 1 gate)
        # How long the step thread may sleep after an idle step; None: unknown (a gate opens
        # when a sibling or a window does), so it looks again shortly.
        self.idle_wait_s: float | None = None
        # Phase timing of every step (core/step_phases.py); the runner marks its own phases.
        self.phase_clock = StepPhaseClock()
        self.runner.phase_clock = self.phase_clock
        # Speculative decoding (None = off): drafts proposed before each schedule().
        self.speculator: Speculator | None = build_speculator(config, parts)
        # Structured output: grammars compile off this thread; a constrained request waits in
        # the queue until its grammar is ready, then its rows are masked each step.
        self.structured = StructuredOutputs(parts.tokenizer, self._vocab_size, tuple(parts.eos_token_ids),
                                            tokenizer_id=f"{self.model_name}@{config.model.revision}")
        self.scheduler.is_ready = self.structured.is_ready
        if self.speculator is not None:
            self.speculator.skip = self._skip_speculation
        # What the speculator's step-cost curve is measured in: on CPU the process's CPU time
        # (steadier than wall time on a shared machine: other processes' load stretches wall
        # time at random); on a GPU wall time (the forward waits for the device).
        self._forward_clock = time.process_time if parts.device.type == "cpu" else time.perf_counter
        if self.speculator is not None:
            self.speculator.clock = self._forward_clock
        if self.speculator is not None:
            self.phase_clock.speculative_method = self.speculator.method
        # LoRA: requests wait here until their adapter is in a slot (None = no adapters served).
        slots = getattr(self.runner, "lora_slots", None)
        self.adapters: AdapterGate | None = None if slots is None else AdapterGate(slots)

    @classmethod
    def from_config(cls, config: KvmeshConfig | None = None, worker_id: str = "worker-0") -> "Engine":
        config = (config or KvmeshConfig()).validate()
        return cls(config, build_engine_parts(config, worker_id), worker_id)

    # ---- requests in ------------------------------------------------------------------

    def block_extra_keys(self, cache_salt: str | None = None, adapter: AdapterRef | None = None) -> tuple[str, ...]:
        return block_extra_keys(self.model_name, self.config.model.revision, self.parts.kv_cache_dtype, cache_salt,
                                None if adapter is None else adapter_key(adapter.name, adapter.path))

    def tokenize(self, request: GenerateRequest) -> list[int]:
        if (request.prompt is None) == (request.prompt_token_ids is None):
            raise InvalidRequestError("send exactly one of prompt and prompt_token_ids")
        if request.prompt is not None:
            if not isinstance(request.prompt, str) or request.prompt == "":
                raise InvalidRequestError("the prompt is empty")
            return list(self.tokenizer.encode(request.prompt, add_special_tokens=False))
        ids = list(request.prompt_token_ids)
        bad = [t for t in ids if not isinstance(t, int) or t < 0 or t >= self._vocab_size]
        if bad:
            raise InvalidRequestError(f"unknown token ids {bad[:5]} (vocab size {self._vocab_size})")
        return ids

    def validate(self, request: GenerateRequest) -> list[int]:
        """Every check that needs no scheduler state, the only validation of a request in the
        worker process (the scheduler's admission checks capacity only); returns the prompt ids."""
        if not request.request_id:
            raise InvalidRequestError("request_id must be non-empty")
        request.sampling.validate(self.config.scheduler.max_new_tokens, self.config.scheduler.max_n)
        if request.adapter is not None and self.adapters is None:
            raise InvalidRequestError("this worker serves no LoRA adapters (lora.max_loras = 0, or tensor "
                                      "parallelism, which adapters do not support yet)")
        prompt_ids = self.tokenize(request)
        if not prompt_ids:
            raise InvalidRequestError("the prompt is empty")
        budget = self.request_budget(request, prompt_ids)
        check_fits_context(budget.prompt_tokens, budget.max_tokens, self.max_model_len)
        self.scheduler.admission.check_request_fits(budget)
        check_structured_output(request.sampling.structured)  # remembered by content: cheap again
        return prompt_ids

    def request_budget(self, request: GenerateRequest, prompt_ids: list[int]) -> RequestBudget:
        """The budget the router computed and carried (checked against the request: a
        mismatch is RequestBudgetMismatchError, never silently recomputed), or, for a request
        handed to the engine directly, the one computed here, at its edge."""
        if request.budget is None:
            return request_budget(len(prompt_ids), request.sampling, self.block_size)
        check_budget(request.budget, len(prompt_ids), request.sampling, self.block_size)
        return request.budget

    def add_request(self, request: GenerateRequest, prompt_ids: list[int] | None = None) -> None:
        """Queue a request or raise InvalidRequestError / OverloadedError (nothing held then)."""
        if request.request_id in self._children:
            raise InvalidRequestError(f"request id {request.request_id!r} is already in flight")
        if prompt_ids is None:
            prompt_ids = self.validate(request)
        n = request.sampling.n
        resumed = self._check_resume(request)
        group = f"{request.request_id}#{next(self._ids)}" if n > 1 else None
        members = [Request(request_id=f"{request.request_id}" if n == 1 else f"{group}/{i}",
                           prompt_token_ids=prompt_ids, sampling=request.sampling,
                           output_token_ids=list(resumed),  # each sample its own list
                           arrival_time=self.scheduler.clock(), priority=request.priority,
                           priority_class=request.priority_class,
                           tenant_id=request.tenant_id, adapter=request.adapter,
                           extra_keys=self.block_extra_keys(request.cache_salt, request.adapter), group_id=group,
                           sample_index=i)
                   for i in range(n)]
        if request.adapter is None or self.adapters.admit(members):
            try:
                self._schedule_members(members)
            except Exception:
                if self.adapters is not None:  # refused: nothing of it stays, its pins included
                    for member in members:
                        self.adapters.release(member)
                self.dispatches.note_taken(request, queued=False)
                raise
        self.dispatches.note_taken(request, queued=True)
        now = time.time()
        for member in members:
            self._live[member.request_id] = member
            self.outputs.add(member, request.request_id, now)
            if resumed:
                self.outputs.resume(member, request.resume_text_chars)
        self._children[request.request_id] = [m.request_id for m in members]

    def _schedule_members(self, members: list[Request]) -> None:
        added: list[Request] = []
        try:
            for member in members:
                self.structured.add(member)  # its grammar starts compiling (or is cached)
                self.scheduler.add_request(member)
                added.append(member)
        except Exception:
            self.scheduler.abort_requests([m.request_id for m in added])
            for member in members:
                self.structured.forget(member.request_id)
            raise

    def _admit_adapter_requests(self) -> list[RequestDelta]:
        """Requests whose adapter just became resident go to the scheduler; those whose
        adapter failed to load (or that the scheduler now refuses) end with an error delta."""
        ready, lost = self.adapters.poll()
        deltas = []
        for req, exc in lost:
            req.status = RequestStatus.FAILED
            deltas.append(self._close(req, FinishReason.ERROR, error=f"adapter {req.adapter.name!r}: {exc}",
                                      error_type=_error_type(exc)))
        groups: dict[str, list[Request]] = {}
        for req in ready:
            groups.setdefault(req.group_id or req.request_id, []).append(req)
        for members in groups.values():
            try:
                self._schedule_members(members)
            except KvmeshError as exc:
                for m in members:
                    m.status = RequestStatus.REJECTED
                deltas += [self._close(m, FinishReason.ERROR, error=exc.message, error_type=type(exc).__name__,
                                       retry_after_s=getattr(exc, "retry_after_s", None)) for m in members]
        return deltas

    def _check_resume(self, request: GenerateRequest) -> list[int]:
        """The output a failed-over request already streamed (GenerateRequest.resume_token_ids)."""
        ids = list(request.resume_token_ids)
        if not ids:
            return []
        if request.sampling.n != 1:
            raise InvalidRequestError("only a single-sample request (n = 1) can be resumed")
        if len(ids) >= request.sampling.max_tokens:
            raise InvalidRequestError(f"{len(ids)} tokens to resume from leave nothing of max_tokens")
        if any(not isinstance(t, int) or t < 0 or t >= self._vocab_size for t in ids) or request.resume_text_chars < 0:
            raise InvalidRequestError("resume_token_ids / resume_text_chars out of range")
        return ids

    def abort(self, request_id: str) -> list[RequestDelta]:
        """Cancel a request (all its samples); unknown ids are a no-op. Returns final deltas."""
        internal = self._children.get(request_id, [])
        aborted = self.scheduler.abort_requests(internal, RequestStatus.CANCELLED)
        if self.adapters is not None:
            for req in self.adapters.remove_waiting(set(internal)):
                req.status = RequestStatus.CANCELLED
                aborted.append(req)
        return [self._close(r, FinishReason.ABORT) for r in aborted]

    # ---- one step -----------------------------------------------------------------------

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or (self.adapters is not None and self.adapters.num_waiting > 0)

    def step(self) -> list[RequestDelta]:
        clock = self.phase_clock
        clock.begin()
        gated = [] if self.adapters is None else self._admit_adapter_requests()
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running)
        deltas = self._fail_unconstrainable()
        sched_out = self.scheduler.schedule()
        clock.lap("schedule")
        deltas += gated + [self._close_finished(f.request_id, f.status) for f in sched_out.finished]
        deltas = [d for d in deltas if d is not None]
        self.last_step_idle = sched_out.is_empty
        if sched_out.is_empty:
            return deltas
        for entry in sched_out.scheduled:
            self.outputs.mark_scheduled(entry.request)
        masks = self.structured.masks([e.request for e in sched_out.scheduled if e.sample])
        if masks:
            clock.lap("mask")
        try:
            self._store_in_tier(sched_out)  # evicted blocks leave before anything overwrites them
            self.runner.apply_block_ops(sched_out)
            if self.parts.host_tier_store is not None:
                self.parts.host_tier_store.load(self.runner.kv_caches, sched_out.tier_loads)
            started = self._forward_clock()
            result = self.runner.execute(sched_out.scheduled,
                                         lambda req: self.outputs.sampling_row(req, masks.get(req.request_id)))
            forward_s = self._forward_clock() - started
        except Exception as exc:  # the forward failed: fail this step's requests, keep serving
            deltas += self._fail_step(sched_out, exc)
            clock.end(sched_out, failure=exc)
            return deltas
        self.num_forward_tokens += result.num_tokens
        self.scheduler.update_from_output(sched_out, result.sampled, result.accepted_drafts)
        if self.speculator is not None:
            self.speculator.observe_step(result.num_tokens, forward_s, sched_out.scheduled, result.accepted_drafts)
        stopped: list[tuple[Request, FinishReason, RequestDelta]] = []
        for entry in sched_out.scheduled:
            req = entry.request
            token = result.sampled.get(req.request_id)
            if token is None:
                continue
            tokens = (*result.accepted_drafts.get(req.request_id, ()), token)
            logprob = result.logprobs.get(req.request_id)
            logprobs = (*result.accepted_logprobs.get(req.request_id, (None,) * (len(tokens) - 1)), logprob)
            delta, reason = self._on_tokens(req, tokens, logprobs)
            if reason is None:
                deltas.append(delta)
            else:
                stopped.append((req, reason, delta))
        if stopped:
            self.scheduler.finish_requests([r.request_id for r, _, _ in stopped], RequestStatus.FINISHED)
            for req, reason, delta in stopped:
                final = self._close(req, reason)
                deltas.append(dataclasses.replace(final, text=delta.text + final.text, token_ids=delta.token_ids,
                                                  logprobs=delta.logprobs))
        clock.lap("output")
        clock.end(sched_out, accepted_drafts=result.accepted_drafts)
        return deltas

    def _store_in_tier(self, sched_out) -> None:
        store = self.parts.host_tier_store
        if store is not None and sched_out.tier_stores:
            for slot, block_hash, checksum in store.store(self.runner.kv_caches, sched_out.tier_stores):
                self.scheduler.kv.host_tier.confirm(slot, block_hash, checksum)
    def _on_tokens(self, req: Request, tokens: tuple[int, ...], logprobs: tuple[float | None, ...]
                   ) -> tuple[RequestDelta, FinishReason | None]:
        """Stop checks over the tokens one step gave `req` (already appended), in order, each
        with its logprob (None: not asked): at a stop, the tokens after it are dropped from
        the request. One delta for all."""
        if len(tokens) == 1:
            return self.outputs.on_token(req, tokens[0], logprobs[0])
        texts: list[str] = []
        for i, (token, logprob) in enumerate(zip(tokens, logprobs)):
            num_later = len(tokens) - 1 - i
            delta, reason = self.outputs.on_token(req, token, logprob, num_later)
            texts.append(delta.text)
            if reason is not None:
                req.truncate_output(req.num_output_tokens - num_later)
                break
        kept = [lp for lp in logprobs[:i + 1] if lp is not None]
        return dataclasses.replace(delta, text="".join(texts), token_ids=tokens[:i + 1],
                                   logprobs=tuple(kept) if kept else None), reason

    def _skip_speculation(self, request: Request) -> bool:
        """Constrained requests do not speculate (worker/engine_loop/structured_output.py)."""
        if self.structured.is_constrained(request):
            self.structured.num_spec_skipped += 1
            return True
        return False

    def _fail_unconstrainable(self) -> list[RequestDelta]:
        """Requests whose grammar failed to compile on this worker (the router checks first, so
        only a constraint its check passed and the tokenizer-bound compile refused) end with
        an InvalidRequestError delta, their blocks freed."""
        failed = self.structured.failed()
        if not failed:
            return []
        ended = self.scheduler.finish_requests(list(failed), RequestStatus.FAILED)
        return [self._close(r, FinishReason.ERROR, error=failed[r.request_id], error_type="InvalidRequestError")
                for r in ended]

    def evict_all(self, reason: str) -> list[RequestDelta]:
        """End every request with a retryable WorkerFailedError (a drained worker's leftovers):
        their KV goes back to the pool, and the router resumes each on another worker from the
        tokens it streamed, as after a worker failure."""
        failed = self.scheduler.finish_requests(list(self._live), RequestStatus.FAILED)
        return [self._close(r, FinishReason.ERROR, error=reason, error_type="WorkerFailedError") for r in failed]

    def _fail_step(self, sched_out, exc: Exception) -> list[RequestDelta]:
        self.num_failed_steps += 1
        logger.exception("model forward failed; failing the %d requests of this step", len(sched_out.scheduled))
        ids = [e.request_id for e in sched_out.scheduled]
        failed = self.scheduler.finish_requests(ids, RequestStatus.FAILED)
        msg = f"model forward failed: {type(exc).__name__}: {exc}"
        if getattr(self.runner, "kv_lost", False):  # a tensor-parallel rank died with its KV shard
            failed += self.scheduler.finish_requests(list(self._live), RequestStatus.FAILED)
            self.scheduler.kv.reset_prefix_cache()
            self.runner.kv_lost = False
        return [self._close(r, FinishReason.ERROR, error=msg, error_type="WorkerFailedError") for r in failed]

    def _close_finished(self, internal_id: str, status: RequestStatus) -> RequestDelta | None:
        """A request the scheduler ended on its own (queue timeout) or one already closed."""
        req = self._live.get(internal_id)
        if req is None or not req.status.is_finished:
            # Closed by the engine already (stop, abort, failure), or the id now names a new
            # request added after this one ended and before the scheduler reported it.
            return None
        if status == RequestStatus.REJECTED:
            return self._close(req, FinishReason.ERROR, error="request waited longer than max_queue_time_s",
                               error_type="OverloadedError",
                               retry_after_s=self.scheduler.admission.retry_after_s())
        return self._close(req, FinishReason.ABORT)

    def _close(self, req: Request, reason: FinishReason, **error) -> RequestDelta:
        self._live.pop(req.request_id, None)
        self.structured.forget(req.request_id)
        if self.adapters is not None:
            self.adapters.release(req)
        if self.speculator is not None:
            self.speculator.forget(req.request_id)
        delta = self.outputs.final_delta(req, reason, **error)
        ext = delta.request_id
        siblings = self._children.get(ext)
        if siblings is not None:
            siblings.remove(req.request_id)
            if not siblings:
                del self._children[ext]
                self.dispatches.note_ended(ext)
        return delta

    # ---- what the router sees ----------------------------------------------------------

    def dispatch_report(self) -> dict[str, DispatchReport]:
        """Which router replicas' dispatches `stats()`, read in the same step gap, holds."""
        return self.dispatches.report()

    def stats(self) -> WorkerStats:
        stats = worker_stats(self.scheduler, self.worker_id)
        if self.adapters is None:
            return stats
        slots = self.adapters.slots.stats()
        # Requests waiting for their adapter's load are queued work the scheduler has not seen
        # yet: the router's load and queue figures must count them (and the load they wait on).
        waiting = self.adapters.waiting_requests()
        prompt_tokens = sum(r.num_prompt_tokens for r in waiting)
        return dataclasses.replace(
            stats, lora_slots_total=slots.num_slots, resident_adapters=slots.resident,
            num_adapter_loads=slots.num_loads, num_adapter_evictions=slots.num_evictions,
            num_waiting_for_adapter=len(waiting), num_waiting=stats.num_waiting + len(waiting),
            queued_prompt_tokens=stats.queued_prompt_tokens + prompt_tokens,
            tokens_to_compute=stats.tokens_to_compute + prompt_tokens + sum(r.sampling.max_tokens for r in waiting))

    def kv_tier_figures(self) -> KVTierFigures | None:
        tier, store = self.scheduler.kv.host_tier, self.parts.host_tier_store
        if tier is None or store is None:
            return None
        s = tier.stats()
        return KVTierFigures(s.num_slots_total, s.num_slots_used, s.num_hit_tokens, store.num_bytes_stored,
                             store.num_bytes_loaded, store.store_time_s + store.load_time_s,
                             s.num_checksum_failures)

    def prefix_events(self, since_seq: int) -> PrefixEventBatch:
        return self.scheduler.kv.events_since(since_seq)

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()

    def close(self) -> None:
        """Release what outlives a Python reference: tensor-parallel rank actors, if any."""
        self.structured.close()
        shutdown = getattr(self.runner, "shutdown", None)
        if shutdown is not None:
            shutdown()


def _error_type(exc: BaseException) -> str:
    """The kvmesh error class an adapter-load failure reports as (the router maps it)."""
    return type(exc).__name__ if isinstance(exc, KvmeshError) else "WorkerFailedError"


def worker_stats(scheduler: Scheduler, worker_id: str) -> WorkerStats:
    """What the router sees of one engine's scheduler (also used by load_tests/routing_sim.py,
    whose simulated engines run the real scheduler)."""
    s = scheduler.stats()
    kv = s.kv
    return WorkerStats(
        worker_id=worker_id, healthy=True, block_size=kv.block_size,
        num_blocks_total=kv.num_blocks_total, num_blocks_used=kv.num_blocks_used,
        num_blocks_cached=kv.num_blocks_cached, num_blocks_free=kv.num_blocks_free,
        kv_tokens_used=s.kv_tokens_used, kv_tokens_capacity=s.kv_tokens_budget,
        kv_tokens_reserved=s.kv_tokens_reserved, num_running=s.num_running, num_waiting=s.num_waiting,
        queued_prompt_tokens=s.queued_prompt_tokens, prefix_cache_hit_rate=s.prefix_cache_hit_rate,
        output_tokens_per_s=s.output_tokens_per_s, num_preemptions_recompute=s.num_preemptions_recompute,
        num_preemptions_swap=s.num_preemptions_swap, num_preemptions_priority=s.num_preemptions_priority,
        num_outgrown_estimates=s.num_outgrown_estimates, prefix_event_seq=scheduler.kv.events.next_seq,
        tokens_to_compute=s.tokens_to_compute,
        kv_tokens_reserved_shared=s.kv_tokens_reserved_shared, num_preemptions_priority_kv=s.num_preemptions_priority_kv,
        held_block_hashes=s.held_block_hashes)
