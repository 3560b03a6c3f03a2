"""asyncio front of the engine: a background step thread, one stream per request.

    engine = AsyncEngine.from_config(KvmeshConfig())
    async for delta in engine.generate(GenerateRequest("r1", prompt="Hi")):
        print(delta.text, end="")

The step thread is the engine's only owner (TGI's lesson: one owner for mutable state). The
event loop talks to it through an inbox of commands and gets deltas back through
`loop.call_soon_threadsafe`, so the loop never blocks on a model forward. Validation errors
(InvalidRequestError) and admission refusals (OverloadedError) are raised by `generate`
before its first delta. Cancelling the consuming task, or closing the generator early, aborts
the request in the engine and frees its KV blocks.

Each request has one target, filled by the step thread: its own queue (`generate_batches`
hands out everything that queue holds at once, `generate` the same deltas one by one), or the
channel of the router replica that sent it (`submit`: every step's deltas of all that replica's
requests leave as one message; worker/runtime/delta_channel.py). The router uses channels.

Paced streams (`generate_batches(request, paced=True)`, the actor's per-request `generate`): every message
a worker sends costs CPU in four processes (this actor's event loop and Ray, the router, Serve's
proxy, the client), ~2.5 ms in all per message on the 2-core machines, where the same cores run
the engine. One message per running request per step is 64 messages a step at batch 64, and
the stack then took ~0.8 of the 2 cores from the engine (measured 2026-12-02; docs/benchmarks.md,
"Served against in-process, on 2 vCPU", has the current account). So
a worker sends at most `scheduler.stream_messages_per_s` messages a second over all its
streams: after a message, a stream waits `streams / budget` seconds (never more than
_MAX_PACE_S) before its next one, and what arrived meanwhile goes out as one merged delta.
At a few streams the wait is under one step and nothing changes; under load a stream's
tokens come in chunks of a few (as vLLM's and SGLang's `--stream-interval` do, sized by load
instead of fixed). The first delta (TTFT) and a request's final delta never wait. 0 = a
message per step per stream.

Step timing is the engine's own (Engine.phase_clock: its observers get
one StepReport per step that did work, from the step thread; the actor's metrics and spans
are such observers).

`stats()` / `prefix_events()` are exact reads taken between steps under the engine lock
(they wait for at most one step); async code should use `stats_async()` /
`prefix_events_async()`, which wait in a worker thread instead of the event loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Protocol

from kvmesh.core.config import KvmeshConfig
from kvmesh.core.seams import DispatchReport, GenerateRequest, PrefixEventBatch, RequestDelta, WorkerStats, merge_deltas
from kvmesh.worker.engine_loop.engine import Engine
from kvmesh.core.errors import InvalidRequestError, KvmeshError
from kvmesh.worker.engine_loop.scheduler_stats import SchedulerStats

logger = logging.getLogger(__name__)

# How long the idle step thread sleeps between inbox checks: a safety net only, since every
# command and the stop set `_wakeup`. Each timed wake-up takes the GIL and the engine lock
# beside an idle worker's event loop (20 a second at 0.05 s: docs/deploy.md, the idle account).
_IDLE_WAIT_S = 1.0
_BLOCKED_WAIT_S = 0.002  # pause when requests exist but the scheduler ran nothing
_MAX_PACE_S = 1.0  # a paced stream still gets a message at least this often


@dataclass
class _Stream:
    """One request's deltas, filled by the step thread through its event loop."""

    loop: asyncio.AbstractEventLoop
    deltas: asyncio.Queue
    final_ready: asyncio.Event  # a finished or error delta is queued: a paced wait ends now

    def put(self, delta: RequestDelta) -> None:
        self.deltas.put_nowait(delta)
        if delta.finished or delta.error_type:
            self.final_ready.set()


class DeltaTarget(Protocol):
    """Where a request's deltas go: its own stream (`generate`), or the channel of the router
    replica that sent it (`submit`, worker/runtime/delta_channel.py). `put` runs on `loop`."""

    loop: asyncio.AbstractEventLoop

    def put(self, delta: RequestDelta) -> None: ...


@dataclass
class _Add:
    request: GenerateRequest
    prompt_ids: list[int]
    loop: asyncio.AbstractEventLoop
    accepted: asyncio.Future


@dataclass
class _Abort:
    request_id: str


