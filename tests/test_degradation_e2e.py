"""The degradation ladder end to end: a real Ray cluster with the Serve app, one tiny-Llama
main worker and a one-worker fallback pool (int8 weights), requests over gRPC and HTTP.

The main pool is put under pressure by one long, important request (class -1, no rule) that
reserves all of the main worker's KV but HEADROOM tokens. Then, at once, one request per rung:

    class 0   rule: cap 32 tokens             asks 16 + 400 > headroom -> capped to 16 + 32
    class 1   rule: fallback                  asks 16 + 400 -> the fallback worker
    class 2   rule: queue 0.3 s, nothing else asks 16 + 400 -> RESOURCE_EXHAUSTED + retry-after
    class -1  no rule                         asks 16 + 16 (fits)  -> served as sent
    class 3   rule: queue 0.3 s, then cap 32  (several at once, last test)

(class = the request's priority field; HTTP requests, which have none, are class 0.)

and each response says what happened (trailing metadata x-kvmesh-degraded, the final
message's `degraded`, the HTTP header and usage field); kvmesh_degraded_total counts each
step. Afterwards every worker's KV is back to zero.
"""

from __future__ import annotations

import asyncio
import random
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import pytest

from e2e_cluster import scrape, serving, tiny_cluster_config, total, wait_for
from kvmesh.core.seams import SamplingParams
from kvmesh.load_tests.grpc_target import GrpcTarget
from kvmesh.load_tests.targets import TargetRequest
from kvmesh.proto import kvmesh_pb2 as pb
from kvmesh.proto import kvmesh_pb2_grpc
from kvmesh.router import status_map
from kvmesh.router.client import KvmeshClient
from kvmesh.router.degradation import DEGRADED_KEY

pytestmark = [pytest.mark.e2e, pytest.mark.shared_ray, pytest.mark.timeout(600)]

APP_NAME = "kvmesh-degradation-e2e"
PROMPT_TOKENS = 16
ASKED_TOKENS = 400
CAP_TOKENS = 32
HEADROOM = 256  # main-pool KV tokens left free by the long request: < 16 + 400, >= 16 + 32


@pytest.fixture(scope="module")
def cluster(tiny_model_dir):
    config = tiny_cluster_config(tiny_model_dir, num_workers=1, num_blocks=64, max_new_tokens=1000,
                                 router={"policy": "least_loaded", "max_queue_wait_s": 20.0})
    config = config.replace(degradation={
        "rules": [{"min_priority_class": 0, "cap_max_tokens": CAP_TOKENS},
                  {"min_priority_class": 1, "fallback": True},
                  {"min_priority_class": 2, "queue_wait_s": 0.3},
                  {"min_priority_class": 3, "queue_wait_s": 0.3, "cap_max_tokens": CAP_TOKENS}],
        "fallback_pool": {"num_workers": 1, "quant_weight": "int8", "max_num_seqs": 4}})
    with serving(config, APP_NAME) as config:
        with grpc.insecure_channel(f"127.0.0.1:{config.router.grpc_port}") as channel:
            stub = kvmesh_pb2_grpc.KvmeshStub(channel)
            wait_for(lambda: _routable(stub) == 2, timeout_s=180, what="main and fallback workers routable")
            yield config, stub


def _routable(stub) -> int:
    try:
        return stub.Health(pb.HealthRequest(), timeout=5).num_healthy_workers
    except grpc.RpcError:
        return 0


def _prompt(rng: random.Random) -> list[int]:
    return [rng.randrange(100, 40_000) for _ in range(PROMPT_TOKENS)]  # no shared prefix


def _request(rng: random.Random, max_tokens: int, priority: int) -> pb.GenerateRequest:
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return KvmeshClient.build_request(None, None, _prompt(rng), sampling, "", None, priority)


