"""Prefix caching and KV sizing through the real engine (tiny random Llama)."""

import pytest

from kvmesh.core.config import KvmeshConfig
from kvmesh.core.seams import GenerateRequest, SamplingParams
from kvmesh.worker.engine_loop.engine import Engine

SYSTEM = "You are a careful assistant. Answer briefly and cite the rules you follow. " * 4


def _engine(model_dir, **cache):
    return Engine.from_config(KvmeshConfig.from_dict({
        "model": {"path": model_dir, "dtype": "fp32", "max_model_len": 512},
        "cache": {"num_blocks": 96, "block_size": 8, **cache}}))


def _generate(engine, rid, prompt, salt=None):
    engine.add_request(GenerateRequest(rid, prompt=prompt, cache_salt=salt,
                                       sampling=SamplingParams(max_tokens=8, temperature=0)))
    before = engine.num_forward_tokens
    out, final = [], None
    while engine.has_unfinished():
        for d in engine.step():
            out.extend(d.token_ids)
            final = d if d.finished else final
        engine.check_integrity()
    return out, final.usage, engine.num_forward_tokens - before


@pytest.fixture(scope="module")
def cached(tiny_model_dir):
    return _engine(tiny_model_dir)


def test_shared_system_prompt_computes_only_the_suffix(cached, tiny_model_dir):
    first, usage1, computed1 = _generate(cached, "a", SYSTEM + "Question one: what is two plus two?")
    second, usage2, computed2 = _generate(cached, "b", SYSTEM + "Question two: name a colour.")
    assert usage1.cached_tokens == 0
    assert usage2.cached_tokens >= 8 * ((usage2.prompt_tokens // 2) // 8), "most of the system prompt is reused"
    # Tokens through the model: the uncached prompt suffix plus one per generated token after the first.
    assert computed2 == usage2.prompt_tokens - usage2.cached_tokens + (len(second) - 1)
    assert computed1 == usage1.prompt_tokens + len(first) - 1
    plain = _engine(tiny_model_dir, enable_prefix_caching=False)
    again, usage3, _ = _generate(plain, "b", SYSTEM + "Question two: name a colour.")
    assert usage3.cached_tokens == 0
    assert again == second, "a cache hit gives the same greedy output as no cache"
    assert cached.stats().prefix_cache_hit_rate > 0


def test_tenant_salt_isolates_the_cache(cached):
    _generate(cached, "t1", SYSTEM + "Tenant question.", salt="tenant-a")
    _, same_tenant, _ = _generate(cached, "t2", SYSTEM + "Tenant question!", salt="tenant-a")
    _, other_tenant, _ = _generate(cached, "t3", SYSTEM + "Tenant question!", salt="tenant-b")
    assert same_tenant.cached_tokens > 0
    assert other_tenant.cached_tokens == 0
    assert cached.block_extra_keys("tenant-a") != cached.block_extra_keys("tenant-b")


@pytest.mark.parametrize("kv_dtype", ["auto", "bf16", "int8", "fp8"])
def test_allocated_kv_bytes_equal_the_capacity_model(tiny_model_dir, kv_dtype):
    engine = _engine(tiny_model_dir, kv_cache_dtype=kv_dtype, num_blocks=32)
    plan = engine.parts.plan
    allocated = sum(t.numel() * t.element_size() for c in engine.runner.kv_caches
                    for t in (c.key_cache, c.value_cache, c.key_scale, c.value_scale) if t is not None)
    assert allocated == plan.kv_bytes_per_token * plan.num_blocks * plan.block_size
    tokens, usage, _ = _generate(engine, "q", SYSTEM)
    assert len(tokens) == 8 and usage.completion_tokens == 8
    if kv_dtype in ("int8", "fp8"):
        assert engine.block_extra_keys() != _engine(tiny_model_dir, num_blocks=32).block_extra_keys(), \
            "quantized KV blocks never match unquantized ones in the prefix cache"