@dataclass
class _EvictAll:
    reason: str


@dataclass
class _OnStepThread:
    """`fn(engine, *args)` on the step thread; its result or error goes to `done`."""

    fn: Callable
    args: tuple
    done: concurrent.futures.Future


class AsyncEngine:
    def __init__(self, engine: Engine | None = None, build: Callable[[], Engine] | None = None):
        """Around `engine`, or around the engine `build()` makes on the step thread (from_config):
        exactly one of them. Blocks until the engine is there; `build`'s error is raised here."""
        if (engine is None) == (build is None):
            raise TypeError("AsyncEngine takes an engine or a build function, one of them")
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._lock = threading.Lock()  # held by the step thread while it touches the engine
        self._streams: dict[str, DeltaTarget] = {}
        self._stop = threading.Event()
        built: concurrent.futures.Future = concurrent.futures.Future()
        if engine is not None:
            # Structured output's tokenizer view holds the GIL while it is built: before the
            # step thread runs, never at the first constrained request (structured_output.py).
            engine.structured.prepare()
            built.set_result(engine)
        self._thread = threading.Thread(target=self._run, args=(built, build), name="kvmesh-engine-step",
                                        daemon=True)
        self._thread.start()
        self.engine = built.result()
        self.model_name = self.engine.model_name
        self.block_size = self.engine.block_size
        self.tokenizer = self.engine.tokenizer
        self._stream_budget_per_s = self.engine.config.scheduler.stream_messages_per_s

    @classmethod
    def from_config(cls, config: KvmeshConfig | None = None, worker_id: str = "worker-0") -> "AsyncEngine":
        """The engine built on its own step thread: every torch op of the model (load, warm-up,
        steps, prefix export / import) then runs on that one thread, so the process has one
        OpenMP thread team. A second team (the model loaded on the caller's thread, stepped on
        this one) makes libgomp count more threads than cores and cut its spin-wait at every
        barrier to ~1,000 pauses: the engine's threads then sleep at each barrier and wake
        behind whatever else runs on the core (docs/benchmarks.md, "Served against in-process")."""
        return cls(build=lambda: Engine.from_config(config, worker_id))

    def block_extra_keys(self, cache_salt: str | None = None, adapter=None) -> tuple[str, ...]:
        return self.engine.block_extra_keys(cache_salt, adapter)

    # ---- requests -----------------------------------------------------------------------

    async def generate(self, request: GenerateRequest) -> AsyncIterator[RequestDelta]:
        """Async generator of deltas; errors raise on the first iteration, before any delta."""
        async with contextlib.aclosing(self.generate_batches(request)) as batches:
            async for batch in batches:
                for delta in batch:
                    yield delta

    async def generate_batches(self, request: GenerateRequest, paced: bool = False) -> AsyncIterator[list[RequestDelta]]:
        """Like `generate`, but each item is every delta that arrived since the previous item
        (at least one), consecutive deltas of a sample merged into one: a slow consumer takes
        fewer, larger batches instead of falling behind, and every hop after the actor (router,
        Serve's proxy, the client) handles one message for them, not one per token. `paced`:
        the worker's message budget applies (module doc)."""
        if request.request_id in self._streams:
            raise InvalidRequestError(f"request id {request.request_id!r} is already in flight")
        prompt_ids = self.engine.validate(request)  # pure checks + tokenization, no engine state
        loop = asyncio.get_running_loop()
        stream = _Stream(loop, asyncio.Queue(), asyncio.Event())
        self._streams[request.request_id] = stream
        accepted = loop.create_future()
        self._inbox.put(_Add(request, prompt_ids, loop, accepted))
        self._wakeup.set()
        remaining = request.sampling.n
        try:
            await accepted  # raises OverloadedError / InvalidRequestError from the scheduler
            while remaining:
                batch = [await stream.deltas.get()]
                while not stream.deltas.empty():
                    batch.append(stream.deltas.get_nowait())
                remaining -= sum(delta.finished for delta in batch)
                yield merge_deltas(batch)
                if remaining and paced:
                    await self._pace(stream)
        finally:
            self._streams.pop(request.request_id, None)
            refused = accepted.done() and not accepted.cancelled() and accepted.exception() is not None
            if remaining and not refused:
                # the consumer left early (cancelled or closed): free the request's blocks. The
                # abort queues behind the add, so it lands even if the add is still pending.
                self._inbox.put(_Abort(request.request_id))
                self._wakeup.set()

    async def submit(self, request: GenerateRequest, channel, on_end=None) -> None:
        """Start `request` with its deltas going to `channel` (a DeltaChannel: one per router
        replica, every step's deltas of all its requests in one message); returns once the
        scheduler accepted it, raises its refusal (nothing then reaches the channel). The
        request ends with its final deltas, or with `abort`; `on_end(last_delta)` then runs
        on the channel's loop."""
        await self.accepted(request.request_id, channel, self.submit_nowait(request, channel, on_end))

    def submit_nowait(self, request: GenerateRequest, channel, on_end=None) -> asyncio.Future:
        """`submit`'s first half, with no await: validates (raises InvalidRequestError), queues
        the request for the step thread and returns the future `accepted` waits on. Requests
        queued one after another reach the scheduler in that order, in the same step (the
        worker actor's `_submit_on`)."""
        request_id = request.request_id
        if request_id in self._streams:
            raise InvalidRequestError(f"request id {request_id!r} is already in flight")
        prompt_ids = self.engine.validate(request)
        loop = asyncio.get_running_loop()
        self._streams[request_id] = channel

        def ended(last: RequestDelta) -> None:
            self._streams.pop(request_id, None)
            if on_end is not None:
                on_end(last)

        channel.open_request(request_id, request.sampling.n, ended)
        accepted = loop.create_future()
        self._inbox.put(_Add(request, prompt_ids, loop, accepted))
        self._wakeup.set()
        return accepted

    async def accepted(self, request_id: str, channel, accepted: asyncio.Future) -> None:
        """`submit`'s second half: wait for the scheduler's answer to `submit_nowait`; a
        refusal is raised and leaves nothing behind."""
        try:
            await accepted
        except BaseException as exc:
            self._streams.pop(request_id, None)
            channel.forget(request_id)
            if not isinstance(exc, KvmeshError):  # cancelled: the add may still land, so abort behind it
                self._inbox.put(_Abort(request_id))
                self._wakeup.set()
            raise

    def pace_s(self) -> float:
        """How long a paced stream waits after a message: its share of the worker's budget."""
        if self._stream_budget_per_s <= 0:
            return 0.0
        return min(_MAX_PACE_S, len(self._streams) / self._stream_budget_per_s)

    async def _pace(self, stream: _Stream) -> None:
        wait_s = self.pace_s()
        if wait_s <= 0 or stream.final_ready.is_set():
            return
        try:  # a timer, not wait_for's task: this runs once per message (as Subscription.take)
            async with asyncio.timeout(wait_s):
                await stream.final_ready.wait()
        except TimeoutError:
            pass

    async def abort(self, request_id: str) -> None:
        self.abort_nowait(request_id)

    def abort_nowait(self, request_id: str) -> None:
        """`abort` without an await: queued for the step thread behind everything queued before."""
        self._inbox.put(_Abort(request_id))
        self._wakeup.set()

    async def evict_all(self, reason: str) -> None:
        """Every request ends with a WorkerFailedError final delta (Engine.evict_all), between two steps."""
        self._inbox.put(_EvictAll(reason))
        self._wakeup.set()

    # ---- reads --------------------------------------------------------------------------

    def stats(self) -> WorkerStats:
        with self._lock:
            return self.engine.stats()

    async def poll_reads_async(self, since_prefix_seq: int) -> "PollReads":
        """Everything a router replica's poll reads, taken in one visit to the step thread
        between two steps: one hand-over a poll instead of a lock wait in a pool thread per
        read (each such wait wakes a thread beside the engine's team and stalls its next step)."""
        return await self.locked_async(_poll_reads, since_prefix_seq)

    def prefix_events(self, since_seq: int) -> PrefixEventBatch:
        with self._lock:
            return self.engine.prefix_events(since_seq)

    async def stats_async(self) -> WorkerStats:
        return await asyncio.to_thread(self.stats)

    async def prefix_events_async(self, since_seq: int) -> PrefixEventBatch:
        return await asyncio.to_thread(self.prefix_events, since_seq)

    def locked(self, fn, *args):
        """`fn(engine, *args)` on the step thread between two steps (prefix export / import,
        worker/engine_loop/kv_transfer.py): its torch ops stay on the engine's thread team."""
        if threading.current_thread() is self._thread:
            return fn(self.engine, *args)
        return self._on_step_thread(fn, args).result()

    async def locked_async(self, fn, *args):
        return await asyncio.wrap_future(self._on_step_thread(fn, args))

    def _on_step_thread(self, fn, args: tuple) -> concurrent.futures.Future:
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put(_OnStepThread(fn, args, done))
        self._wakeup.set()
        return done

    async def shutdown(self) -> None:
        self._stop.set()
        self._wakeup.set()
        await asyncio.to_thread(self._thread.join, 10)
        await asyncio.to_thread(self.engine.close)

    # ---- the step thread ----------------------------------------------------------------

    def _run(self, built: concurrent.futures.Future, build: Callable[[], Engine] | None) -> None:
        if build is not None:
            try:
                engine = build()
                engine.structured.prepare()  # as __init__ does for an engine it is given
            except BaseException as exc:
                built.set_exception(exc)
                return
            built.set_result(engine)
        self.engine = built.result()
        self._step_loop()

    def _step_loop(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                deltas = self._drain_inbox()
                busy = self.engine.has_unfinished()
                if busy:
                    try:
                        deltas += self.engine.step()
                    except Exception:  # a bug outside the forward: keep the thread alive, fail loudly
                        logger.exception("engine step failed outside the model forward")
            self._dispatch(deltas)
            if not busy:
                self._wakeup.wait(_IDLE_WAIT_S)
                self._wakeup.clear()
            elif self.engine.last_step_idle:  # requests wait on a window or a sibling: don't spin
                # An engine that knows when its next work is due says so (a new command
                # still wakes the thread at once); otherwise a short pause and look again.
                due_in_s = self.engine.idle_wait_s
                self._wakeup.wait(_BLOCKED_WAIT_S if due_in_s is None else min(_IDLE_WAIT_S, due_in_s))
                self._wakeup.clear()

    def _drain_inbox(self) -> list[RequestDelta]:
        deltas: list[RequestDelta] = []
        while True:
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return deltas
            if isinstance(cmd, _Add):
                try:
                    self.engine.add_request(cmd.request, cmd.prompt_ids)
                except KvmeshError as exc:
                    cmd.loop.call_soon_threadsafe(_settle, cmd.accepted, exc)
                else:
                    cmd.loop.call_soon_threadsafe(_settle, cmd.accepted, None)
            elif isinstance(cmd, _EvictAll):
                deltas += self.engine.evict_all(cmd.reason)
            elif isinstance(cmd, _OnStepThread):
                if cmd.done.set_running_or_notify_cancel():
                    try:
                        cmd.done.set_result(cmd.fn(self.engine, *cmd.args))
                    except BaseException as exc:
                        cmd.done.set_exception(exc)
            else:
                deltas += self.engine.abort(cmd.request_id)

    def _dispatch(self, deltas: list[RequestDelta]) -> None:
        # One cross-thread call per event loop per step, not one per delta: each
        # call_soon_threadsafe wakes the loop and takes the GIL from this step thread, which
        # at 64 running requests was 64 wake-ups between two steps of the served engine.
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[DeltaTarget, RequestDelta]]] = {}
        for delta in deltas:
            target = self._streams.get(delta.request_id)
            if target is not None:
                by_loop.setdefault(target.loop, []).append((target, delta))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_put_all, items)


@dataclass(frozen=True)
class PollReads:
    """What a router replica's poll reads from the engine, read together between two steps."""

    stats: WorkerStats
    dispatches: dict[str, DispatchReport] | None  # None: an engine without the log (the stack bench's null engine)
    window: SchedulerStats  # the scheduler's KV peak / mean over its window, for the worker's metrics
    prefix_events: PrefixEventBatch


def _poll_reads(engine: Engine, since_prefix_seq: int) -> PollReads:
    report = getattr(engine, "dispatch_report", None)
    return PollReads(engine.stats(), report() if report is not None else None, engine.scheduler.stats(),
                     engine.prefix_events(since_prefix_seq))


def _put_all(items: list[tuple[DeltaTarget, RequestDelta]]) -> None:
    for target, delta in items:
        target.put(delta)


def _settle(future: asyncio.Future, exc: BaseException | None) -> None:
    if future.done():
        return
    if exc is None:
        future.set_result(None)
    else:
        future.set_exception(exc)
