"""End to end (real Ray, the Serve app, two router replicas, two workers running the tiny
random Llama): the cluster changing under load loses nothing.

* a worker killed mid-stream: every stream it was serving resumes on the survivor; the client
  sees one uninterrupted stream whose text and tokens equal the same request's greedy output
  without the failure, and the router counts the resumptions;
* a worker drained: it leaves the routable set, what it still runs moves to the other worker;
* `serve deploy` of a changed config: Serve replaces the router replicas one at a time, each
  drains (listener closed, its streams handed to the clients' resumption: the module's
  drain_grace_s is 0, so whatever a replica carries when it stops moves);
* a router replica killed: the kvmesh client resumes each of its streams on the other one.
Each stream equals its greedy reference: no token repeated or missing."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from e2e_cluster import scrape, serving, tiny_cluster_config, total, wait_for
from kvmesh.proto import kvmesh_pb2 as pb
from kvmesh.proto import kvmesh_pb2_grpc

APP_NAME = "kvmesh-failover"
NUM_STREAMS = 4
MAX_TOKENS = 240  # long enough to be mid-stream when the worker dies
PROMPTS = [f"Stream {i}: the inventory of the north warehouse lists" for i in range(NUM_STREAMS)]

pytestmark = [pytest.mark.e2e, pytest.mark.shared_ray, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def cluster(tiny_model_dir):
    config = tiny_cluster_config(tiny_model_dir, num_workers=2, num_blocks=256,
                                 router={"policy": "least_loaded", "num_replicas": 2, "drain_grace_s": 0.0})
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
    """The routable workers as a router replica sees them. The module's channel may have been
    on a replica that was replaced or killed since: asked again until a replica answers."""
    def workers():
        try:
            return list(stub.GetStats(pb.GetStatsRequest(), timeout=10).workers)
        except grpc.RpcError:
            return None

    return [w.worker_id for w in wait_for(workers, timeout_s=120, what="a router replica answering GetStats")
            if w.healthy]


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
DRAIN_ROUNDS = 5  # a fast machine (or a slow rollout: Serve may start the new replica first) can finish
# every stream before the fault lands; such a round is run again
DRAIN_PROMPTS = [f"Drain {i}: the ledger of the east harbour records" for i in range(DRAIN_STREAMS)]


@pytest.fixture(scope="module")
def reference(stub):
    """Each of the 16 DRAIN_PROMPTS' greedy output (text, token ids) with nothing failing."""
    from concurrent.futures import ThreadPoolExecutor

    wait_for(lambda: len(_healthy(stub)) == 2, timeout_s=120, what="two healthy workers")
    with ThreadPoolExecutor(DRAIN_STREAMS) as pool:
        return list(pool.map(lambda p: _stream(stub, p), DRAIN_PROMPTS))


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


def test_draining_a_worker_under_16_streams_moves_its_leftovers_and_fails_nothing(cluster, stub, reference):
    """Drain 1 of 2 workers while 16 streams run: it leaves the routable set at once (reported
    unhealthy), and the streams it still holds continue on the other worker from what they
    streamed: all 16 complete, each equal to its greedy reference. The drain has no grace, so
    what it holds when the call lands moves; a round where the victim's streams all ended
    before that (nothing moved) is run again."""
    from concurrent.futures import ThreadPoolExecutor

    import ray

    from kvmesh.worker.runtime.actor import WORKER_NAMESPACE, worker_actor_name

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


def _client_stream(target: str, prompt: str, started: threading.Event) -> tuple[tuple[str, list[int]], int]:
    """One stream through the kvmesh client on a connection of its own (gRPC shares one
    connection among a process's channels to a target unless told not to), so the 16 spread
    over both router replicas (SO_REUSEPORT) -> ((text, token ids), how many times it went
    back to the server)."""
    from kvmesh.core.seams import SamplingParams
    from kvmesh.router.client import KvmeshClient

    waits = []

    def sleep(delay_s: float) -> None:  # the client's wait before another attempt: counted
        waits.append(delay_s)
        time.sleep(delay_s)

    text, tokens = [], []
    try:
        with KvmeshClient(target, sleep=sleep, own_connection=True) as client:
            sampling = SamplingParams(max_tokens=DRAIN_MAX_TOKENS, temperature=0.0, ignore_eos=True)
            for delta in client.generate(prompt, sampling=sampling, timeout_s=240):
                text.append(delta.text)
                tokens.extend(delta.token_ids)
                if len(tokens) >= 3:
                    started.set()
    finally:
        started.set()
    return ("".join(text), tokens), len(waits)


