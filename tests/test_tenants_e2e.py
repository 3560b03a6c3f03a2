"""Tenants, keys and Redis quotas across the real cluster: two router replicas (Serve) that
share one redis-server (the `redis_server` fixture, a real process on a loopback port), one
CPU worker with the tiny random Llama. Requests go through Serve's gRPC and HTTP proxies,
which spread them over both replicas.

The only injected fault is SIGKILL of the redis-server process (and a restart), which is
exactly what a crashed Redis looks like to the routers.
"""

from __future__ import annotations

import contextlib
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import pytest

from e2e_cluster import TEST_HASH_ITERATIONS, scrape, serving, settled_scrape, tiny_cluster_config, total, wait_for
from kvmesh.proto import kvmesh_pb2 as pb
from kvmesh.proto import kvmesh_pb2_grpc
from kvmesh.router.client import open_channel
from kvmesh.router.tenants import generate_api_key, hash_api_key

# e2e: a Ray cluster with the Serve app (`pytest -m "not e2e"` skips the module)
pytestmark = [pytest.mark.e2e, pytest.mark.shared_ray, pytest.mark.timeout(300)]

APP_NAME = "kvmesh-tenants"
# "stored" is added at run time through the tenant store, as `kvmesh tenants add` does.
KEYS = {tenant: generate_api_key() for tenant in ("conc", "bucket", "refund", "load", "outage", "stored")}
# Long enough (decode steps) that every admitted request is still running when the whole
# burst has been answered: admissions can then only come from the limit, not from a slot
# that freed up.
LONG_TOKENS = 480
CONCURRENCY_LIMIT = 3
BUCKET_OUTPUT_PER_MINUTE = 60  # refills 1 token/s: negligible over a test's few seconds
REFUND_OUTPUT_PER_MINUTE = LONG_TOKENS  # one long request's worth, refilling 8 tokens/s
RETRYABLE = {grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE}


@pytest.fixture(scope="module")
def spans_file(tmp_path_factory):
    """Every process of the cluster writes its spans here (OTLP/JSON lines, core/otlp_file.py)."""
    return tmp_path_factory.mktemp("spans") / "spans.jsonl"


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, redis_server, spans_file):
    tenants = {"auth_required": True, "redis_url": redis_server.url, "quota_probe_interval_s": 0.2,
               "tenant_refresh_s": 0.5, "tenants": [
        {"id": "conc", "api_key_hashes": [hash_api_key(KEYS["conc"], TEST_HASH_ITERATIONS)],
         "max_concurrent_requests": CONCURRENCY_LIMIT},
        {"id": "bucket", "api_key_hashes": [hash_api_key(KEYS["bucket"], TEST_HASH_ITERATIONS)],
         "output_tokens_per_minute": BUCKET_OUTPUT_PER_MINUTE},
        {"id": "refund", "api_key_hashes": [hash_api_key(KEYS["refund"], TEST_HASH_ITERATIONS)],
         "output_tokens_per_minute": REFUND_OUTPUT_PER_MINUTE},
        {"id": "load", "api_key_hashes": [hash_api_key(KEYS["load"], TEST_HASH_ITERATIONS)]},
        # While Redis is down each of the 2 replicas allows 4 / 2 = 2 at once.
        {"id": "outage", "api_key_hashes": [hash_api_key(KEYS["outage"], TEST_HASH_ITERATIONS)],
         "max_concurrent_requests": 4},
    ]}
    config = tiny_cluster_config(tiny_model_dir, num_workers=1, max_num_seqs=16,
                                 router={"num_replicas": 2, "policy": "least_loaded"}, tenants=tenants,
                                 observability={"tracing_exporter": "otlp", "otlp_endpoint": f"file://{spans_file}"})
    with serving(config, APP_NAME):
        yield config


@pytest.fixture(scope="module")
def http_base(cluster) -> str:
    return f"http://127.0.0.1:{cluster.router.http_port}"


@pytest.fixture(scope="module")
def channel(cluster):
    channel = grpc.insecure_channel(f"127.0.0.1:{cluster.router.grpc_port}")
    yield channel
    channel.close()


def _generate(stub, key: str | None, max_tokens: int, prompt: str = "hello tenants"):
    sampling = pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    metadata = (("authorization", f"Bearer {key}"),) if key else ()
    return stub.Generate(pb.GenerateRequest(prompt=prompt, sampling=sampling), metadata=metadata, timeout=120)


