"""Fairness between tenants of equal priority, measured with real load on loopback.

Two tenants, same priority class, no quota limits (so nothing but scheduling protects the
light one). The heavy tenant keeps 6 x max_num_seqs requests outstanding (closed loop: an
overload on any CPU, however loaded the machine is; two batch slots and 48-token answers
keep the client's own work per unit of engine work small, so a starved client still
floods) and sends 4x the light tenant's requests, for LOAD_S seconds, through the real Serve gRPC ingress to one CPU worker. (An
open-loop rate derived from a measured capacity stopped being an overload once when the
shared machine sped up between the measurement and the flood.)

What is checked, and why by order. A request of the light tenant under load must wait for one
of the max_num_seqs batch slots to free (equal priority: running requests are not preempted
for it); with fair ranks (router/fairness.py) it then takes the next free slot, ahead of the
heavy tenant's queued backlog (about HEAVY_IN_FLIGHT - max_num_seqs requests at any moment).
A FIFO engine queue instead makes it wait behind that whole backlog (an open-loop flood
measured once with the fair rank switched off: light P90 TTFT 51.5 s). So the test counts,
for each light request, the heavy requests sent before it that got their first token after
it: FIFO gives about none, fair ranks about the whole backlog. Events are numbered in the
order the client sees them; no duration is compared (durations on a shared machine flake).

Router admission is given a KV budget larger than the run's backlog, so the queue being
tested is the engine's (router/fairness.py gives it per-tenant fair ranks).
"""

from __future__ import annotations

import asyncio
import itertools
import statistics
from dataclasses import dataclass

import grpc
import pytest

from e2e_cluster import TEST_HASH_ITERATIONS, serving, tiny_cluster_config
from kvmesh.proto import kvmesh_pb2 as pb
from kvmesh.proto import kvmesh_pb2_grpc
from kvmesh.router.fairness import RANK_SPAN, TenantBacklog, engine_priority
from kvmesh.router.tenants import generate_api_key, hash_api_key


APP_NAME = "kvmesh-fair"
KEYS = {"heavy": generate_api_key(), "light": generate_api_key()}
MAX_NUM_SEQS = 2
PROMPT_TOKENS = 32
MAX_TOKENS = 48
LOAD_S = 20.0
HEAVY_TO_LIGHT = 4
HEAVY_IN_FLIGHT = 6 * MAX_NUM_SEQS  # the flood: this many heavy requests always outstanding


def test_fair_rank_orders_by_backlog_within_a_class():
    backlog = TenantBacklog()
    heavy = [engine_priority(0, backlog.enter("heavy")) for _ in range(5)]
    light = engine_priority(0, backlog.enter("light"))
    assert heavy == [0, 1, 2, 3, 4] and light == 0  # the light tenant's first beats heavy's 2nd..5th
    assert engine_priority(1, 0) > engine_priority(0, RANK_SPAN + 5)  # the class dominates any backlog
    backlog.leave("heavy")
    assert backlog.in_flight("heavy") == 4
    with pytest.raises(AssertionError):
        backlog.leave("nobody")
    with pytest.raises(ValueError):
        engine_priority(0, -1)


@pytest.fixture(scope="module")
def cluster(tiny_model_dir):
    tenants = {"auth_required": True, "tenants": [
        {"id": tenant, "api_key_hashes": [hash_api_key(key, TEST_HASH_ITERATIONS)]} for tenant, key in KEYS.items()]}
    config = tiny_cluster_config(tiny_model_dir, num_workers=1, max_num_seqs=MAX_NUM_SEQS, num_blocks=4096,
                                 router={"policy": "least_loaded", "max_queue_len": 1024}, tenants=tenants)
    with serving(config, APP_NAME):
        yield config


@dataclass
class _Record:
    tenant: str
    sent: int  # event numbers, in the order the client saw the events
    first_token: int | None = None
    outcome: str = "open"  # done | failed; open: still waiting or streaming when the flood stopped