def _router_replicas() -> dict[str, int]:
    from ray import serve

    deployments = serve.status().applications[APP_NAME].deployments.values()
    states: dict[str, int] = {}
    for deployment in deployments:
        for state, count in deployment.replica_states.items():
            states[str(state)] = states.get(str(state), 0) + count
    return {state: count for state, count in states.items() if count}


def _replica_actors() -> list[dict]:
    """The router replicas' live actors ({name, namespace})."""
    import ray

    return [a for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith("SERVE_REPLICA::") and APP_NAME in a["name"]]


def _two_running_replicas() -> bool:
    """Serve says two replicas run and no other exists, and two replica actors live (Serve's
    status lags a killed actor by its health check)."""
    return _router_replicas() == {"RUNNING": 2} and len(_replica_actors()) == 2


def _streams_under(cluster, reference, fault) -> list[int]:
    """16 client streams; `fault()` once each has streamed a few tokens. Every stream must
    equal its greedy reference. A round where no stream went back to the server (they all
    ended, or none ran on the replica hit, before the fault landed) is run again. Returns the
    number of streams that went back, per round."""
    from concurrent.futures import ThreadPoolExecutor

    target = f"127.0.0.1:{cluster.router.grpc_port}"
    went_back = []
    for _ in range(DRAIN_ROUNDS):
        wait_for(_two_running_replicas, timeout_s=120, what="two running router replicas")
        with ThreadPoolExecutor(DRAIN_STREAMS) as pool:
            started = [threading.Event() for _ in DRAIN_PROMPTS]
            futures = [pool.submit(_client_stream, target, p, e) for p, e in zip(DRAIN_PROMPTS, started)]
            for event in started:
                assert event.wait(120), "a stream never started"
            fault()
            results = [f.result(timeout=240) for f in futures]
        for i, (output, _) in enumerate(results):
            assert output == reference[i], f"stream {i} differs from its greedy reference"
        went_back.append(sum(1 for _, waits in results if waits))
        print(f"round {len(went_back)}: {went_back[-1]} of {DRAIN_STREAMS} streams went back to the server")
        if went_back[-1]:
            break
    assert went_back[-1], f"every round's streams ended before the fault landed ({went_back})"
    return went_back


def _streams_throughout(cluster, reference, fault) -> tuple[int, int]:
    """16 clients, each streaming its prompt again and again from before `fault()` starts
    until after it returns, so streams are always in flight whenever the fault lands (a
    rollout's moment of stopping an old replica is Serve's to choose: it may start the new
    one first and take seconds). Every stream must equal its greedy reference. Returns
    (streams run, streams that went back to the server)."""
    from concurrent.futures import ThreadPoolExecutor

    target = f"127.0.0.1:{cluster.router.grpc_port}"
    fault_over = threading.Event()

    def client(index: int) -> list[tuple[tuple[str, list[int]], int]]:
        runs = []
        while not runs or not fault_over.is_set():
            runs.append(_client_stream(target, DRAIN_PROMPTS[index], threading.Event()))
        return runs

    wait_for(_two_running_replicas, timeout_s=120, what="two running router replicas")
    with ThreadPoolExecutor(DRAIN_STREAMS) as pool:
        futures = [pool.submit(client, i) for i in range(DRAIN_STREAMS)]
        try:
            fault()
        finally:
            fault_over.set()
        runs = [f.result(timeout=240) for f in futures]
    for i, client_runs in enumerate(runs):
        for output, _ in client_runs:
            assert output == reference[i], f"a stream of prompt {i} differs from its greedy reference"
    streams = sum(len(r) for r in runs)
    went_back = sum(1 for r in runs for _, waits in r if waits)
    print(f"{streams} streams over the fault, {went_back} went back to the server")
    return streams, went_back


