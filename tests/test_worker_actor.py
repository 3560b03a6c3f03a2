"""The worker actor and the router's WorkerPool on a real local Ray cluster (one per module),
with a tiny random Llama. The only injected fault is `ray.kill`, which is what a crashed
worker process looks like to Ray."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from e2e_cluster import shared_ray
from kvmesh.core.config import KvmeshConfig
from kvmesh.kv.hashing import block_extra_keys
from kvmesh.core.seams import ErrorReport
from kvmesh.worker.runtime.actor import WorkerInfo, WorkerPoll, kill_workers, start_workers
from kvmesh.core.seams import FinishReason, GenerateRequest, RequestDelta, SamplingParams
from kvmesh.core.errors import InvalidRequestError, OverloadedError, WorkerFailedError

APP_NAME = "kvmesh-actor-test"
LONG = 900  # decode steps no machine finishes before the test acts on the request

pytestmark = [pytest.mark.timeout(300), pytest.mark.shared_ray]


def test_error_report_round_trip():
    overloaded = ErrorReport.from_exception(OverloadedError("queue full", retry_after_s=2.5)).to_exception()
    assert isinstance(overloaded, OverloadedError) and overloaded.retry_after_s == 2.5
    assert overloaded.message == "queue full"
    invalid = ErrorReport.from_exception(InvalidRequestError("bad")).to_exception()
    assert type(invalid) is InvalidRequestError and invalid.message == "bad"
    unknown = ErrorReport("NoSuchError", "boom").to_exception()
    assert isinstance(unknown, WorkerFailedError) and "boom" in unknown.message
    # Across Ray the report travels as the request's final delta (the one channel for errors).
    delta = ErrorReport.from_exception(OverloadedError("queue full", retry_after_s=2.5)).as_delta("r1")
    assert delta.finished and delta.finish_reason is FinishReason.ERROR and delta.request_id == "r1"
    again = ErrorReport.from_delta(delta).to_exception()
    assert isinstance(again, OverloadedError) and again.retry_after_s == 2.5 and again.message == "queue full"


@pytest.fixture(scope="module")
def actor_config(tiny_model_dir) -> KvmeshConfig:
    return KvmeshConfig.from_dict({
        "model": {"path": tiny_model_dir, "dtype": "fp32"},
        "cache": {"block_size": 16, "num_blocks": 96},
        "scheduler": {"max_num_seqs": 4, "max_new_tokens": 960},
        "parallel": {"num_workers": 1, "device": "cpu", "worker_num_cpus": 0.5},
        "router": {"stats_refresh_s": 0.1},
    })


@pytest.fixture(scope="module")
def worker(actor_config):
    import ray

    shared_ray()
    try:
        [handle] = start_workers(actor_config, APP_NAME)
        ray.get(handle.info.remote(), timeout=240)
        yield handle
    finally:
        kill_workers(actor_config, APP_NAME)


def _request(request_id: str, max_tokens: int, prompt: str = "a tiny worker test prompt " * 3) -> GenerateRequest:
    return GenerateRequest(request_id, prompt=prompt,
                           sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))


async def _collect(handle, request: GenerateRequest) -> list:
    items = []
    async for ref in handle.generate.options(num_returns="streaming").remote(request):
        items.append(await ref)
    return items


def _wait_idle(handle, timeout_s: float = 30.0):
    import ray

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        stats = ray.get(handle.stats.remote())
        if stats.num_running == 0 and stats.num_waiting == 0 and stats.num_blocks_used == 0:
            return stats
        time.sleep(0.05)
    raise AssertionError(f"worker not idle: {stats}")


@pytest.mark.e2e
def test_generate_streams_batches_of_deltas(worker):
    items = asyncio.run(_collect(worker, _request("batches", max_tokens=20)))
    assert items and all(isinstance(batch, list) and batch for batch in items)
    deltas = [d for batch in items for d in batch]
    assert all(isinstance(d, RequestDelta) and d.request_id == "batches" for d in deltas)
    assert deltas[-1].finished and deltas[-1].finish_reason is FinishReason.LENGTH
    assert sum(len(d.token_ids) for d in deltas) == deltas[-1].usage.completion_tokens == 20
    _wait_idle(worker)


@pytest.mark.e2e
def test_engine_errors_arrive_as_final_error_deltas(worker):
    [[delta]] = asyncio.run(_collect(worker, _request("too-long", max_tokens=2000)))
    assert delta.finished and delta.finish_reason is FinishReason.ERROR and delta.error_type == "InvalidRequestError"
    assert isinstance(ErrorReport.from_delta(delta).to_exception(), InvalidRequestError)


@pytest.mark.e2e
def test_abort_ends_the_stream_and_frees_blocks(worker):
    import ray

    _wait_idle(worker)

    async def scenario():
        stream = worker.generate.options(num_returns="streaming").remote(_request("to-abort", max_tokens=LONG))
        first = await (await stream.__anext__())
        assert await worker.abort.remote("to-abort") is True
        rest = [d for ref in [r async for r in stream] for d in await ref]
        return first + rest

    deltas = asyncio.run(scenario())
    assert deltas[-1].finished and deltas[-1].finish_reason is FinishReason.ABORT
    assert sum(len(d.token_ids) for d in deltas) < LONG
    assert ray.get(worker.abort.remote("to-abort")) is False  # finished: unknown now
    assert _wait_idle(worker).num_blocks_used == 0  # every block of the request returned


@pytest.mark.e2e
def test_cancelling_the_ray_stream_aborts_the_request(worker):
    import ray

    async def scenario():
        stream = worker.generate.options(num_returns="streaming").remote(_request("to-cancel", max_tokens=LONG))
        await (await stream.__anext__())
        ray.cancel(stream)

    asyncio.run(scenario())
    stats = _wait_idle(worker)
    assert stats.num_blocks_used == 0
    assert ray.get(worker.abort.remote("to-cancel")) is False


@pytest.mark.e2e
def test_a_resumption_takes_its_id_over_and_a_stale_abort_leaves_it_alone(worker):
    """A client resumes a stream through another router replica while the run it continues
    still streams here (its replica stopped or died before the abort landed): the resumption
    aborts that run and takes the id; the old replica's late abort, scoped to its channel, is
    a no-op. The same id without resume tokens is still refused."""
    import dataclasses

    from kvmesh.core import delta_wire
    from kvmesh.router.channel_connection import ChannelConnection

    _wait_idle(worker)

    def deltas_of(message: bytes, request_id: str = "taken") -> list[RequestDelta]:
        return delta_wire.to_request_deltas([i for i in delta_wire.decode(message)
                                             if delta_wire.request_id_of(i) == request_id])

    async def scenario():
        old = await ChannelConnection.open(worker, "replica-old")
        new = await ChannelConnection.open(worker, "replica-new")
        assert old.incarnation == new.incarnation  # the handshakes: this incarnation's id
        olds, news = old.messages(), new.messages()
        old.send([("s", _request("taken", LONG))])
        streamed = []
        while len(streamed) < 3:
            streamed += deltas_of(await anext(olds))
        new.send([("s", _request("taken", LONG))])  # the same id, no resume tokens
        refused = []
        while not refused:
            refused += deltas_of(await anext(news))
        assert refused[0].error_type == "InvalidRequestError"
        token_ids = tuple(t for d in streamed for t in d.token_ids)
        resumed = dataclasses.replace(_request("taken", len(token_ids) + 8), resume_token_ids=token_ids,
                                      resume_text_chars=sum(len(d.text) for d in streamed))
        new.send([("s", resumed)])
        while not (streamed and streamed[-1].finished):  # the old run ends: superseded
            streamed += deltas_of(await anext(olds))
        assert streamed[-1].finish_reason is FinishReason.ABORT
        assert await worker.abort.remote("taken", "replica-old") is False
        # The router's form of the late abort: an op on the old replica's socket, then a probe
        # behind it, so the abort has been handled once the probe's final comes back.
        old.send([("a", "taken"), ("s", _request("probe", 1))])
        probe = []
        while not (probe and probe[-1].finished):
            probe += deltas_of(await anext(olds), "probe")
        rest = []
        while not (rest and rest[-1].finished):
            rest += deltas_of(await anext(news))
        old.close()
        new.close()
        return rest

    rest = asyncio.run(scenario())
    assert rest[-1].finish_reason is FinishReason.LENGTH and sum(len(d.token_ids) for d in rest) == 8
    assert _wait_idle(worker).num_blocks_used == 0


@pytest.mark.e2e
def test_a_retry_through_another_replica_takes_over_its_orphaned_attempt(worker):
    """A client's first attempt reached this worker through a router replica that then died,
    before any token reached the client; the worker has not yet seen that replica's socket
    close, so the attempt still streams here. The client's plain retry (attempt 2, no resume
    tokens) comes through another replica: it ends the orphan and runs from the start. The
    same id as a first attempt (a live client's genuine duplicate) is still refused."""
    import dataclasses

    from kvmesh.core import delta_wire
    from kvmesh.router.channel_connection import ChannelConnection

    _wait_idle(worker)

    def deltas_of(message: bytes) -> list[RequestDelta]:
        return delta_wire.to_request_deltas([i for i in delta_wire.decode(message)
                                             if delta_wire.request_id_of(i) == "retried"])

    async def scenario():
        dead = await ChannelConnection.open(worker, "replica-dead")
        alive = await ChannelConnection.open(worker, "replica-alive")
        orphans, news = dead.messages(), alive.messages()
        dead.send([("s", _request("retried", LONG))])
        orphan = []
        while len(orphan) < 2:  # streaming: it holds the id
            orphan += deltas_of(await anext(orphans))
        alive.send([("s", _request("retried", 8))])  # attempt 1: a duplicate, refused
        refused = []
        while not refused:
            refused += deltas_of(await anext(news))
        assert refused[0].error_type == "InvalidRequestError" and "already in flight" in refused[0].error
        alive.send([("s", dataclasses.replace(_request("retried", 8), attempt=2))])
        retried = []
        while not (retried and retried[-1].finished):
            retried += deltas_of(await anext(news))
        assert retried[-1].finish_reason is FinishReason.LENGTH, retried[-1]
        while not (orphan and orphan[-1].finished):  # the orphan ended: superseded
            orphan += deltas_of(await anext(orphans))
        dead.close()
        alive.close()
        return orphan, retried

    orphan, retried = asyncio.run(scenario())
    assert orphan[-1].finish_reason is FinishReason.ABORT
    retried_ids = [t for d in retried for t in d.token_ids]
    orphan_ids = [t for d in orphan for t in d.token_ids]
    assert len(retried_ids) == 8  # the whole output, from the first token (greedy: the orphan's too)
    shared = min(8, len(orphan_ids))
    assert retried_ids[:shared] == orphan_ids[:shared]
    assert _wait_idle(worker).num_blocks_used == 0


@pytest.mark.e2e
def test_poll_and_extra_keys(worker, actor_config):
    import ray

    poll = ray.get(worker.poll.remote(0))
    assert isinstance(poll, WorkerPoll) and isinstance(poll.info, WorkerInfo)
    assert poll.info.worker_id == poll.stats.worker_id == "worker-0"
    assert poll.info.block_size == 16 and poll.stats.healthy
    assert poll.prefix_events.worker_id == "worker-0"
    keys = ray.get(worker.block_extra_keys.remote("tenant-salt"))
    assert keys == block_extra_keys(poll.info.model_name, actor_config.model.revision, keys[2].split("=", 1)[1],
                                    "tenant-salt")


@pytest.mark.e2e
def test_the_worker_process_starts_with_the_openmp_spin_count(worker):
    """libgomp reads GOMP_SPINCOUNT once, when torch loads it: it must be in the actor
    process's environment from its start (Ray's runtime_env), not set by the actor later."""
    import ray

    pid = ray.get(worker.__ray_call__.remote(lambda _self: os.getpid()))
    with open(f"/proc/{pid}/environ", "rb") as f:
        environ = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
    assert environ.get(b"GOMP_SPINCOUNT") == b"3000"


@pytest.mark.e2e
def test_pool_follows_a_killed_worker_through_its_restart(worker, actor_config):
    """Routable -> killed (not routable) -> restarted by Ray (routable again, new incarnation,
    prefix view rebuilt from the new process's events)."""
    import ray

    from kvmesh.router.worker_pool import WorkerPool

    asyncio.run(_collect(worker, _request("warm-prefix", max_tokens=2, prompt="shared prefix " * 20)))

    async def scenario():
        pool = WorkerPool(actor_config, APP_NAME)
        seen: list[list] = []
        pool.on_stats = lambda stats, taken_at: seen.append(stats)
        pool.start()
        try:
            assert await pool.wait_routable(timeout_s=60)
            old = pool.info("worker-0").incarnation
            assert pool.prefix_index.num_blocks("worker-0") > 0  # the cached prompt blocks
            pool.mark_failed("worker-0", "test: stream failed")
            assert pool.routable_ids() == [] and not pool.stats_for_routing()[0].healthy
            ray.kill(pool.handle("worker-0"), no_restart=False)
            await _until(lambda: pool.info("worker-0").incarnation != old, timeout_s=120)
            assert pool.prefix_index.num_blocks("worker-0") == 0  # the old cache died with it
            assert await pool.wait_routable(timeout_s=120)
            assert pool.stats_for_routing()[0].healthy and seen
        finally:
            await pool.close()

    asyncio.run(scenario())


async def _until(predicate, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)


@pytest.mark.e2e
def test_smollm2_actor_greedy_equals_engine(worker, smollm2_dir, actor_config):
    """The embedded model in a worker actor produces exactly the in-process engine's greedy
    text, for a plain prompt and a chat-templated one (the real model, so the text is sane)."""
    import concurrent.futures

    from kvmesh.worker.engine_loop.engine import Engine
    from kvmesh.worker.model.tokenizer import render_chat

    smol = actor_config.replace(model={"path": smollm2_dir})
    prompts = {"plain": "The capital of France is"}

    def local_greedy() -> dict[str, str]:
        engine = Engine.from_config(smol)
        prompts["chat"] = render_chat(engine.tokenizer, [{"role": "user", "content": "What is the capital of France?"}])
        for request_id, prompt in prompts.items():
            engine.add_request(GenerateRequest(request_id, prompt=prompt,
                                               sampling=SamplingParams(max_tokens=10, temperature=0.0)))
        texts = dict.fromkeys(prompts, "")
        while engine.has_unfinished():
            for delta in engine.step():
                texts[delta.request_id] += delta.text
        return texts

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        expected = pool.submit(local_greedy)  # loads while the actor loads
        [handle] = start_workers(smol, "kvmesh-actor-smol")
        try:
            texts = expected.result()
            served = {}
            for request_id, prompt in prompts.items():
                request = GenerateRequest(request_id, prompt=prompt, sampling=SamplingParams(max_tokens=10,
                                                                                             temperature=0.0))
                served[request_id] = "".join(d.text for batch in asyncio.run(_collect(handle, request))
                                             for d in batch)
        finally:
            kill_workers(smol, "kvmesh-actor-smol")
    assert served == texts
    assert "Paris" in texts["plain"] and "Paris" in texts["chat"]
