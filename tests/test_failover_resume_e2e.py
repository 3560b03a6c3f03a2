"""End to end (real Ray, the Serve app, two workers running the tiny random Llama): a worker
killed mid-stream under load. Every stream it was serving resumes on the survivor: the client
sees one uninterrupted stream whose text and tokens equal the same request's greedy output
without the failure, and the router counts the resumptions."""

from __future__ import annotations

import threading

import grpc
import pytest

from e2e_cluster import scrape, serving, tiny_cluster_config, total, wait_for
from kvmesh.proto import kvmesh_pb2 as pb
from kvmesh.proto import kvmesh_pb2_grpc

APP_NAME = "kvmesh-failover"
NUM_STREAMS = 4
MAX_TOKENS = 240  # long enough to be mid-stream when the worker dies
PROMPTS = [f"Stream {i}: the inventory of the north warehouse lists" for i in range(NUM_STREAMS)]

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def cluster(tiny_model_dir):
    config = tiny_cluster_config(tiny_model_dir, num_workers=2, num_blocks=256,
                                 router={"policy": "least_loaded"})
    with serving(config, APP_NAME) as served:
        yield served


@pytest.fixture(scope="module")
def stub(cluster):
    channel = grpc.insecure_channel(f"127.0.0.1:{cluster.router.grpc_port}")
    yield kvmesh_pb2_grpc.KvmeshStub(channel)
    channel.close()


def _request(prompt: str) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt=prompt, sampling=pb.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                                                                        ignore_eos=True))


def _healthy(stub) -> list[str]:
    return [w.worker_id for w in stub.GetStats(pb.GetStatsRequest()).workers if w.healthy]


def test_streams_of_a_killed_worker_resume_on_the_survivor_with_the_same_text(cluster, stub):
    import ray

    from kvmesh.worker.runtime.actor import WORKER_NAMESPACE, worker_actor_name

    wait_for(lambda: len(_healthy(stub)) == 2, what="two healthy workers")
    reference = []
    for prompt in PROMPTS:
        responses = list(stub.Generate(_request(prompt)))
        reference.append(("".join(r.text for r in responses), [t for r in responses for t in r.token_ids]))

    started = [threading.Event() for _ in PROMPTS]
    results: list[tuple[str, list[int]] | BaseException | None] = [None] * NUM_STREAMS

    def consume(i: int) -> None:
        text, tokens = [], []
        try:
            for response in stub.Generate(_request(PROMPTS[i])):
                text.append(response.text)
                tokens.extend(response.token_ids)
                if len(tokens) >= 3:
                    started[i].set()
            results[i] = ("".join(text), tokens)
        except BaseException as exc:  # reported below, with the others' results
            results[i] = exc
        finally:
            started[i].set()

    threads = [threading.Thread(target=consume, args=(i,)) for i in range(NUM_STREAMS)]
    for thread in threads:
        thread.start()
    for event in started:
        assert event.wait(120), "a stream never started"
    busy = [w.worker_id for w in stub.GetStats(pb.GetStatsRequest()).workers if w.num_running > 0]
    assert busy, "the streams finished before the kill: raise MAX_TOKENS"
    victim = busy[0]
    ray.kill(ray.get_actor(worker_actor_name(APP_NAME, int(victim.split("-")[1])), namespace=WORKER_NAMESPACE),
             no_restart=False)
    for thread in threads:
        thread.join(240)

    for i, result in enumerate(results):
        assert not isinstance(result, BaseException), f"stream {i} failed: {result!r}"
        assert result == reference[i], f"stream {i} differs from its run without the failure"
    http_base = f"http://127.0.0.1:{cluster.router.http_port}"
    resumed = wait_for(lambda: total(scrape(http_base),
                                     "kvmesh_stream_resumptions_total", outcome="resumed"),
                       what="the resumption count in the router's metrics")
    assert 1 <= resumed <= NUM_STREAMS


DRAIN_STREAMS = 16
DRAIN_MAX_TOKENS = 200  # 16 streams' prompt + max_tokens fit one worker's KV budget (4,096 tokens)
DRAIN_ROUNDS = 3  # a fast machine can finish a worker's streams before the drain call lands
DRAIN_PROMPTS = [f"Drain {i}: the ledger of the east harbour records" for i in range(DRAIN_STREAMS)]


def _stream(stub, prompt: str, started: threading.Event | None = None) -> tuple[str, list[int]]:
    text, tokens = [], []
    try:
        request = _request(prompt)
        request.sampling.max_tokens = DRAIN_MAX_TOKENS
        for response in stub.Generate(request, timeout=240):
            text.append(response.text)
            tokens.extend(response.token_ids)
            if started is not None and len(tokens) >= 3:
                started.set()
    finally:
        if started is not None:
            started.set()
    return "".join(text), tokens


def test_draining_a_worker_under_16_streams_moves_its_leftovers_and_fails_nothing(cluster, stub):
    """Drain 1 of 2 workers while 16 streams run: it leaves the routable set at once (reported
    unhealthy), and the streams it still holds continue on the other worker from what they
    streamed: all 16 complete, each equal to its greedy reference. The drain has no grace, so
    what it holds when the call lands moves; a round where the victim's streams all ended
    before that (nothing moved) is run again."""
    from concurrent.futures import ThreadPoolExecutor

    import ray

    from kvmesh.worker.runtime.actor import WORKER_NAMESPACE, worker_actor_name

    wait_for(lambda: len(_healthy(stub)) == 2, timeout_s=120, what="two healthy workers")
    with ThreadPoolExecutor(DRAIN_STREAMS) as pool:
        reference = list(pool.map(lambda p: _stream(stub, p), DRAIN_PROMPTS))
    moves = []
    for _ in range(DRAIN_ROUNDS):
        with ThreadPoolExecutor(DRAIN_STREAMS) as pool:
            started = [threading.Event() for _ in DRAIN_PROMPTS]
            futures = [pool.submit(_stream, stub, p, e) for p, e in zip(DRAIN_PROMPTS, started)]
            for event in started:
                assert event.wait(120), "a stream never started"
            workers = stub.GetStats(pb.GetStatsRequest()).workers
            busy = sorted((w for w in workers if w.num_running > 0), key=lambda w: -w.num_running)
            assert busy, "every stream finished before the drain: raise DRAIN_MAX_TOKENS"
            victim_id = busy[0].worker_id
            victim = ray.get_actor(worker_actor_name(APP_NAME, int(victim_id.split("-")[1])),
                                   namespace=WORKER_NAMESPACE)
            moved = ray.get(victim.drain.remote(0.0))
            wait_for(lambda: victim_id not in _healthy(stub), what="the drained worker out of the routable set")
            results = [f.result(timeout=240) for f in futures]
        try:
            for i, result in enumerate(results):
                assert result == reference[i], f"stream {i} differs from its run without the drain"
            stats = ray.get(victim.stats.remote())
            assert stats.num_running == stats.num_waiting == 0 and stats.num_blocks_used == 0
        finally:
            ray.get(victim.undrain.remote())
        wait_for(lambda: len(_healthy(stub)) == 2, what="the worker routable again after undrain")
        moves.append(moved)
        if moved:
            break
    assert moves[-1] >= 1, f"every round's streams finished before the drain landed (moved {moves})"