def _first_delta_or_error(stub, key: str, max_tokens: int):
    """('ok', stream) once the first delta arrived, or ('error', RpcError)."""
    stream = _generate(stub, key, max_tokens)
    try:
        next(stream)
    except grpc.RpcError as exc:
        return "error", exc
    return "ok", stream


def _quota_usage(config, tenant_id: str):
    """The tenant's QuotaUsage (in flight, bucket levels) in the Redis store the routers share."""
    import asyncio

    from kvmesh.router.quota import RedisQuotaStore
    from kvmesh.router.tenants import Tenant

    async def read():
        store = RedisQuotaStore(config.tenants.redis_url)
        try:
            tenant = next(Tenant.from_config(t) for t in config.tenants.tenants if t.id == tenant_id)
            return await store.usage(tenant)
        finally:
            await store.aclose()

    return asyncio.run(read())


def _per_replica(name: str, **labels) -> list[float]:
    """`name` summed per router replica, from the snapshots each replica publishes."""
    import ray
    from prometheus_client.parser import text_string_to_metric_families

    from kvmesh.router.metrics import get_board

    board = get_board(APP_NAME)
    out = []
    for blob in ray.get(board.snapshots.remote()):
        value = 0.0
        for family in text_string_to_metric_families(blob.decode()):
            for s in family.samples:
                if s.name == name and set(labels.items()) <= set(s.labels.items()):
                    value += s.value
        out.append(value)
    return out


def test_two_replicas_share_one_concurrency_limit_exactly(cluster, channel, http_base):
    """16 concurrent long requests of one tenant through both replicas: exactly the limit is
    admitted, every other one gets RESOURCE_EXHAUSTED (429 with Retry-After over HTTP)."""
    stub = kvmesh_pb2_grpc.KvmeshStub(channel)
    # Each request on a connection of its own, so the kernel spreads them over both replicas
    # sharing the gRPC port (SO_REUSEPORT); one connection stays on one replica.
    burst_channels = [open_channel(f"127.0.0.1:{cluster.router.grpc_port}", own_connection=True) for _ in range(16)]
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda c: _first_delta_or_error(kvmesh_pb2_grpc.KvmeshStub(c), KEYS["conc"],
                                                                LONG_TOKENS), burst_channels))
    admitted = [stream for kind, stream in results if kind == "ok"]
    errors = [exc for kind, exc in results if kind == "error"]
    try:
        assert len(admitted) == CONCURRENCY_LIMIT
        assert {e.code() for e in errors} == {grpc.StatusCode.RESOURCE_EXHAUSTED}
        # Serve's gRPC proxy drops a failed stream's trailing metadata (retry-after-ms), so
        # the retry-after is checked over HTTP while the limit is still held.
        reply = httpx.post(f"{http_base}/v1/completions", headers={"Authorization": f"Bearer {KEYS['conc']}"},
                           json={"prompt": "hi", "max_tokens": 4}, timeout=30)
        assert reply.status_code == 429 and int(reply.headers["retry-after"]) >= 1, reply.text
    finally:
        for stream in admitted:
            stream.cancel()
        for burst_channel in burst_channels:
            burst_channel.close()
    # Both replicas took part: each one admitted or rejected some of the burst.
    wait_for(lambda: len(_per_replica("kvmesh_rejections_total")) == 2, what="both replicas publishing")
    def burst_per_replica() -> list[float]:
        return [a + b for a, b in zip(_per_replica("kvmesh_rejections_total", reason="quota"),
                                      _per_replica("kvmesh_requests_total", tenant="conc"))]

    seen: list[float] = []
    try:
        wait_for(lambda: sum(seen.extend(burst_per_replica()) or seen[-2:]) >= 17, timeout_s=30,
                 what="the burst in both replicas' metrics")
    except AssertionError:
        raise AssertionError(f"per replica: {seen[-2:]}, quota rejections "
                             f"{_per_replica('kvmesh_rejections_total', reason='quota')}, requests "
                             f"{_per_replica('kvmesh_requests_total', tenant='conc')}") from None
    seen = seen[-2:]
    assert sum(seen) == 17, seen  # 16 gRPC + 1 HTTP, each counted by exactly one replica
    assert all(count > 0 for count in seen), seen
    # The cancelled ones released their slots in Redis: the limit is whole again.
    def whole_limit_admitted() -> bool:
        with ThreadPoolExecutor(CONCURRENCY_LIMIT) as pool:
            results = list(pool.map(lambda _: _first_delta_or_error(stub, KEYS["conc"], 4), range(CONCURRENCY_LIMIT)))
        for kind, stream in results:
            if kind == "ok":
                list(stream)
        return all(kind == "ok" for kind, _ in results)

    wait_for(whole_limit_admitted, timeout_s=20, what="the cancelled requests' slots released")


