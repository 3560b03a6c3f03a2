"""The chaos campaign's machinery on a real cluster (Ray, the Serve app, two workers running
the tiny random Llama, a redis-server the router keeps its quota counts in): a short load
through the kvmesh client (its retries and resumption on) while the fault scheduler kills a
worker, stops Redis and drains a worker. Nothing may fail, every stream must be its prompt's
greedy output (references from an engine in this process), the workers must hold no KV block
at the end, and every fault must report a recovery time. (A router replica's death and a
redeploy take Serve seconds to mend: test_failover_resume_e2e covers them, the campaign does
them all.)"""

from __future__ import annotations

import asyncio

import pytest

from e2e_cluster import serving, tiny_cluster_config

APP_NAME = "kvmesh-chaos"

pytestmark = [pytest.mark.e2e, pytest.mark.shared_ray, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, redis_server):
    config = tiny_cluster_config(tiny_model_dir, num_workers=2, num_blocks=256,
                                 router={"policy": "least_loaded", "drain_grace_s": 0.0},
                                 tenants={"redis_url": redis_server.url, "quota_probe_interval_s": 0.2, "tenants": [
                                     {"id": "default", "output_tokens_per_minute": 10_000_000}]})
    with serving(config, APP_NAME) as served:
        yield served


def test_a_short_chaos_run_loses_nothing(cluster, redis_server, tiny_model_dir):
    from kvmesh.load_tests import chaos
    from kvmesh.load_tests.arrivals import ArrivalSpec
    from kvmesh.load_tests.corpus import TokenCorpus
    from kvmesh.load_tests.driver import DriverRetryPolicy, RunDriver, TenantStream
    from kvmesh.load_tests.faults import ChaosCluster, FaultPlan
    from kvmesh.load_tests.grpc_target import GrpcTarget
    from kvmesh.load_tests.workloads import LengthDistribution, WorkloadSpec, generate_workload
    from kvmesh.worker.engine_api import load_tokenizer

    corpus = TokenCorpus(load_tokenizer(cluster.model))
    # More requests than any machine sends before the three faults are done: the load ends
    # when the last fault has recovered (a counted fault plan stops it).
    spec = WorkloadSpec(kind="synthetic", num_requests=2000, seed=3, input=LengthDistribution(kind="fixed", mean=24),
                        output=LengthDistribution(kind="fixed", mean=32))
    streams = [TenantStream(requests=tuple(generate_workload(spec, corpus, "default", None)),
                            arrival=ArrivalSpec(process="closed", concurrency=6))]
    plan = FaultPlan(kinds=("kill_worker", "redis_stop", "drain_worker"), every_s=1.0, start_s=0.5,
                     count=3, drain_hold_s=0.5, recovery_timeout_s=90.0)
    faulted = ChaosCluster(cluster, APP_NAME, redis_server)

    async def run():
        target = GrpcTarget(f"127.0.0.1:{cluster.router.grpc_port}", client_retries=True, max_attempts=10)
        await target.start()
        try:
            driver = RunDriver(target, DriverRetryPolicy(), run_id="chaos", sample_interval_s=0.5, progress=False)
            result, outcomes = await chaos.drive_with_faults(driver, streams, plan, faulted)
            end = await chaos.settle(faulted, plan)
        finally:
            await target.close()
        return result, {"outcomes": outcomes, "end": end}

    result, partial = asyncio.run(run())
    report = chaos.finish(cluster, streams, result.records, partial)
    print(report["totals"], report["faults"], report["bad_streams"])
    assert redis_server.running  # settle started the stopped Redis again
    totals = report["totals"]
    assert [f["kind"] for f in report["faults"]] == list(plan.kinds)
    assert all(f["error"] is None and f["recovery_s"] is not None for f in report["faults"]), report["faults"]
    assert all(f["in_flight"] >= 1 for f in report["faults"]), report["faults"]
    assert totals["failed"] == 0 and totals["checked"] == len(result.records) < 2000
    assert totals["ok"] == totals["checked"], report["bad_streams"]
    assert totals["kv_blocks_used_end"] == 0 and totals["running"] == 0
