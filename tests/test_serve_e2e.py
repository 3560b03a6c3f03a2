"""End to end: a real local Ray cluster, Serve's gRPC and HTTP proxies on real loopback
sockets, two worker actors running a tiny random Llama (text quality is irrelevant here;
greedy decoding makes outputs comparable). One cluster for the whole module.

The only injected fault is `ray.kill` of a worker actor, which is how a crashed GPU worker
looks to Ray (the process dies; Ray restarts it because of max_restarts).
"""

from __future__ import annotations

import os
import time

import grpc
import pytest

from kvmesh.core.config import KvmeshConfig
from kvmesh.proto import kvmesh_pb2 as pb
from kvmesh.proto import kvmesh_pb2_grpc
from e2e_cluster import own_ray, tiny_cluster_config

APP_NAME = "kvmesh-e2e"
# max_tokens of requests that must still be running when the test acts on them: far more
# decode steps than any machine finishes in the test's reaction time (the model has 1024
# positions).
LONG = 900

# e2e: a Ray cluster with the Serve app (`pytest -m "not e2e"` skips the module)
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


def test_serve_flags_map_onto_config(tmp_path):
    """`kvmesh serve` flags: the default topology fits the machine's cores; flags beat the
    file; --set beats flags. (No cluster: parsing only.)"""
    from kvmesh.deploy import cli
    from kvmesh.deploy.cmd_serve import config_from_args
    from kvmesh.router.launch import machine_topology

    parser = cli.build_parser()
    embedded = config_from_args(parser.parse_args(["serve"]))
    workers, threads = machine_topology(os.cpu_count() or 1)
    assert (embedded.parallel.num_workers, embedded.parallel.engine_threads()) == (workers, threads)
    assert embedded.router.sched_idle == (workers * threads >= (os.cpu_count() or 1))
    assert embedded.parallel.worker_num_cpus is None  # Ray's share: derived from the cluster at start
    assert embedded.model.path is None  # SmolLM2
    path = tmp_path / "kvmesh.yaml"
    path.write_text("parallel: {num_workers: 3}\nrouter: {policy: least_loaded, http_port: 9000}\n")
    config = config_from_args(parser.parse_args(
        ["serve", "--config", str(path), "--http-port", "9100", "--max-num-seqs", "5", "--tp", "2",
         "--set", "scheduler.max_num_seqs=7"]))
    assert config.parallel.num_workers == 3 and config.parallel.tensor_parallel_size == 2
    assert not config.router.sched_idle  # a config file: the machine defaults stay out
    assert config.router.policy == "least_loaded" and config.router.http_port == 9100
    assert config.scheduler.max_num_seqs == 7
    assert cli.main(["serve", "--workers", "0"]) == 2  # invalid config: exit 2, nothing started


@pytest.fixture(scope="module")
def e2e_config(tiny_model_dir) -> KvmeshConfig:
    # Spans go to the router replica's stdout, which Ray keeps in the session's logs.
    # worker_num_cpus left at its default (None): derived from the 2 CPUs the cluster has, so
    # test_health_models_metrics checks that the defaults bring up both workers.
    return tiny_cluster_config(tiny_model_dir, num_workers=2, num_blocks=128, max_new_tokens=960,
                               parallel={"worker_num_cpus": None},
                               router={"policy": "round_robin", "max_stream_resumptions": 0},  # see below
                               observability={"tracing_exporter": "console"})


@pytest.fixture(scope="module")
def cluster(e2e_config):
    os.environ["RAY_AUTH_MODE"] = "disabled"
    import ray

    from kvmesh.router.launch import start_serving, stop_serving

    with own_ray(num_cpus=2):  # a 2-CPU machine
        try:
            start_serving(e2e_config, APP_NAME)
            yield e2e_config
        finally:
            stop_serving(e2e_config, APP_NAME)


@pytest.fixture(scope="module")
def stub(cluster):
    channel = grpc.insecure_channel(f"127.0.0.1:{cluster.router.grpc_port}")
    yield kvmesh_pb2_grpc.KvmeshStub(channel)
    channel.close()


@pytest.fixture(scope="module")
def http_base(cluster) -> str:
    return f"http://127.0.0.1:{cluster.router.http_port}"