def test_settle_charges_what_ran_then_429_with_retry_after(cluster, channel, http_base):
    """60 output tokens a minute. A full request of 45 is charged 45 and one of 12 is charged
    12; a request of 30 then no longer fits (429, retry-after > 15 s at 1 token/s) while one
    of 2 does."""
    stub = kvmesh_pb2_grpc.KvmeshStub(channel)
    for max_tokens in (45, 12):
        assert list(_generate(stub, KEYS["bucket"], max_tokens))[-1].usage.completion_tokens == max_tokens
    reply = httpx.post(f"{http_base}/v1/completions", headers={"Authorization": f"Bearer {KEYS['bucket']}"},
                       json={"prompt": "hi", "max_tokens": 30}, timeout=30)
    assert reply.status_code == 429, reply.text
    # Left: 60 - 45 - 12 + refill = 3 + t; holding 30 takes 27 - t more seconds.
    assert int(reply.headers["retry-after"]) > 15
    assert list(_generate(stub, KEYS["bucket"], 2))[-1].usage.completion_tokens == 2


def _refund_bucket_level(cluster) -> tuple[float, float]:
    """(tokens in the 'refund' output bucket once nothing is in flight, monotonic time just
    before that read: any later refill happened after it)."""
    wait_for(lambda: _quota_usage(cluster, "refund").requests_in_flight == 0, timeout_s=30,
             what="the request settled in the shared store")
    read_at = time.monotonic()
    return _quota_usage(cluster, "refund").output_tokens_available, read_at


def test_cancelled_request_pays_for_what_it_generated_and_gets_the_rest_back(cluster, channel):
    """A bucket of one long request (480 output tokens a minute, 8/s). A request reserving
    all 480 is cancelled with the Cancel RPC after 40 tokens reached the client: its final
    message reports what it generated, the client saw exactly that, exactly that is charged
    and the rest comes back to the shared Redis bucket (up to the refill since it began).
    Then a client that simply goes away is settled too, paying at least what it received."""
    stub = kvmesh_pb2_grpc.KvmeshStub(channel)
    auth = (("authorization", f"Bearer {KEYS['refund']}"),)
    sampling = pb.SamplingParams(max_tokens=LONG_TOKENS, temperature=0.0, ignore_eos=True)
    start = time.monotonic()
    stream = stub.Generate(pb.GenerateRequest(prompt="refund me", sampling=sampling, request_id="refund-me"),
                           metadata=auth, timeout=120)
    received = 0
    while received < 40:
        received += len(next(stream).token_ids)
    assert stub.Cancel(pb.CancelRequest(request_id="refund-me"), metadata=auth, timeout=30).found
    rest = list(stream)
    assert rest[-1].finished and rest[-1].finish_reason == pb.FINISH_REASON_ABORT
    charged = rest[-1].usage.completion_tokens
    assert received + sum(len(r.token_ids) for r in rest) == charged
    assert 40 <= charged < LONG_TOKENS
    level, level_read_at = _refund_bucket_level(cluster)
    refill_max = (time.monotonic() - start) * REFUND_OUTPUT_PER_MINUTE / 60
    # level = min(480, 480 - 480 + refill + (480 - charged)) with 0 <= refill <= refill_max
    assert REFUND_OUTPUT_PER_MINUTE - charged <= level <= REFUND_OUTPUT_PER_MINUTE - charged + refill_max + 1e-3

    # The client disconnects instead: Serve cancels the router's stream (when that reaches the
    # router varies with load; the request may even finish first), which settles what it streamed.
    stream = _generate(stub, KEYS["refund"], 200)
    gone_after = sum(len(next(stream).token_ids) for _ in range(10))
    stream.cancel()
    after, _ = _refund_bucket_level(cluster)
    refill_max = (time.monotonic() - level_read_at) * REFUND_OUTPUT_PER_MINUTE / 60
    assert after <= min(REFUND_OUTPUT_PER_MINUTE, level + refill_max) - gone_after + 1e-3, (level, after)


