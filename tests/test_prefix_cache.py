"""Prefix cache: reuse of full blocks, collision safety, tenant isolation, n > 1 forks, events."""

import pytest
from fake_paged_model import FakePagedModel, assert_pool_whole, engine_step, expected_output, run_until_idle

from kvmesh.core.config import SchedulerConfig
from kvmesh.kv import hashing
from kvmesh.kv.kv_cache_manager import KVCacheManager
from kvmesh.core.seams import PrefixEventKind, SamplingParams
from kvmesh.worker.engine_loop.request import Request
from kvmesh.worker.engine_loop.scheduler import Scheduler

BLOCK = 4
TENANT_A = hashing.block_extra_keys("m", "main", "fp32", "tenant-a")
TENANT_B = hashing.block_extra_keys("m", "main", "fp32", "tenant-b")


def build(num_blocks=64, prefix=True, **sched):
    kv = KVCacheManager(num_blocks, BLOCK, enable_prefix_caching=prefix, worker_id="w0")
    return Scheduler(SchedulerConfig(**sched), kv, clock=lambda: 0.0), FakePagedModel(num_blocks, BLOCK)


def submit(scheduler, rid, prompt, max_tokens=3, extra_keys=TENANT_A, **kw) -> Request:
    request = Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens), arrival_time=0.0,
                      extra_keys=extra_keys, **kw)
    scheduler.add_request(request)
    return request


def scheduled_tokens(outputs, rid) -> int:
    return sum(o.num_scheduled_tokens.get(rid, 0) for o in outputs)


def test_second_request_starts_at_the_cached_length():
    scheduler, model = build()
    prompt = list(range(1, 21))  # 5 full blocks
    first = submit(scheduler, "first", prompt)
    run_until_idle(scheduler, model)
    second = submit(scheduler, "second", prompt + [77, 78])
    outputs = run_until_idle(scheduler, model)
    assert second.num_cached_tokens == 20
    assert outputs[0].scheduled[0].num_computed_tokens == 20
    assert scheduled_tokens(outputs, "second") == 2 + 2  # its own 2 prompt tokens + 2 decode steps
    assert second.output_token_ids == expected_output(prompt + [77, 78], 3)
    assert first.output_token_ids == expected_output(prompt, 3)
    assert scheduler.stats().prefix_cache_hit_rate == pytest.approx(20 / 42)
    assert_pool_whole(scheduler)


def test_identical_prompt_still_computes_its_last_token():
    scheduler, model = build()
    prompt = list(range(16))  # exactly 4 blocks
    submit(scheduler, "a", prompt)
    run_until_idle(scheduler, model)
    again = submit(scheduler, "b", prompt)
    outputs = run_until_idle(scheduler, model)
    assert again.num_cached_tokens == 12  # the last block holds the last token: recomputed
    assert outputs[0].scheduled[0].num_scheduled_tokens == 4
    assert again.output_token_ids == expected_output(prompt, 3)


def test_concurrent_requests_share_blocks_with_refcounts():
    scheduler, model = build()
    prompt = list(range(100, 112))
    a = submit(scheduler, "a", prompt, max_tokens=8)
    engine_step(scheduler, model)
    b = submit(scheduler, "b", prompt + [5], max_tokens=8)
    engine_step(scheduler, model)
    shared = a.block_ids[:3]
    assert b.block_ids[:3] == shared
    # Two block tables, plus b's pin from admission (it counted them as cached: held until it ends).
    assert all(scheduler.kv.pool.ref_count(block) == 3 for block in shared)
    run_until_idle(scheduler, model)
    assert b.output_token_ids == expected_output(prompt + [5], 8)
    assert_pool_whole(scheduler)


def test_forged_hash_collision_is_detected_and_not_served(monkeypatch):
    # A real 128-bit collision cannot be produced; force every block to hash the same.
    monkeypatch.setattr(hashing, "hash_block", lambda parent, tokens, extra=(): b"\x00" * 16)
    scheduler, model = build()
    victim_prompt = list(range(1, 9))
    submit(scheduler, "victim", victim_prompt)
    run_until_idle(scheduler, model)
    attacker = submit(scheduler, "attacker", list(range(50, 59)))
    run_until_idle(scheduler, model)
    assert attacker.num_cached_tokens == 0
    assert attacker.output_token_ids == expected_output(list(range(50, 59)), 3)
    # Same first block, but the second block's parent differs from the indexed block's: only
    # the genuinely identical first block is served.
    twin = submit(scheduler, "twin", victim_prompt + [9])
    run_until_idle(scheduler, model)
    assert twin.num_cached_tokens == 4
    assert twin.output_token_ids == expected_output(victim_prompt + [9], 3)
    assert scheduler.kv.stats().num_prefix_collisions >= 2
    assert_pool_whole(scheduler)


