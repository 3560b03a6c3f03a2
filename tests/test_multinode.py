"""Multi-node behaviour on one machine: a real Ray cluster of three nodes (`ray.cluster_utils`
starts a raylet per node, all on loopback), Serve's real gRPC proxy, two worker actors
running the tiny Llama, the retrying `KvmeshClient`.

    head node      (2 CPUs, no GPU)   Serve controller + proxies, the router replica
    gpu node A     (0 CPUs, kvmesh_gpu: 1)   worker-i
    gpu node B     (0 CPUs, kvmesh_gpu: 1)   worker-j

`kvmesh_gpu` stands in for `GPU`: each worker asks one (parallel.worker_resource), so Ray
can place at most one per GPU node and none on the head. The GPU nodes offer no CPU, so the
router replica (0.25 CPU) can only land on the head, as in the Helm chart's head group.

The fault is `cluster.remove_node(..., allow_graceful=False)`: every process of the node is
SIGKILLed, which is what a lost machine looks like to Ray (the raylet stops answering the
GCS health checks; the worker process dies with it). Nothing is mocked.

Measured (printed, and recorded as junit properties):
  detection_s: remove_node starts -> the router reports the worker unhealthy (GetStats)
  recovery_s:  add_node starts -> first request served by the restarted worker
  node_up_s:   add_node starts -> the new raylet is registered (part of recovery_s)
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import grpc
import pytest

from kvmesh.core.config import KvmeshConfig
from kvmesh.proto import kvmesh_pb2 as pb
from kvmesh.proto import kvmesh_pb2_grpc
from e2e_cluster import stop_shared_ray, tiny_cluster_config

APP_NAME = "kvmesh-multinode"
GPU_RESOURCE = "kvmesh_gpu"
WORKER_IDS = ("worker-0", "worker-1")
# Long enough that every stream is still decoding when its node is killed, even on a fast
# idle machine (the model has 1024 positions); the survivors then finish in seconds.
IN_FLIGHT_MAX_TOKENS = 900
NUM_IN_FLIGHT = 6
# Ray's GCS declares a node dead after this many failed health checks of its raylet, one
# every period: ~1.5 s for a killed raylet (its checks fail at once) instead of Ray's default
# 15 s or more, so the test is bounded. A check that merely hangs gets Ray's own generous
# timeout (10 s), so that a live raylet slowed down by a busy machine is not declared dead (at
# 3 s a CI run lost the node added for the recovery while its worker restarted beside it).
HEALTH_CHECK_PERIOD_MS = 500
HEALTH_CHECK_TIMEOUT_MS = 10_000
HEALTH_CHECK_FAILURE_THRESHOLD = 3

# A bound on a hang, not a timing assertion: ~100 s on two busy cores, most of it starting
# three Ray nodes and loading the model in each worker.
# e2e: a Ray cluster with the Serve app (`pytest -m "not e2e"` skips the module)
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def multinode_config(tiny_model_dir) -> KvmeshConfig:
    # 512 blocks of 16 = 8192 tokens per worker: the whole load fits on the survivor.
    return tiny_cluster_config(tiny_model_dir, num_workers=2, num_blocks=512, max_new_tokens=960,
                               parallel={"worker_resource": GPU_RESOURCE, "worker_num_cpus": 0},
                               # Resumption off: this module checks that a lost node fails only
                               # its own streams and that clients' retries then succeed (resumed
                               # streams: tests/test_failover_resume_e2e.py).
                               router={"policy": "round_robin", "max_stream_resumptions": 0})


@pytest.fixture(scope="module")
def ray_cluster(multinode_config):
    """Head + two GPU nodes; Serve and the kvmesh app deployed on it."""
    import ray
    from ray.cluster_utils import Cluster

    from kvmesh.router.launch import start_serving, stop_serving

    stop_shared_ray()
    with pytest.MonkeyPatch.context() as env:  # read by the node processes Ray starts
        env.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # keep every node on loopback
        env.setenv("RAY_AUTH_MODE", "disabled")  # a private test cluster
        cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 2, "include_dashboard": False,
            "_system_config": {"health_check_initial_delay_ms": 0,
                               "health_check_period_ms": HEALTH_CHECK_PERIOD_MS,
                               "health_check_timeout_ms": HEALTH_CHECK_TIMEOUT_MS,
                               "health_check_failure_threshold": HEALTH_CHECK_FAILURE_THRESHOLD}})
        try:
            for _ in range(2):
                _add_gpu_node(cluster)
            ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
            start_serving(multinode_config, APP_NAME)
            yield cluster
        finally:
            if ray.is_initialized():
                stop_serving(multinode_config, APP_NAME)
                ray.shutdown()
            cluster.shutdown()


def _add_gpu_node(cluster):
    """A node offering one stand-in GPU and no CPU (so only a worker fits there)."""
    return cluster.add_node(num_cpus=0, resources={GPU_RESOURCE: 1})


@pytest.fixture(scope="module")
def stub(ray_cluster, multinode_config):
    channel = grpc.insecure_channel(f"127.0.0.1:{multinode_config.router.grpc_port}")
    yield kvmesh_pb2_grpc.KvmeshStub(channel)
    channel.close()


def _worker_node_ids() -> dict[str, str]:
    """worker id -> the Ray node its current incarnation runs on (asked of the actor)."""
    import ray

    from kvmesh.worker.runtime.actor import WORKER_NAMESPACE, worker_actor_name

    handles = {w: ray.get_actor(worker_actor_name(APP_NAME, i), namespace=WORKER_NAMESPACE)
               for i, w in enumerate(WORKER_IDS)}
    return {w: ray.get(h.info.remote(), timeout=60).node_id for w, h in handles.items()}


def _health(stub) -> dict[str, bool]:
    return {w.worker_id: w.healthy for w in stub.GetStats(pb.GetStatsRequest(), timeout=10).workers}


def _num_running(stub) -> dict[str, int]:
    return {w.worker_id: w.num_running for w in stub.GetStats(pb.GetStatsRequest(), timeout=10).workers}


def _all_decoding(stub) -> dict[str, int] | None:
    running = _num_running(stub)
    if sum(running.values()) == NUM_IN_FLIGHT and all(running.get(w) for w in WORKER_IDS):
        return running
    return None


def _wait_for(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")


def _served_by(stub, prompt: str) -> str:
    """One short greedy request; the worker that served it (trailing metadata)."""
    sampling = pb.SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    call = stub.Generate(pb.GenerateRequest(prompt=prompt, sampling=sampling), timeout=30)
    responses = list(call)
    assert responses[-1].finished and responses[-1].finish_reason == pb.FINISH_REASON_LENGTH
    return dict(call.trailing_metadata())["x-kvmesh-worker"]


class _AttemptRecorder(grpc.UnaryStreamClientInterceptor):
    """Keeps every Generate attempt's call, to read its status and `x-kvmesh-worker` later:
    the client library retries inside `generate` and does not expose its attempts."""

    def __init__(self):
        self.calls = []

    def intercept_unary_stream(self, continuation, client_call_details, request):
        call = continuation(client_call_details, request)
        self.calls.append(call)
        return call


@dataclass
class _Attempt:
    code: grpc.StatusCode
    worker_id: str | None  # only a completed call carries x-kvmesh-worker


@dataclass
class _LoadRequest:
    """One in-flight request of the load, driven by its own KvmeshClient in a thread."""

    index: int
    recorder: _AttemptRecorder = field(default_factory=_AttemptRecorder)
    first_delta: threading.Event = field(default_factory=threading.Event)
    restarts: int = 0
    completion_tokens: int = 0
    error: BaseException | None = None

    def run(self, target: str) -> None:
        from kvmesh.router.client import KvmeshClient, StreamRestart
        from kvmesh.core.seams import SamplingParams

        channel = grpc.intercept_channel(grpc.insecure_channel(target), self.recorder)
        sampling = SamplingParams(max_tokens=IN_FLIGHT_MAX_TOKENS, temperature=0.0, ignore_eos=True)
        try:
            # Restart, not resume: this test checks that exactly the lost node's streams fail
            # and start again on the survivor (resumption has its own tests).
            with KvmeshClient(target, channel=channel, restart_mid_stream=True, resume_mid_stream=False) as client:
                for item in client.generate(f"request {self.index} of the load " * 3, sampling=sampling,
                                            timeout_s=120):
                    self.first_delta.set()
                    if isinstance(item, StreamRestart):
                        self.restarts += 1
                    elif item.finished:
                        self.completion_tokens = item.usage.completion_tokens
        except BaseException as exc:  # reported by the test thread
            self.error = exc
        finally:
            self.first_delta.set()

    def attempts(self) -> list[_Attempt]:
        return [_Attempt(call.code(), dict(call.trailing_metadata() or ()).get("x-kvmesh-worker"))
                for call in self.recorder.calls]


def test_workers_placed_one_per_gpu_node(ray_cluster, stub):
    _wait_for(lambda: all(_health(stub).get(w) for w in WORKER_IDS), 120, "both workers routable")
    placed = _worker_node_ids()
    gpu_nodes = {node.node_id for node in ray_cluster.worker_nodes}
    assert len(set(placed.values())) == 2, placed
    assert set(placed.values()) == gpu_nodes
    assert ray_cluster.head_node.node_id not in placed.values()


def test_node_loss_fails_only_its_requests_then_recovers(ray_cluster, stub, multinode_config, record_property):
    _wait_for(lambda: all(_health(stub).get(w) for w in WORKER_IDS), 120, "both workers routable")
    placed = _worker_node_ids()
    victim, survivor = WORKER_IDS
    victim_node = next(n for n in ray_cluster.worker_nodes if n.node_id == placed[victim])

    load, threads = _start_load(f"127.0.0.1:{multinode_config.router.grpc_port}")
    # The router's stats lag its polls by up to one refresh: wait until they show all of the
    # load decoding, on both workers (round robin splits it 3 + 3).
    running = _wait_for(lambda: _all_decoding(stub), 30, "the whole load decoding on both workers")
    detection_s = _kill_node_and_time_detection(ray_cluster, victim_node, stub, victim)

    for thread in threads:
        thread.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    for request in load:
        assert request.error is None, (request.index, request.error)
        assert request.completion_tokens == IN_FLIGHT_MAX_TOKENS
    # Exactly the victim's in-flight requests failed (UNAVAILABLE, retryable), once each; the
    # client's retry restarted them and they completed on the survivor. The survivor, suddenly
    # holding the whole load, may first answer a restarted request RESOURCE_EXHAUSTED with a
    # retry-after (admission doing its job); the client backs off and retries until OK.
    failed_first = {r.index for r in load if r.attempts()[0].code != grpc.StatusCode.OK}
    assert len(failed_first) == running[victim], [r.attempts() for r in load]
    for request in load:
        attempts = request.attempts()
        assert attempts[-1] == _Attempt(grpc.StatusCode.OK, survivor), attempts
        if request.index in failed_first:
            codes = [a.code for a in attempts]
            assert codes[0] == grpc.StatusCode.UNAVAILABLE, attempts
            assert set(codes[1:-1]) <= {grpc.StatusCode.RESOURCE_EXHAUSTED}, attempts
            assert request.restarts == 1  # one mid-stream restart; refused retries delivered nothing
        else:
            assert len(attempts) == 1 and request.restarts == 0
    # While the node is gone, nothing is routed to its worker.
    assert _health(stub)[victim] is False
    assert {_served_by(stub, f"while down {i}") for i in range(3)} == {survivor}

    # The node comes back: Ray restarts the detached worker there, the router routes to it.
    added_at = time.monotonic()
    new_node = _add_gpu_node(ray_cluster)
    node_up_s = time.monotonic() - added_at  # the raylet registered; the worker starts next
    _wait_for(lambda: _served_by(stub, f"after recovery {time.monotonic()}") == victim, 120,
              "a request served by the restarted worker")
    recovery_s = time.monotonic() - added_at
    assert _worker_node_ids() == {victim: new_node.node_id, survivor: placed[survivor]}

    record_property("detection_s", round(detection_s, 2))
    record_property("recovery_s", round(recovery_s, 2))
    record_property("node_up_s", round(node_up_s, 2))
    print(f"\nmulti-node: detection {detection_s:.2f} s (kill -> router marks {victim} down), "
          f"recovery {recovery_s:.2f} s (add node -> first request served by the restarted {victim}; "
          f"the node itself was up after {node_up_s:.2f} s)")


def _start_load(target: str) -> tuple[list[_LoadRequest], list[threading.Thread]]:
    """NUM_IN_FLIGHT long streams, each in its own thread; returns once all are streaming."""
    load = [_LoadRequest(i) for i in range(NUM_IN_FLIGHT)]
    threads = [threading.Thread(target=r.run, args=(target,), daemon=True) for r in load]
    for thread in threads:
        thread.start()
    for request in load:
        assert request.first_delta.wait(60), f"request {request.index} produced nothing"
    return load, threads


def _kill_node_and_time_detection(cluster, node, stub, worker_id: str, timeout_s: float = 60.0) -> float:
    """SIGKILL every process of `node`; seconds from the kill until the router's GetStats
    reports `worker_id` unhealthy (watched from another thread: remove_node blocks)."""
    detected_at: list[float] = []
    give_up_at = time.monotonic() + timeout_s

    def watch_health():
        while not detected_at and time.monotonic() < give_up_at:
            if not _health(stub).get(worker_id, False):
                detected_at.append(time.monotonic())
            time.sleep(0.02)

    watcher = threading.Thread(target=watch_health, daemon=True)
    killed_at = time.monotonic()
    watcher.start()
    cluster.remove_node(node, allow_graceful=False)
    watcher.join()
    assert detected_at, f"the router did not mark {worker_id} down within {timeout_s:.0f}s"
    return detected_at[0] - killed_at