def test_bad_and_missing_keys_are_rejected_before_any_work(cluster, channel, http_base):
    stub = kvmesh_pb2_grpc.KvmeshStub(channel)
    before = settled_scrape(http_base)
    bad_key = generate_api_key()  # well formed, owned by no tenant
    for key in (None, bad_key, "not-a-key"):
        with pytest.raises(grpc.RpcError) as rejected:
            list(_generate(stub, key, 4))
        assert rejected.value.code() == grpc.StatusCode.UNAUTHENTICATED
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        reply = httpx.post(f"{http_base}/v1/completions", headers=headers, timeout=30,
                           json={"prompt": "hi", "max_tokens": 4})
        assert reply.status_code == 401 and reply.json()["error"]["type"]
    after = wait_for(lambda: (s := scrape(http_base)) and total(s, "kvmesh_rejections_total", reason="unauthenticated")
                     - total(before, "kvmesh_rejections_total", reason="unauthenticated") == 6 and s,
                     timeout_s=15, what="6 unauthenticated rejections in /metrics")
    # Nothing ran: no request finished anywhere, no prompt token was counted.
    assert total(after, "kvmesh_requests_total") == total(before, "kvmesh_requests_total")
    assert total(after, "kvmesh_prompt_tokens_total") == total(before, "kvmesh_prompt_tokens_total")


def _load(stub, stop: threading.Event, outcomes: list, key: str = KEYS["load"]) -> None:
    while not stop.is_set():
        try:
            final = list(_generate(stub, key, 8))[-1]
            outcomes.append("ok" if final.usage.completion_tokens == 8 else "short")
        except grpc.RpcError as exc:
            outcomes.append(exc.code())


class _SpreadStub:
    """A Kvmesh stub whose every Generate opens its own connection (a subchannel pool of its
    own: gRPC otherwise shares one connection between channels)."""

    def __init__(self, cluster):
        self._target = f"127.0.0.1:{cluster.router.grpc_port}"

    def Generate(self, request, metadata=None, timeout=None):  # noqa: N802 (the stub's name)
        channel = open_channel(self._target, own_connection=True)
        try:
            yield from kvmesh_pb2_grpc.KvmeshStub(channel).Generate(request, metadata=metadata, timeout=timeout)
        finally:
            channel.close()


@contextlib.contextmanager
def _load_during(stub, redis_server, num_clients: int, key: str = KEYS["load"]):
    """`num_clients` threads streaming in a loop while the block runs; yields their outcomes
    ("ok" or a status code). Redis is running again afterwards whatever the block did."""
    stop, outcomes = threading.Event(), []
    threads = [threading.Thread(target=_load, args=(stub, stop, outcomes, key)) for _ in range(num_clients)]
    for t in threads:
        t.start()
    try:
        wait_for(lambda: len(outcomes) >= num_clients, what="load running")
        yield outcomes
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=120)
        if not redis_server.running:
            redis_server.restart()


def _fallback_flags(http_base: str) -> list[float]:
    samples = scrape(http_base)
    return sorted(v for (n, _), v in samples.items() if n == "kvmesh_quota_store_fallback_active")


def test_redis_killed_and_restarted_mid_load(cluster, channel, http_base, redis_server):
    """Load runs while Redis is SIGKILLed and restarted: no request is lost (each succeeds or
    gets a retryable code), both replicas flip to local limits (the metric says 1), the
    concurrency limit still holds locally (limit / replicas each), and both reconnect."""
    stub = kvmesh_pb2_grpc.KvmeshStub(channel)
    # Each request on a connection of its own: the replicas share the gRPC port and the kernel
    # spreads connections over them, so the load reaches both (as Serve's proxy spread calls).
    with _load_during(_SpreadStub(cluster), redis_server, 3) as outcomes:
        redis_server.kill()
        # A replica notices on its next quota call; the load's connections reach both.
        wait_for(lambda: _fallback_flags(http_base) == [1.0, 1.0], timeout_s=30, what="both replicas on fallback")
        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(lambda _: _first_delta_or_error(stub, KEYS["outage"], LONG_TOKENS), range(8)))
        admitted = [s for kind, s in results if kind == "ok"]
        for stream in admitted:
            stream.cancel()
        # Two replicas x (4 / 2): never more than the global limit, and the tenant is served.
        assert 1 <= len(admitted) <= 4
        assert {e.code() for kind, e in results if kind == "error"} <= {grpc.StatusCode.RESOURCE_EXHAUSTED}
        during = len(outcomes)
        redis_server.restart()
        wait_for(lambda: _fallback_flags(http_base) == [0.0, 0.0], timeout_s=30, what="both replicas back on Redis")
        wait_for(lambda: len(outcomes) >= during + 3, what="load served after the restart")
    assert outcomes.count("ok") >= 6
    assert set(outcomes) <= {"ok"} | RETRYABLE, set(outcomes)