def test_tenant_salt_prevents_sharing():
    scheduler, model = build()
    prompt = list(range(30, 46))
    submit(scheduler, "a", prompt + [1], extra_keys=TENANT_A)
    run_until_idle(scheduler, model)
    other_tenant = submit(scheduler, "b", prompt + [1], extra_keys=TENANT_B)
    same_tenant = submit(scheduler, "c", prompt + [1], extra_keys=TENANT_A)
    run_until_idle(scheduler, model)
    assert other_tenant.num_cached_tokens == 0
    assert same_tenant.num_cached_tokens == 16


def test_disabled_prefix_caching_never_shares():
    scheduler, model = build(prefix=False)
    prompt = list(range(20))
    submit(scheduler, "a", prompt)
    run_until_idle(scheduler, model)
    b = submit(scheduler, "b", prompt)
    run_until_idle(scheduler, model)
    assert b.num_cached_tokens == 0 and scheduler.kv.pool.num_cached_blocks == 0
    assert scheduler.kv.events_since(0).events == ()


@pytest.mark.parametrize("prefix", [True, False])
def test_n_samples_fork_the_prompt_after_the_first_prefill(prefix):
    scheduler, model = build(prefix=prefix)
    prompt = list(range(200, 210))  # position 9 sits in block 2, after slot 8
    children = [submit(scheduler, f"g/{i}", prompt, max_tokens=4, group_id="g", sample_index=i) for i in range(3)]
    first = engine_step(scheduler, model)
    assert set(first.num_scheduled_tokens) == {"g/0"}  # siblings wait for the prompt
    second = engine_step(scheduler, model)
    assert second.num_scheduled_tokens == {"g/0": 1, "g/1": 1, "g/2": 1}
    leader = children[0]
    assert len(second.copy_blocks) == 2
    assert {src for src, _ in second.copy_blocks} == {leader.block_ids[2]}
    for child in children[1:]:
        assert child.block_ids[:2] == leader.block_ids[:2]
        assert child.block_ids[2] != leader.block_ids[2]
        assert child.num_cached_tokens == 9
    assert all(scheduler.kv.pool.ref_count(b) == 3 for b in leader.block_ids[:2])
    run_until_idle(scheduler, model)
    for child in children:
        assert child.output_token_ids == expected_output(prompt, 4)
    assert_pool_whole(scheduler)


def test_group_does_not_deadlock_when_the_first_child_is_cancelled():
    scheduler, model = build()
    prompt = list(range(12))
    children = [submit(scheduler, f"g/{i}", prompt, max_tokens=2, group_id="g", sample_index=i) for i in range(2)]
    scheduler.abort_requests(["g/0"])
    run_until_idle(scheduler, model)
    assert children[1].output_token_ids == expected_output(prompt, 2)


def test_events_stored_evicted_reset_and_cleared():
    scheduler, model = build(num_blocks=4)
    kv = scheduler.kv
    submit(scheduler, "a", list(range(9)), max_tokens=1)  # 2 full blocks once computed
    run_until_idle(scheduler, model)
    batch = kv.events_since(0)
    assert not batch.reset and batch.worker_id == "w0"
    stored = [h for e in batch.events if e.kind is PrefixEventKind.STORED for h in e.block_hashes]
    assert len(stored) == 2 and set(stored) == set(kv.prefix_cache.hashes())
    # A 16-token request needs all 4 blocks: both cached blocks are evicted.
    submit(scheduler, "b", list(range(50, 65)), max_tokens=1)
    run_until_idle(scheduler, model)
    later = kv.events_since(batch.next_seq)
    evicted = [h for e in later.events if e.kind is PrefixEventKind.EVICTED for h in e.block_hashes]
    assert set(evicted) == set(stored)
    assert kv.events_since(later.next_seq + 5).reset  # a caller from the future: the worker restarted
    kv.reset_prefix_cache()
    cleared = kv.events_since(later.next_seq)
    assert [e.kind for e in cleared.events] == [PrefixEventKind.CLEARED] and kv.prefix_cache.hashes() == ()
    assert_pool_whole(scheduler)


def test_events_since_resets_a_caller_left_behind():
    kv = KVCacheManager(8, BLOCK, worker_id="w1", max_events=2)
    for i in range(4):
        request = Request(f"r{i}", list(range(i * 10, i * 10 + 5)), SamplingParams(), arrival_time=0.0)
        kv.allocate(request, 5, kv.match_prefix(request))
        request.num_computed_tokens = 5
        kv.cache_full_blocks(request)
        kv.flush_events()
        kv.free(request)
    batch = kv.events_since(0)
    assert batch.reset and set(batch.all_hashes) == set(kv.prefix_cache.hashes()) and len(batch.all_hashes) == 4
    assert batch.next_seq == 4
    assert len(kv.events_since(2).events) == 2
