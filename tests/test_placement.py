"""An engine's placement: one bundle per tensor-parallel rank, exactly TP GPUs in all, on one node.

The e2e part runs a real local Ray cluster that declares 2 GPUs (Ray schedules GPU resources
without CUDA; the engine itself runs on CPU): a TP = 2 engine takes both and serves, a
TP = 3 engine is refused in seconds with the missing resource named."""

from __future__ import annotations

import os

import pytest

from kvmesh.core.config import ConfigError, KvmeshConfig, ParallelConfig
from kvmesh.core.seams import GenerateRequest, SamplingParams
from e2e_cluster import own_ray, wait_for
from kvmesh.worker.parallel.placement import (actor_resource_options, engine_bundles, engine_runtime_env,
                                              engine_total, missing_resources, rank_bundle)


def _parallel(**kw) -> ParallelConfig:
    return ParallelConfig(**{"worker_num_cpus": 1.0, "worker_resource": "GPU", **kw})


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_an_engine_asks_for_exactly_one_gpu_per_rank(tp):
    parallel = _parallel(tensor_parallel_size=tp)
    assert engine_bundles(parallel) == [{"CPU": 1.0, "GPU": 1.0}] * tp
    assert engine_total(parallel) == {"CPU": float(tp), "GPU": float(tp)}
    # rank 0 (the worker actor) holds one GPU like every peer, never TP of them
    assert actor_resource_options(rank_bundle(parallel)) == {"num_cpus": 1.0, "num_gpus": 1.0, "resources": {}}


def test_a_custom_resource_stands_in_for_gpus():
    parallel = _parallel(tensor_parallel_size=2, worker_resource="engine_slot", worker_num_cpus=0.5)
    assert engine_total(parallel) == {"CPU": 1.0, "engine_slot": 2.0}
    assert actor_resource_options(rank_bundle(parallel)) == {"num_cpus": 0.5, "num_gpus": 0.0,
                                                             "resources": {"engine_slot": 1.0}}


def test_an_engine_process_gets_the_openmp_spin_count():
    assert engine_runtime_env(_parallel()) == {"env_vars": {"GOMP_SPINCOUNT": "3000"}}
    assert engine_runtime_env(_parallel(cpu_spin_count=0)) == {"env_vars": {"GOMP_SPINCOUNT": "0"}}
    assert engine_runtime_env(_parallel(cpu_spin_count=None)) == {}  # libgomp's own, or the environment's
    with pytest.raises(ConfigError, match="cpu_spin_count"):
        KvmeshConfig.from_dict({"parallel": {"cpu_spin_count": -1}})


def test_missing_resources_names_the_scarce_one():
    need = {"CPU": 3.0, "GPU": 3.0}
    assert missing_resources(need, [{"CPU": 16.0, "GPU": 4.0}]) == ""
    why = missing_resources(need, [{"CPU": 16.0, "GPU": 2.0}, {"CPU": 2.0, "GPU": 1.0}])
    assert why == "GPU: needs 3 on one node, the largest node has 2"
    # enough of each in the cluster, but never on one node
    assert missing_resources(need, [{"CPU": 16.0, "GPU": 1.0}, {"CPU": 1.0, "GPU": 8.0}]) == (
        "no single node has all of them at once")
    assert missing_resources(need, []) == "the cluster has no alive node"


# ---- a real cluster that declares 2 GPUs -----------------------------------------------------

APP_NAME = "kvmesh-placement-test"


@pytest.fixture(scope="module")
def two_gpu_cluster():
    os.environ["RAY_AUTH_MODE"] = "disabled"
    import ray

    with own_ray(num_cpus=4, num_gpus=2):
        yield ray


def _tp_config(model_dir: str, tp: int) -> KvmeshConfig:
    return KvmeshConfig.from_dict({
        "model": {"path": model_dir, "dtype": "fp32"},
        "cache": {"block_size": 16, "num_blocks": 64},
        "scheduler": {"max_num_seqs": 2},
        "parallel": {"num_workers": 1, "tensor_parallel_size": tp, "device": "cpu", "worker_resource": "GPU",
                     "worker_num_cpus": 0.5, "placement_timeout_s": 2.0},
    })


async def _generate(handle, request: GenerateRequest) -> list[int]:
    tokens = []
    async for ref in handle.generate.options(num_returns="streaming").remote(request):
        tokens += [t for delta in await ref for t in delta.token_ids]  # each item: one step's deltas
    return tokens


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_tp2_engine_holds_exactly_the_two_declared_gpus_and_serves(two_gpu_cluster, tiny_model_dir):
    import asyncio

    from kvmesh.worker.runtime.actor import kill_workers, start_workers

    ray = two_gpu_cluster
    config = _tp_config(tiny_model_dir, 2)
    try:
        [handle] = start_workers(config, APP_NAME)
        ray.get(handle.info.remote(), timeout=240)  # rank 0 up, its peer loaded and joined
        assert ray.available_resources().get("GPU", 0.0) == 0.0  # the group holds both, no more
        request = GenerateRequest("tp2", prompt="placement of a tiny engine",
                                  sampling=SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        assert len(asyncio.run(_generate(handle, request))) == 4
    finally:
        kill_workers(config, APP_NAME)
    # the engine's group went with it: both GPUs free again
    wait_for(lambda: ray.available_resources().get("GPU", 0.0) == 2.0, what="the engine's GPUs to be released")


@pytest.mark.e2e
def test_tp3_on_two_gpus_is_refused_naming_the_gpu(two_gpu_cluster, tiny_model_dir):
    from kvmesh.worker.runtime.actor import start_workers

    ray = two_gpu_cluster
    with pytest.raises(ConfigError, match=r"GPU: needs 3 on one node, the largest node has 2"):
        start_workers(_tp_config(tiny_model_dir, 3), APP_NAME + "-tp3")
    # nothing left pending or held
    assert ray.available_resources().get("GPU", 0.0) == 2.0