def _stored_tenant_ids(redis_url: str) -> set[str]:
    import asyncio

    from kvmesh.router.tenants import RedisTenantStore

    async def read():
        store = RedisTenantStore(redis_url)
        try:
            return {t.id for t in await store.list()}
        finally:
            await store.aclose()

    return asyncio.run(read())


def test_redis_restarted_empty_mid_load_locks_nobody_out(cluster, channel, http_base, redis_server):
    """A tenant that exists only in the store (added as `kvmesh tenants add` does) keeps
    working while Redis is killed and comes back with no data: no request is refused as
    unauthenticated, the routers write the registry back, and the restore is counted."""
    import asyncio

    from kvmesh.router.tenants import RedisTenantStore, Tenant

    async def add():
        store = RedisTenantStore(redis_server.url)
        await store.put(Tenant(id="stored", api_key_hashes=(hash_api_key(KEYS["stored"], TEST_HASH_ITERATIONS),)))
        await store.aclose()

    asyncio.run(add())
    stub = kvmesh_pb2_grpc.KvmeshStub(channel)
    # Both replicas know the tenant: Serve spreads these over both (each refresh is 0.5 s).
    wait_for(lambda: all(_first_delta_or_error(stub, KEYS["stored"], 1)[0] == "ok" for _ in range(6)),
             what="the stored tenant authenticated on every replica")
    restores_before = total(scrape(http_base), "kvmesh_tenant_registry_restores_total")
    with _load_during(stub, redis_server, 4, KEYS["stored"]) as outcomes:
        redis_server.restart(empty=True)
        wait_for(lambda: "stored" in _stored_tenant_ids(redis_server.url), what="registry written back")
        during = len(outcomes)
        wait_for(lambda: len(outcomes) >= during + 4, what="load served after the empty restart")
        wait_for(lambda: total(scrape(http_base), "kvmesh_tenant_registry_restores_total") > restores_before,
                 what="the restore counted in /metrics")
    assert grpc.StatusCode.UNAUTHENTICATED not in outcomes
    assert outcomes.count("ok") >= 8
    assert set(outcomes) <= {"ok"} | RETRYABLE, set(outcomes)


def test_keys_never_appear_in_logs_spans_or_metrics(cluster, channel, http_base, spans_file):
    """After valid and invalid keys went through both protocols: no key, not even its secret
    part, in any Ray log of the session (router replicas, worker, proxies, Serve controller),
    in any span any process exported, or in the /metrics text (labels included)."""
    import pathlib

    import ray

    stub = kvmesh_pb2_grpc.KvmeshStub(channel)
    list(_generate(stub, KEYS["load"], 2))
    with pytest.raises(grpc.RpcError):
        list(_generate(stub, KEYS["load"] + "x", 2))
    headers = {"Authorization": f"Bearer {KEYS['load']}"}
    assert httpx.post(f"{http_base}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers=headers,
                      timeout=60).status_code == 200
    assert httpx.post(f"{http_base}/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                      headers={"Authorization": f"Bearer {KEYS['load']}x"}, timeout=60).status_code == 401
    logs_dir = pathlib.Path(ray._private.worker._global_node.get_logs_dir_path())
    files = [p for p in logs_dir.rglob("*") if p.is_file()]
    assert files
    # Spans are batched per process: wait until this test's requests have been exported.
    wait_for(lambda: spans_file.exists() and spans_file.read_text().count('"kvmesh.request"') >= 4,
             what="the requests' spans exported")
    texts = {str(path): path.read_bytes().decode(errors="replace") for path in files + [spans_file]}
    texts["/metrics"] = httpx.get(f"{http_base}/metrics", timeout=10).text
    secrets = [key.rsplit(".", 1)[1] for key in KEYS.values()]
    for where, text in texts.items():
        for secret in secrets:
            assert secret not in text, f"an API key secret appears in {where}"
    assert "tenant=\"load\"" in texts["/metrics"]  # the labels name the tenant, never its key