def _call(stub, request: pb.GenerateRequest) -> dict:
    """One Generate: its messages, trailing metadata and status."""
    call = stub.Generate(request, timeout=120)
    messages = []
    try:
        messages = list(call)
    except grpc.RpcError:
        pass
    return {"messages": messages, "code": call.code(), "details": call.details(),
            "trailers": dict(call.trailing_metadata() or ())}


def _main_worker(stub) -> pb.WorkerStats:
    workers = stub.GetStats(pb.GetStatsRequest(), timeout=10).workers
    return next(w for w in workers if w.worker_id == "worker-0")


def test_each_ladder_step_tells_the_client_what_happened(cluster):
    config, stub = cluster
    rng = random.Random(18)
    capacity = _main_worker(stub).kv_tokens_capacity
    block = config.cache.block_size
    long_max_tokens = capacity - HEADROOM - PROMPT_TOKENS  # whole blocks: both are multiples of 16
    assert long_max_tokens % block == 0 and long_max_tokens + PROMPT_TOKENS <= 1000

    # The pressure: one important request holding all but HEADROOM of the main worker's KV.
    long_call = stub.Generate(_request(rng, long_max_tokens, priority=-1), timeout=120)
    first = threading.Event()
    long_messages: list = []

    def drain_long():
        for message in long_call:
            long_messages.append(message)
            if message.token_ids:
                first.set()

    drainer = threading.Thread(target=drain_long, daemon=True)
    drainer.start()
    assert first.wait(60), "the long request produced no token"

    rungs = {"cap": _request(rng, ASKED_TOKENS, 0), "fallback": _request(rng, ASKED_TOKENS, 1),
             "reject": _request(rng, ASKED_TOKENS, 2), "fits": _request(rng, 16, -1)}
    with ThreadPoolExecutor(len(rungs)) as pool:
        futures = {name: pool.submit(_call, stub, req) for name, req in rungs.items()}
        results = {name: f.result() for name, f in futures.items()}
    drainer.join(120)
    long_final = long_messages[-1]
    # The pressure lasted through the rungs: the long request ran to its full length after them.
    assert long_final.finished and long_final.finish_reason == pb.FINISH_REASON_LENGTH
    assert long_final.usage.completion_tokens == long_max_tokens and long_final.degraded == ""

    cap = results["cap"]
    assert cap["code"] == grpc.StatusCode.OK
    assert cap["trailers"][DEGRADED_KEY] == "cap" and cap["trailers"]["x-kvmesh-worker"] == "worker-0"
    final = cap["messages"][-1]
    assert final.degraded == "cap" and final.finish_reason == pb.FINISH_REASON_LENGTH
    assert final.usage.completion_tokens == CAP_TOKENS

    fallback = results["fallback"]
    assert fallback["code"] == grpc.StatusCode.OK
    assert fallback["trailers"][DEGRADED_KEY] == "fallback"
    assert fallback["trailers"]["x-kvmesh-worker"] == "fallback-0"
    final = fallback["messages"][-1]
    assert final.degraded == "fallback" and final.usage.completion_tokens == ASKED_TOKENS  # not capped

    reject = results["reject"]
    assert reject["code"] == grpc.StatusCode.RESOURCE_EXHAUSTED and not reject["messages"]
    assert DEGRADED_KEY not in reject["trailers"]
    retry_after_s = status_map.retry_after_from_status(tuple(reject["trailers"].items()), reject["details"])
    assert retry_after_s is not None and retry_after_s > 0

    fits = results["fits"]
    assert fits["code"] == grpc.StatusCode.OK and DEGRADED_KEY not in fits["trailers"]
    assert fits["messages"][-1].degraded == "" and fits["messages"][-1].usage.completion_tokens == 16

    samples = scrape(f"http://127.0.0.1:{config.router.http_port}")
    assert [total(samples, "kvmesh_degraded_total", step=s) for s in ("cap", "fallback", "reject")] == [1, 1, 1]
    _assert_kv_returns_to_zero(stub)