def _request(prompt: str, max_tokens: int = 8, ignore_eos: bool = True, request_id: str = "") -> pb.GenerateRequest:
    sampling = pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=ignore_eos)
    return pb.GenerateRequest(request_id=request_id, prompt=prompt, sampling=sampling)


def _wait_for(predicate, timeout_s: float = 30.0, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def _idle(stub) -> bool:
    """Every worker healthy, nothing running or waiting, no block referenced."""
    stats = stub.GetStats(pb.GetStatsRequest())
    return (len(stats.workers) == 2 and all(w.healthy for w in stats.workers)
            and all(w.num_running == 0 and w.num_waiting == 0 and w.num_blocks_used == 0 for w in stats.workers))


def test_grpc_stream_equals_engine_greedy(cluster, stub):
    from kvmesh.core.seams import GenerateRequest, SamplingParams
    from kvmesh.worker.engine_loop.engine import Engine

    prompt = "The quick brown fox jumps over the lazy dog because"
    responses = list(stub.Generate(_request(prompt, max_tokens=12)))
    streamed_ids = [t for r in responses for t in r.token_ids]
    final = responses[-1]
    assert final.finished and final.finish_reason == pb.FINISH_REASON_LENGTH
    assert final.usage.completion_tokens == 12 == len(streamed_ids)
    assert all(r.request_id == responses[0].request_id for r in responses) and responses[0].request_id

    engine = Engine.from_config(cluster)  # the same model and config, in this process
    engine.add_request(GenerateRequest("local", prompt=prompt,
                                       sampling=SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)))
    local = []
    while engine.has_unfinished():
        local.extend(engine.step())
    assert streamed_ids == [t for d in local for t in d.token_ids]
    assert "".join(r.text for r in responses) == "".join(d.text for d in local)
    assert final.usage.prompt_tokens == local[-1].usage.prompt_tokens