def _workers_idle() -> bool:
    """Both workers run and queue nothing and hold no KV block outside the prefix cache."""
    import ray

    from kvmesh.worker.runtime.actor import WORKER_NAMESPACE, worker_actor_name

    for index in range(2):
        stats = ray.get(ray.get_actor(worker_actor_name(APP_NAME, index), namespace=WORKER_NAMESPACE).stats.remote())
        if stats.num_running or stats.num_waiting or stats.num_blocks_used:
            return False
    return True


def test_serve_deploy_of_a_changed_config_under_16_streams_fails_nothing(cluster, reference):
    """`serve deploy` of a changed router config while 16 clients stream continuously: Serve
    replaces both router replicas, one at a time; each being replaced drains (drain_grace_s 0:
    the streams it carries end retryably at once, calls still starting or racing its stop are
    refused retryably) and its clients resume or retry on the other replica. 0 failed, each
    stream equal to its greedy reference, and the workers hold nothing afterwards."""
    from kvmesh.router.launch import redeploy_router

    deployed = [cluster]

    def redeploy() -> None:
        changed = deployed[-1].replace(router={"max_queue_len": deployed[-1].router.max_queue_len + 1})
        redeploy_router(changed, APP_NAME)
        deployed.append(changed)
        wait_for(_two_running_replicas, timeout_s=120, what="the old router replicas to stop")

    _, went_back = _streams_throughout(cluster, reference, redeploy)
    assert went_back >= 1, "no stream was in flight on a replica when Serve stopped it"
    wait_for(_workers_idle, timeout_s=60, what="both workers idle after the redeploy")


def test_a_router_replica_killed_under_16_streams_loses_no_token(cluster, reference):
    """SIGKILL-like death of one of the two router replicas (ray.kill) while 16 client streams
    run: the streams it carried break UNAVAILABLE and the kvmesh client resumes each on the
    other replica from the tokens it received (a resumption that reaches a worker still running
    the cut stream supersedes it there). A stream whose final message arrived just before the
    kill (its call still open while the replica settled it) is complete: not resumed. 0 failed,
    no token repeated or missing, and the workers end with nothing running (Serve starts a
    replacement replica)."""
    import ray

    def kill_a_replica() -> None:
        replicas = _replica_actors()
        assert len(replicas) == 2, (replicas, _router_replicas())
        ray.kill(ray.get_actor(replicas[0]["name"], namespace=replicas[0]["namespace"]), no_restart=True)

    _streams_under(cluster, reference, kill_a_replica)
    wait_for(_two_running_replicas, timeout_s=120, what="Serve's replacement for the killed replica")
    wait_for(_workers_idle, timeout_s=60, what="both workers idle after the replica's death")


def test_draining_the_whole_app_takes_every_worker_out_of_the_routable_set(cluster, stub):
    """What `kvmesh serve` runs on SIGTERM before it deletes the app (router/launch.py
    drain_serving) and `kvmesh drain` runs in a worker pod's preStop (drain_workers, here
    filtered to a node that runs none): the workers are found by name, each drained at once."""
    import ray

    from kvmesh.router.launch import drain_serving
    from kvmesh.worker.public_api import drain_workers
    from kvmesh.worker.runtime.actor import WORKER_NAMESPACE, worker_actor_name

    wait_for(lambda: len(_healthy(stub)) == 2, timeout_s=120, what="two healthy workers")
    assert drain_workers([APP_NAME], 0.0, node_id="f" * 56) == {}
    assert len(_healthy(stub)) == 2
    names = [worker_actor_name(APP_NAME, i) for i in range(2)]
    try:
        assert drain_serving(cluster.replace(router={"drain_grace_s": 1.0}), APP_NAME) == dict.fromkeys(names, 0)
        wait_for(lambda: not _healthy(stub), what="both workers out of the routable set")
    finally:
        ray.get([ray.get_actor(name, namespace=WORKER_NAMESPACE).undrain.remote() for name in names])
    wait_for(lambda: len(_healthy(stub)) == 2, what="both workers routable again after undrain")