class _Client:
    """Open-loop gRPC streams on one asyncio loop (no thread per stream, so the client never
    queues requests itself); numbers each send and each first token in the order seen."""

    def __init__(self, stub):
        self._stub = stub
        self._events = itertools.count()
        self.records: list[_Record] = []
        self.failures: list[str] = []
        self._seq = 0

    async def request(self, tenant: str) -> None:
        self._seq += 1
        ids = [1000 + (self._seq * 97 + j) % 40000 for j in range(PROMPT_TOKENS)]  # distinct: no cache hits
        sampling = pb.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        record = _Record(tenant, next(self._events))
        self.records.append(record)
        call = self._stub.Generate(pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=ids), sampling=sampling),
                                   metadata=(("authorization", f"Bearer {KEYS[tenant]}"),), timeout=120)
        try:
            async for delta in call:
                if record.first_token is None and delta.token_ids:
                    record.first_token = next(self._events)
            record.outcome = "done"
        except asyncio.CancelledError:
            call.cancel()
            raise
        except grpc.RpcError as exc:
            record.outcome = "failed"
            self.failures.append(f"{tenant}: {exc.code()}")


async def _run_load(port: int) -> dict:
    """A warm-up request, then the flood; returns what the test asserts on."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        client = _Client(kvmesh_pb2_grpc.KvmeshStub(channel))
        await client.request("light")  # warm-up (first-use costs), not counted
        assert client.records[0].outcome == "done" and not client.failures, client.failures
        client.records.clear()
        light_tasks: list[asyncio.Task] = []
        num_heavy_sent = 0
        flooding = True

        async def heavy_user() -> None:
            # Closed loop: each heavy user sends its next request as soon as one ends, so
            # HEAVY_IN_FLIGHT requests are always outstanding, whatever the CPU's speed.
            nonlocal num_heavy_sent
            while flooding:
                num_heavy_sent += 1
                if num_heavy_sent % HEAVY_TO_LIGHT == 0:  # one light request per HEAVY_TO_LIGHT heavy ones
                    light_tasks.append(asyncio.create_task(client.request("light")))
                await client.request("heavy")

        heavy_users = [asyncio.create_task(heavy_user()) for _ in range(HEAVY_IN_FLIGHT)]
        await asyncio.sleep(LOAD_S)  # how long the flood lasts (nothing is timed)
        flooding = False
        # The light tenant's requests all finish; then the heavy backlog is dropped.
        await asyncio.wait_for(asyncio.gather(*light_tasks), timeout=120)
        for task in heavy_users:
            task.cancel()
        await asyncio.gather(*heavy_users, return_exceptions=True)
    return dict(client=client, num_light_sent=len(light_tasks), num_heavy_sent=num_heavy_sent)


def overtaken(light: _Record, heavy: list[_Record]) -> int:
    """Heavy requests sent before `light` that started after it: their first token came later,
    or never (still queued when the flood stopped). Refused ones never queued: not counted."""
    return sum(h.sent < light.sent and h.outcome != "failed"
               and (h.first_token is None or h.first_token > light.first_token) for h in heavy)


@pytest.mark.e2e
@pytest.mark.e2e
@pytest.mark.shared_ray
def test_light_tenant_overtakes_the_heavy_backlog_while_heavy_floods(cluster):
    run = asyncio.run(_run_load(cluster.router.grpc_port))
    client = run["client"]
    light = [r for r in client.records if r.tenant == "light" and r.outcome == "done"]
    heavy = [r for r in client.records if r.tenant == "heavy"]
    # The light tenant is never refused; the flood may be (overload), never failed otherwise.
    assert not [f for f in client.failures if not f.endswith("RESOURCE_EXHAUSTED")], client.failures
    assert not [f for f in client.failures if f.startswith("light")], client.failures
    assert len(light) == run["num_light_sent"] and all(r.first_token is not None for r in light)
    # The backlog stands once the flood's first HEAVY_IN_FLIGHT requests are out; the light
    # requests sent while it was forming have less to overtake and are not counted.
    flood_out = sorted(h.sent for h in heavy)[HEAVY_IN_FLIGHT - 1]
    counts = sorted(overtaken(r, heavy) for r in light if r.sent > flood_out)
    assert counts, "no light request was sent under the whole flood"
    backlog = HEAVY_IN_FLIGHT - MAX_NUM_SEQS
    print(f"heavy sent {run['num_heavy_sent']} ({HEAVY_IN_FLIGHT} outstanding), light {len(light)}; "
          f"heavy requests each light one overtook: {counts} (backlog about {backlog})")
    assert statistics.median(counts) >= backlog / 2, counts
