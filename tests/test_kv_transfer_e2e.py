"""End to end over real Ray (two worker actors, tiny random Llama, host tier on): a worker told
that another holds the prompt's prefix (GenerateRequest.kv_source) pulls the blocks through an
actor call and serves them as cache hits with the same greedy tokens; a failed pull falls back
to recompute; another tenant's salted blocks never travel; the transfer shows in the metrics."""

from __future__ import annotations

import asyncio
import os

import pytest

from e2e_cluster import shared_ray
from kvmesh.core.config import KvmeshConfig
from kvmesh.core.seams import GenerateRequest, SamplingParams
from kvmesh.worker.runtime.actor import kill_workers, start_workers

APP_NAME = "kvmesh-transfer"
FAMILY = "Family {i} runbook: page the on-call, freeze deploys, open the incident doc, and post updates " \
         "every half hour until the all-clear from the incident commander. "

pytestmark = [pytest.mark.e2e, pytest.mark.shared_ray, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def workers(tiny_model_dir):
    import ray

    config = KvmeshConfig.from_dict({
        "model": {"path": tiny_model_dir, "dtype": "fp32"},
        "cache": {"block_size": 16, "num_blocks": 96, "host_tier_num_blocks": 64, "kv_transfer": "always"},
        "scheduler": {"max_num_seqs": 4},
        "parallel": {"num_workers": 2, "device": "cpu", "worker_num_cpus": 0.5},
    })
    shared_ray()
    try:
        handles = start_workers(config, APP_NAME)
        infos = ray.get([h.info.remote() for h in handles], timeout=240)
        yield list(zip(handles, infos))
    finally:
        kill_workers(config, APP_NAME)


def _run(handle, rid: str, prompt: str, kv_source: str | None = None, salt: str | None = None):
    request = GenerateRequest(rid, prompt=prompt, kv_source=kv_source, cache_salt=salt,
                              sampling=SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))

    async def collect():
        return [d for ref in [r async for r in handle.generate.options(num_returns="streaming").remote(request)]
                for d in await ref]

    deltas = asyncio.run(collect())
    assert deltas[-1].finished and deltas[-1].error is None, deltas[-1]
    return [t for d in deltas for t in d.token_ids], deltas[-1].usage


def _counter(handle, name: str) -> float:
    import ray
    from prometheus_client.parser import text_string_to_metric_families

    text = ray.get(handle.poll.remote(0)).metrics_snapshot.decode()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


def test_a_pulled_prefix_is_served_as_hits_with_the_same_tokens(workers):
    (holder, holder_info), (puller, _) = workers
    prompt = FAMILY.format(i=0)
    _run(holder, "warm", prompt + "First?")
    expected, _ = _run(holder, "reference", prompt + "Second?")
    tokens, usage = _run(puller, "pulled", prompt + "Second?", kv_source=holder_info.actor_name)
    assert usage.cached_tokens >= 16 * ((usage.prompt_tokens - 16) // 16), "the shared prefix came from the holder"
    assert tokens == expected
    assert _counter(puller, "kvmesh_kv_transfer_blocks_total") * 16 >= usage.cached_tokens
    assert _counter(puller, "kvmesh_kv_tier_bytes_total") > 0


def test_a_failed_pull_recomputes(workers):
    (holder, _), (puller, _) = workers
    prompt = FAMILY.format(i=1)
    expected, _ = _run(holder, "reference-1", prompt + "Second?")
    before = _counter(puller, "kvmesh_kv_transfer_fallbacks_total")
    tokens, usage = _run(puller, "no-holder", prompt + "Second?", kv_source="kvmesh-no-such-worker")
    assert tokens == expected and usage.cached_tokens == 0
    assert _counter(puller, "kvmesh_kv_transfer_fallbacks_total") == before + 1


def test_another_tenants_blocks_never_travel(workers):
    (holder, holder_info), (puller, _) = workers
    prompt = FAMILY.format(i=2)
    _run(holder, "tenant-a", prompt + "First?", salt="a")
    before = _counter(puller, "kvmesh_kv_transfer_blocks_total")
    _, usage = _run(puller, "tenant-b", prompt + "Second?", kv_source=holder_info.actor_name, salt="b")
    assert usage.cached_tokens == 0 and _counter(puller, "kvmesh_kv_transfer_blocks_total") == before