def test_http_and_the_load_driver_s_grpc_target_see_the_cap(cluster):
    config, stub = cluster
    rng = random.Random(19)
    capacity = _main_worker(stub).kv_tokens_capacity
    long_call = stub.Generate(_request(rng, capacity - HEADROOM - PROMPT_TOKENS, priority=-1), timeout=120)
    messages = iter(long_call)
    while not next(messages).token_ids:  # admitted and running: the main pool is under pressure
        pass
    body = {"prompt": _prompt(rng), "max_tokens": ASKED_TOKENS, "temperature": 0.0, "ignore_eos": True}
    load_request = TargetRequest("load-1", tuple(_prompt(rng)), "", ASKED_TOKENS)  # the load driver's view
    with ThreadPoolExecutor(2) as pool:  # together
        http = pool.submit(httpx.post, f"http://127.0.0.1:{config.router.http_port}/v1/completions", json=body,
                           timeout=60)
        chunks = pool.submit(asyncio.run, _target_chunks(f"127.0.0.1:{config.router.grpc_port}", load_request))
        response, chunks = http.result(), chunks.result()
    rest = list(messages)
    assert rest[-1].finish_reason == pb.FINISH_REASON_LENGTH  # it held the pool until the end
    # The load driver's gRPC target reads the flag (RequestRecord.degraded comes from it).
    assert chunks[-1].finished and chunks[-1].degraded and chunks[-1].completion_tokens == CAP_TOKENS
    assert response.status_code == 200, response.text
    assert response.headers[DEGRADED_KEY] == "cap"
    result = response.json()
    assert result["usage"]["kvmesh_degraded"] == "cap" and result["usage"]["completion_tokens"] == CAP_TOKENS
    assert result["choices"][0]["finish_reason"] == "length"
    _assert_kv_returns_to_zero(stub)


def test_requests_that_queue_and_step_down_together_are_all_capped_while_the_cap_has_room(cluster):
    """Four class-3 requests at once, right after the pressure starts: each waits its rule's
    0.3 s in the admission lane, then steps down to the cap; 4 x (16 + 32) fits the headroom,
    so every one gets its capped tokens, none is refused because another still waits."""
    config, stub = cluster
    rng = random.Random(20)
    capacity = _main_worker(stub).kv_tokens_capacity
    long_call = stub.Generate(_request(rng, capacity - HEADROOM - PROMPT_TOKENS, priority=-1), timeout=120)
    messages = iter(long_call)
    while not next(messages).token_ids:
        pass
    requests = [_request(rng, ASKED_TOKENS, 3) for _ in range(4)]
    assert 4 * (PROMPT_TOKENS + CAP_TOKENS) <= HEADROOM
    with ThreadPoolExecutor(len(requests)) as pool:
        results = list(pool.map(lambda request: _call(stub, request), requests))
    assert list(messages)[-1].finish_reason == pb.FINISH_REASON_LENGTH  # the pressure lasted
    for result in results:
        assert result["code"] == grpc.StatusCode.OK, result["details"]
        assert result["trailers"][DEGRADED_KEY] == "cap" and result["trailers"]["x-kvmesh-worker"] == "worker-0"
        final = result["messages"][-1]
        assert final.degraded == "cap" and final.usage.completion_tokens == CAP_TOKENS
    _assert_kv_returns_to_zero(stub)


async def _target_chunks(address: str, request: TargetRequest) -> list:
    target = GrpcTarget(address)
    await target.start()
    try:
        return [chunk async for chunk in target.stream(request)]
    finally:
        await target.close()


def _assert_kv_returns_to_zero(stub) -> None:
    def idle():
        workers = stub.GetStats(pb.GetStatsRequest(), timeout=10).workers
        return len(workers) == 2 and all(w.kv_tokens_used == 0 and w.kv_tokens_reserved == 0 for w in workers)

    wait_for(idle, timeout_s=30, what="every worker's KV back to zero")
