"""Prefix caching and KV sizing through the real engine (tiny random Llama)."""

import pytest
from engine_runs import generate_greedy, tiny_engine

from kvmesh.kv.kv_cost import request_kv_tokens
from kvmesh.core.seams import GenerateRequest, SamplingParams
from kvmesh.core.errors import OverloadedError

SYSTEM = "You are a careful assistant. Answer briefly and cite the rules you follow. " * 4


def _engine(model_dir, **cache):
    return tiny_engine(model_dir, **{"num_blocks": 96, **cache})


_generate = generate_greedy  # (tokens, usage, tokens the model ran)


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


@pytest.mark.parametrize("kv_dtype", ["auto", "bf16", "int8", "fp8", "int4"])
def test_allocated_kv_bytes_equal_the_capacity_model(tiny_model_dir, kv_dtype):
    engine = _engine(tiny_model_dir, kv_cache_dtype=kv_dtype, num_blocks=32)
    plan = engine.parts.plan
    allocated = sum(t.numel() * t.element_size() for c in engine.runner.kv_caches
                    for t in (c.key_cache, c.value_cache, c.key_scale, c.value_scale) if t is not None)
    assert allocated == plan.kv_bytes_per_token * plan.num_blocks * plan.block_size
    tokens, usage, _ = _generate(engine, "q", SYSTEM)
    assert len(tokens) == 8 and usage.completion_tokens == 8
    if kv_dtype in ("int8", "fp8", "int4"):
        assert engine.block_extra_keys() != _engine(tiny_model_dir, num_blocks=32).block_extra_keys(), \
            "quantized KV blocks never match unquantized ones in the prefix cache"


def test_a_resident_prefix_is_admitted_for_its_uncached_blocks_and_output(tiny_model_dir):
    """Blocks already in the cache are not reserved again: three requests sharing a long
    resident prefix fit a pool that, counting whole prompts, holds only one of them; they
    share the prefix blocks once, and what admission counted as cached stays pinned."""
    block_size, prefix_len, max_tokens = 8, 160, 8
    engine = _engine(tiny_model_dir, num_blocks=32, block_size=block_size)  # 256 tokens
    budget = engine.scheduler.admission.budget_tokens
    prefix = [(7 * i) % 300 + 5 for i in range(prefix_len)]  # 20 full blocks

    def request(rid, question):
        return GenerateRequest(rid, prompt_token_ids=prefix + question,
                               sampling=SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))

    def run_all():
        finals = {}
        while engine.has_unfinished():
            for d in engine.step():
                if d.finished:
                    finals[d.request_id] = d.usage
            engine.check_integrity()
        return finals

    whole_cost = request_kv_tokens(prefix_len + 4, max_tokens, block_size)
    assert 2 * whole_cost > budget, "counting whole prompts, two requests could not be admitted"
    engine.add_request(request("warm", [1, 2, 3, 4]))
    run_all()
    for i in range(3):  # each: 1 uncached prompt block + output = 2 blocks, the prefix once
        engine.add_request(request(f"q{i}", [10 + i, 20 + i, 30 + i, 40 + i]))
    shared = prefix_len  # 20 pinned blocks, owned by no reservation (their first owner finished)
    each = request_kv_tokens(prefix_len + 4, max_tokens, block_size, cached_prompt_tokens=prefix_len)
    assert engine.stats().kv_tokens_reserved == shared + 3 * each <= budget
    # The pinned prefix is held (used, not evictable): nothing admission counted can disappear.
    assert engine.stats().num_blocks_used == prefix_len // block_size
    engine.check_integrity()
    # A request that does not fit is refused, and holds nothing afterwards.
    with pytest.raises(OverloadedError):
        engine.add_request(request("too-big", list(range(60, 120))))
    engine.check_integrity()
    finals = run_all()
    assert all(finals[f"q{i}"].cached_tokens == prefix_len for i in range(3))
    stats = engine.stats()
    assert stats.kv_tokens_reserved == 0 and stats.num_blocks_used == 0
