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