def test_openai_completions_and_chat(cluster, http_base):
    import openai

    client = openai.OpenAI(base_url=f"{http_base}/v1", api_key="unused", max_retries=0)
    [model] = client.models.list().data
    prompt = "kvmesh serves many tenants on a cluster of workers; " * 4  # > 2 KV blocks

    full = client.completions.create(model=model.id, prompt=prompt, max_tokens=6, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert full.choices[0].finish_reason == "length" and full.usage.completion_tokens == 6
    chunks = list(client.completions.create(model=model.id, prompt=prompt, max_tokens=6, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert chunks[-1].usage.completion_tokens == 6
    # Round robin over two workers: of four identical prompts at least one lands on a worker
    # that has the prompt's full blocks cached.
    cached = [client.completions.create(model=model.id, prompt=prompt, max_tokens=2, temperature=0)
              .usage.prompt_tokens_details.cached_tokens for _ in range(3)]
    assert max(cached + [chunks[-1].usage.prompt_tokens_details.cached_tokens]) >= 16

    messages = [{"role": "user", "content": "Say hello."}]
    chat = client.chat.completions.create(model=model.id, messages=messages, max_tokens=5, temperature=0)
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens >= 1
    stream = list(client.chat.completions.create(model=model.id, messages=messages, max_tokens=5, temperature=0,
                                                 stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == chat.choices[0].message.content
    assert stream[-1].choices[0].finish_reason == chat.choices[0].finish_reason


def test_health_models_metrics(cluster, http_base, stub):
    import httpx

    assert httpx.get(f"{http_base}/health").json()["num_healthy_workers"] == 2
    assert "kvmesh_requests" in httpx.get(f"{http_base}/metrics").text
    health = stub.Health(pb.HealthRequest())
    assert health.status == pb.HealthResponse.SERVING and health.num_healthy_workers == 2
    assert stub.ListModels(pb.ListModelsRequest()).models[0].block_size == 16


def test_bad_inputs_are_rejected(cluster, stub, http_base):
    import openai

    bad = [pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(max_tokens=0)),
           pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(temperature=-1.0)),
           pb.GenerateRequest(prompt="", sampling=pb.SamplingParams(max_tokens=4)),
           pb.GenerateRequest(prompt="hi", model="no-such-model"),
           pb.GenerateRequest(sampling=pb.SamplingParams(max_tokens=4))]
    for request in bad:
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(request))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, request

    client = openai.OpenAI(base_url=f"{http_base}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="", prompt="hi", max_tokens=4, temperature=-2)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="", messages=[], max_tokens=4)


def test_cancel_mid_stream_frees_blocks(cluster, stub):
    _wait_for(lambda: _idle(stub), what="idle workers")
    call = stub.Generate(_request("cancel me " * 10, max_tokens=LONG, request_id="to-cancel"))
    first = next(call)
    assert first.request_id == "to-cancel"
    assert stub.Cancel(pb.CancelRequest(request_id="to-cancel")).found
    rest = list(call)
    assert rest and rest[-1].finished and rest[-1].finish_reason == pb.FINISH_REASON_ABORT
    assert sum(len(r.token_ids) for r in [first, *rest]) < LONG
    _wait_for(lambda: _idle(stub), what="blocks freed after Cancel")
    assert not stub.Cancel(pb.CancelRequest(request_id="to-cancel")).found

    call = stub.Generate(_request("client goes away " * 10, max_tokens=LONG))
    next(call)
    call.cancel()  # the client disconnects: Serve cancels the replica's request
    _wait_for(lambda: _idle(stub), what="blocks freed after client cancel")


def test_http_client_disconnect_frees_blocks(cluster, stub, http_base):
    import httpx

    _wait_for(lambda: _idle(stub), what="idle workers")
    body = {"prompt": "an impatient reader " * 5, "max_tokens": LONG, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", f"{http_base}/v1/completions", json=body, timeout=60) as reply:
        assert reply.status_code == 200
        first = next(reply.iter_lines())
        assert first.startswith("data: ") and '"text_completion"' in first
    # The connection is closed mid-stream: the proxy cancels the replica's request.
    _wait_for(lambda: _idle(stub), what="blocks freed after the HTTP client left")


def test_deadline_exceeded(cluster, stub):
    _wait_for(lambda: _idle(stub), what="idle workers")
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(_request("slow " * 10, max_tokens=LONG), metadata=[("x-kvmesh-timeout-s", "0.5")]))
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(_request("slow " * 10, max_tokens=LONG), timeout=0.5))  # the client's deadline
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    _wait_for(lambda: _idle(stub), what="blocks freed after deadlines")


def _busy_worker(stub) -> str | None:
    running = [w.worker_id for w in stub.GetStats(pb.GetStatsRequest()).workers if w.num_running > 0]
    return running[0] if len(running) == 1 else None


def test_worker_killed_mid_stream(cluster, stub, http_base):
    """With resumption off (router.max_stream_resumptions = 0) a stream whose worker dies ends
    with UNAVAILABLE; with it on it resumes (tests/test_failover_resume_e2e.py)."""
    import httpx
    import ray

    from kvmesh.worker.runtime.actor import WORKER_NAMESPACE, worker_actor_name

    _wait_for(lambda: _idle(stub), what="idle workers")
    call = stub.Generate(_request("doomed " * 10, max_tokens=LONG))
    next(call)
    victim = _wait_for(lambda: _busy_worker(stub), what="the stream's worker")
    survivor = ({"worker-0", "worker-1"} - {victim}).pop()
    handle = ray.get_actor(worker_actor_name(APP_NAME, int(victim.split("-")[1])), namespace=WORKER_NAMESPACE)
    ray.kill(handle, no_restart=False)
    with pytest.raises(grpc.RpcError) as info:
        list(call)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE

    # The client retries: while the victim is down every request goes to the survivor.
    body = {"prompt": "retry " * 10, "max_tokens": 4, "temperature": 0}
    for _ in range(3):
        reply = httpx.post(f"{http_base}/v1/completions", json=body, headers={"x-kvmesh-attempt": "2"}, timeout=60)
        assert reply.status_code == 200, reply.text
        if not _victim_routable(stub, victim):
            assert reply.headers["x-kvmesh-worker"] == survivor

    # Ray restarts the victim; once its new incarnation answers, it is routed to again.
    _wait_for(lambda: _victim_routable(stub, victim), timeout_s=120, what="the restarted worker")
    served_by = {httpx.post(f"{http_base}/v1/completions", json=body, timeout=60).headers["x-kvmesh-worker"]
                 for _ in range(4)}
    assert served_by == {victim, survivor}


def _victim_routable(stub, victim: str) -> bool:
    return any(w.worker_id == victim and w.healthy for w in stub.GetStats(pb.GetStatsRequest()).workers)


def test_cli_generate_and_chat_against_server(cluster, stub, capsys, monkeypatch):
    import io

    from kvmesh.deploy import cli

    server = f"127.0.0.1:{cluster.router.grpc_port}"
    prompt = "Once upon a time"
    expected = "".join(r.text for r in stub.Generate(_request(prompt, max_tokens=6)))
    assert cli.main(["generate", prompt, "--server", server, "--max-tokens", "6", "--temperature", "0"]) == 0
    assert capsys.readouterr().out == expected

    assert cli.main(["generate", "x", "--server", server, "--max-tokens", "0"]) == 2  # INVALID_ARGUMENT
    assert "max_tokens" in capsys.readouterr().err

    def chat_turn(messages: list[dict]) -> str:
        chat = pb.ChatMessages(messages=[pb.ChatMessage(**m) for m in messages])
        sampling = pb.SamplingParams(max_tokens=4, temperature=0.0)
        return "".join(r.text for r in stub.Generate(pb.GenerateRequest(chat=chat, sampling=sampling)))

    history = [{"role": "user", "content": "Hello there"}]
    first = chat_turn(history)
    second = chat_turn(history + [{"role": "assistant", "content": first}, {"role": "user", "content": "And again"}])
    monkeypatch.setattr("sys.stdin", io.StringIO("Hello there\nAnd again\n"))
    assert cli.main(["chat", "--server", server, "--max-tokens", "4", "--temperature", "0"]) == 0
    assert capsys.readouterr().out == f"{first}\n{second}\n"  # the whole history is sent each turn


def test_trace_continues_the_callers_traceparent(cluster, http_base):
    """The caller's trace id reaches the router's spans and the worker's phase spans."""
    import glob
    import re

    import httpx
    import ray

    trace_id = os.urandom(16).hex()
    headers = {"traceparent": f"00-{trace_id}-{os.urandom(8).hex()}-01"}
    reply = httpx.post(f"{http_base}/v1/completions", headers=headers, timeout=60,
                       json={"prompt": "trace me", "max_tokens": 3, "temperature": 0})
    assert reply.status_code == 200
    logs = os.path.join(ray._private.worker.global_worker.node.get_session_dir_path(), "logs")

    # ConsoleSpanExporter prints each span as JSON: "name" first, then "context.trace_id".
    span_of_trace = re.compile(r'"name": "([^"]+)",\s*"context": \{\s*"trace_id": "0x' + trace_id)

    def spans_logged() -> bool:
        names = set()
        for path in glob.glob(os.path.join(logs, "**", "*.out"), recursive=True):
            with open(path, errors="replace") as fh:
                names.update(span_of_trace.findall(fh.read()))
        return {"kvmesh.request", "kvmesh.auth", "kvmesh.route", "kvmesh.stream", "kvmesh.worker.decode"} <= names

    _wait_for(spans_logged, timeout_s=30, what="the request's spans in the router's log")


def test_two_router_replicas_share_workers_and_cancel(cluster, stub):
    """Scaled to two router replicas: both see the same workers (their views come from the
    workers, not from each other), and Cancel works whichever replica receives it (it is
    broadcast to the workers), however Serve spreads the calls."""
    from ray import serve

    from kvmesh.router.app import build_router_app

    serve.run(build_router_app(cluster.replace(router={"num_replicas": 2})), name=APP_NAME, route_prefix="/")
    assert len(serve.status().applications[APP_NAME].deployments["KvmeshRouter"].replica_states) == 1
    assert serve.status().applications[APP_NAME].deployments["KvmeshRouter"].replica_states.get("RUNNING") == 2
    _wait_for(lambda: all(_idle(stub) for _ in range(4)), what="both replicas seeing idle workers")
    for i in range(6):
        call = stub.Generate(_request(f"replica cancel {i} " * 5, max_tokens=LONG, request_id=f"multi-{i}"))
        next(call)
        assert stub.Cancel(pb.CancelRequest(request_id=f"multi-{i}")).found
        assert list(call)[-1].finish_reason == pb.FINISH_REASON_ABORT
    _wait_for(lambda: all(_idle(stub) for _ in range(4)), what="blocks freed")
