"""A worker without a model: every running request gets one token every `step_s`, so the
stack around the engine (ingress, router, worker channels, Ray) is what a run measures.

    NullEngine       the Engine surface AsyncEngine drives (add_request, step, abort, stats, ...)
    NullWorkerActor  a WorkerActor over AsyncEngine(NullEngine): the router's own actor code
                     (channel socket, submit, poll, abort), only the engine is null

`start_null_workers` creates the named, detached worker actors before the Serve app is
deployed; the router replicas' `start_workers` then finds them by name (get_if_exists) and
serves them as it would real workers. load_tests/bench_stack.py uses it.

A request's first token comes at once (no prefill), then one a step, the steps on one clock
for every request (as one batch); the step thread checks for a due step every ~2 ms
(AsyncEngine's blocked wait), so the per-stream rate is at most 1 / step_s and the whole
worker's is streams / step_s.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from kvmesh.core.config import KvmeshConfig
from kvmesh.core.errors import OverloadedError
from kvmesh.core.seams import (FinishReason, GenerateRequest, PrefixEventBatch, RequestDelta, RequestTimings, Usage,
                               WorkerStats)
from kvmesh.worker.runtime.actor import WorkerActor, WorkerInfo, WorkerPoll, worker_actor_options
from kvmesh.worker.runtime.channel_server import ChannelServer
from kvmesh.worker.engine_api import AsyncEngine

NULL_MODEL_NAME = "null"
NULL_TOKEN_ID = 42
NULL_TOKEN_TEXT = "a "
_BLOCK_SIZE = 16
_CAPACITY_TOKENS = 1 << 24  # never the limit: the stack is what is measured


@dataclass
class _Running:
    request: GenerateRequest
    num_prompt: int
    arrived_s: float
    next_due_s: float
    sample_left: list[int] = field(default_factory=list)  # tokens still to emit, per sample


class _NullScheduler:
    def stats(self):  # AsyncEngine.poll_reads_async reads it; the null actor's poll does not
        return None


class _NoStructuredOutput:
    """No constrained decoding: nothing to prepare before the step thread starts."""

    def prepare(self) -> None:
        return None


class NullEngine:
    """The Engine surface AsyncEngine uses, emitting NULL_TOKEN_ID at a fixed step."""

    def __init__(self, config: KvmeshConfig, step_s: float, worker_id: str = "worker-0"):
        self.config = config
        self.step_s = step_s
        self.worker_id = worker_id
        self.model_name = NULL_MODEL_NAME
        self.block_size = _BLOCK_SIZE
        self.tokenizer = None
        self.max_model_len = 1 << 20
        self.scheduler = _NullScheduler()
        self.structured = _NoStructuredOutput()
        self.last_step_idle = False
        self._running: dict[str, _Running] = {}
        self._max_running = config.scheduler.max_num_seqs
        self._tokens_out = 0
        # When the next request is due: after an idle step AsyncEngine sleeps until then
        # (idle_wait_s), and a step before it returns at once. Polling or a pass over every
        # request each time would count this null engine's own wake-ups as the stack's CPU
        # (a real engine's step is its forward, not a poll).
        self._next_due_s = float("inf")

    def validate(self, request: GenerateRequest) -> list[int]:
        return list(request.prompt_token_ids)

    def tokenize(self, request: GenerateRequest) -> list[int]:
        return list(request.prompt_token_ids)

    def block_extra_keys(self, cache_salt: str | None = None, adapter=None) -> tuple[str, ...]:
        return (NULL_MODEL_NAME, cache_salt or "", repr(adapter))

    def add_request(self, request: GenerateRequest, prompt_ids: list[int]) -> None:
        if len(self._running) >= self._max_running:
            raise OverloadedError("null engine full", retry_after_s=self.step_s)
        now = time.monotonic()
        self._running[request.request_id] = _Running(request, len(prompt_ids), time.time(), now,
                                                      [request.sampling.max_tokens] * request.sampling.n)
        self._next_due_s = now

    def abort(self, request_id: str) -> list[RequestDelta]:
        running = self._running.pop(request_id, None)
        if running is None:
            return []
        return [RequestDelta(request_id=request_id, finished=True, finish_reason=FinishReason.ABORT, sample_index=i)
                for i, left in enumerate(running.sample_left) if left > 0]

    @property
    def idle_wait_s(self) -> float:
        """Until the next request is due (AsyncEngine reads it after an idle step)."""
        return max(0.0, self._next_due_s - time.monotonic())

    def has_unfinished(self) -> bool:
        return bool(self._running)

    def step(self) -> list[RequestDelta]:
        now = time.monotonic()
        if now < self._next_due_s:
            self.last_step_idle = True
            return []
        deltas: list[RequestDelta] = []
        next_due_s = float("inf")
        for request_id, running in list(self._running.items()):
            if running.next_due_s > now:
                next_due_s = min(next_due_s, running.next_due_s)
                continue
            running.next_due_s = self._next_step_s(now)
            next_due_s = min(next_due_s, running.next_due_s)
            for index, left in enumerate(running.sample_left):
                if left <= 0:
                    continue
                running.sample_left[index] = left - 1
                deltas.append(self._delta(running, index, final=left == 1))
            if not any(running.sample_left):
                del self._running[request_id]
        self._next_due_s = next_due_s
        self._tokens_out += len(deltas)
        self.last_step_idle = not deltas
        return deltas

    def _next_step_s(self, now: float) -> float:
        """The first step boundary after `now`: every running request's tokens after its first
        come on one clock, one step for all, as a real engine's batch does (and its deltas leave
        in one channel message), not each on its own phase."""
        return (math.floor(now / self.step_s) + 1) * self.step_s

    def _delta(self, running: _Running, index: int, final: bool) -> RequestDelta:
        request = running.request
        if not final:
            return RequestDelta(request_id=request.request_id, text=NULL_TOKEN_TEXT, token_ids=(NULL_TOKEN_ID,),
                                sample_index=index)
        now = time.time()
        return RequestDelta(request_id=request.request_id, text=NULL_TOKEN_TEXT, token_ids=(NULL_TOKEN_ID,),
                            finished=True, finish_reason=FinishReason.LENGTH, sample_index=index,
                            usage=Usage(running.num_prompt, request.sampling.max_tokens),
                            timings=RequestTimings(arrival_time=running.arrived_s, first_scheduled_time=running.arrived_s,
                                                   first_token_time=running.arrived_s, finished_time=now))

    def stats(self) -> WorkerStats:
        running = len(self._running)
        used = sum(r.num_prompt + r.request.sampling.max_tokens for r in self._running.values())
        blocks = _CAPACITY_TOKENS // _BLOCK_SIZE
        return WorkerStats(worker_id=self.worker_id, healthy=True, block_size=_BLOCK_SIZE, num_blocks_total=blocks,
                           num_blocks_used=used // _BLOCK_SIZE, num_blocks_cached=0,
                           num_blocks_free=blocks - used // _BLOCK_SIZE, kv_tokens_used=used,
                           kv_tokens_capacity=_CAPACITY_TOKENS, kv_tokens_reserved=used, num_running=running,
                           num_waiting=0, queued_prompt_tokens=0, prefix_cache_hit_rate=0.0,
                           output_tokens_per_s=running / self.step_s)

    def prefix_events(self, since_seq: int) -> PrefixEventBatch:
        return PrefixEventBatch(worker_id=self.worker_id, next_seq=0)

    def close(self) -> None:
        self._running.clear()


class NullWorkerActor(WorkerActor):
    """The router's worker actor over a NullEngine (no model, no torch, no telemetry)."""

    def __init__(self, config_dict: dict, worker_id: str, step_s: float = 0.02):
        import uuid

        self._config = KvmeshConfig.from_dict(config_dict)
        self._engine = AsyncEngine(NullEngine(self._config, step_s, worker_id))
        self._info = WorkerInfo(worker_id=worker_id, incarnation=uuid.uuid4().hex, model_name=NULL_MODEL_NAME,
                                block_size=_BLOCK_SIZE, max_model_len=self._engine.engine.max_model_len)
        self._streaming: set[str] = set()
        self._channels: dict = {}
        self._channel_server = ChannelServer(self._info.incarnation, self)
        self._draining = False

    async def poll(self, since_prefix_seq: int) -> WorkerPoll:
        return WorkerPoll(self._info, self._engine.stats(), self._engine.engine.prefix_events(since_prefix_seq))

    def _record_spans(self, request, final, arrived_at) -> None:  # nothing traced: the stack alone
        return None


def start_null_workers(config: KvmeshConfig, app_name: str, step_s: float) -> list:
    """Create the app's worker actors as NullWorkerActors (before the Serve app is deployed)."""
    import ray

    remote_class = ray.remote(NullWorkerActor)
    handles = []
    for index in range(config.parallel.num_workers):
        options = worker_actor_options(config, app_name, index)
        handles.append(remote_class.options(**options).remote(config.to_dict(), f"worker-{index}", step_s))
    ray.get([h.info.remote() for h in handles])
    return handles
