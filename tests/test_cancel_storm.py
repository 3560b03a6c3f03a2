"""Cancellation storm: 200 requests, random aborts, failures and queue timeouts at random steps,
preemption pressure from a small over-committed pool, shared prefixes and n > 1 groups.

Invariants are checked after every step (engine_step calls check_integrity); every request
that finishes normally must carry exactly the unpressured token sequence; at the end every
block is free or cached with zero references and nothing is reserved.
"""

import random

import pytest
from fake_paged_model import FakePagedModel, assert_pool_whole, engine_step, expected_output

from kvmesh.core.config import SchedulerConfig
from kvmesh.kv.kv_cache_manager import KVCacheManager
from kvmesh.core.seams import SamplingParams
from kvmesh.core.errors import OverloadedError
from kvmesh.worker.engine_loop.request import Request, RequestStatus
from kvmesh.worker.engine_loop.scheduler import Scheduler

NUM_REQUESTS = 200
BLOCK = 4


class StepClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make_requests(rng: random.Random, clock: StepClock) -> list[Request]:
    shared_prefixes = [[rng.randrange(1000) for _ in range(rng.randrange(4, 14))] for _ in range(4)]
    requests = []
    while len(requests) < NUM_REQUESTS:
        prefix = rng.choice(shared_prefixes) if rng.random() < 0.7 else []
        prompt = prefix + [rng.randrange(1000) for _ in range(rng.randrange(1, 9))]
        sampling = SamplingParams(max_tokens=rng.randrange(1, 10))
        salt = ("salt=a",) if rng.random() < 0.8 else ("salt=b",)
        priority = rng.choice([0, 0, 1, 2])
        n = 3 if rng.random() < 0.1 else 1
        group = f"g{len(requests)}" if n > 1 else None
        for index in range(n):
            requests.append(Request(f"r{len(requests)}", prompt, sampling, arrival_time=0.0, priority=priority,
                                    extra_keys=salt, group_id=group, sample_index=index))
    return requests


@pytest.mark.parametrize("seed,mode,num_cpu_blocks,num_tier_blocks",
                         [(1, "recompute", 0, 0), (2, "swap", 12, 0), (3, "swap", 2, 0), (4, "recompute", 0, 24)])
def test_cancel_storm_keeps_every_invariant(seed, mode, num_cpu_blocks, num_tier_blocks):
    rng = random.Random(seed)
    clock = StepClock()
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=32, max_prefill_tokens_per_step=16,
                             max_total_kv_tokens=100_000, max_queue_len=48, max_queue_time_s=40.0,
                             preemption_mode=mode)
    kv = KVCacheManager(num_blocks=20, block_size=BLOCK, num_cpu_blocks=num_cpu_blocks,
                        num_host_tier_blocks=num_tier_blocks)
    scheduler = Scheduler(config, kv, clock=clock)
    model = FakePagedModel(20, BLOCK, num_cpu_blocks, num_tier_blocks).attach(scheduler)
    pending = make_requests(rng, clock)
    num_requests = len(pending)  # 200, or a few more when the last is an n > 1 group
    submitted: list[Request] = []
    statuses_seen = set()
    steps = 0
    while pending or scheduler.has_unfinished():
        steps += 1
        assert steps < 5000, "no progress"
        clock.now += 1.0
        for _ in range(rng.randrange(0, 6)):
            if not pending:
                break
            request = pending[0]
            request.arrival_time = clock.now
            try:
                scheduler.add_request(request)
            except OverloadedError as exc:
                assert exc.retry_after_s > 0
                break  # queue full: retry next step
            submitted.append(pending.pop(0))
        live = list(scheduler.requests)
        if live and rng.random() < 0.3:
            scheduler.abort_requests(rng.sample(live, k=min(len(live), rng.randrange(1, 4))) + ["unknown-id"])
        if live and (steps % 25 == 0 or rng.random() < 0.03):
            scheduler.finish_requests([rng.choice(live)], RequestStatus.FAILED)
        if rng.random() < 0.02:
            clock.now += 45.0  # a stall: whoever never got scheduled times out
        for finished in engine_step(scheduler, model).finished:
            statuses_seen.add(finished.status)

    assert num_requests >= NUM_REQUESTS and len(submitted) == num_requests
    assert all(r.is_finished for r in submitted)
    finished = [r for r in submitted if r.status is RequestStatus.FINISHED]
    for request in finished:
        assert request.output_token_ids == expected_output(request.prompt_token_ids, request.sampling.max_tokens)
    stats = scheduler.stats()
    assert finished and {RequestStatus.CANCELLED, RequestStatus.FAILED} <= statuses_seen | {
        r.status for r in submitted}
    assert stats.num_preemptions_recompute + stats.num_preemptions_swap > 0
    if mode == "swap" and num_cpu_blocks >= 12:
        assert stats.num_preemptions_swap > 0
    assert stats.kv.prefix_hit_tokens > 0
    if num_tier_blocks:  # the storm went through the tier: blocks stored and served back
        assert stats.kv.tier.num_stores > 0 and stats.kv.tier.num_hits > 0
    assert_pool_whole(scheduler)
    assert all(block.ref_count == 0 for block in kv.pool.blocks)


@pytest.mark.parametrize("seed", range(6))
def test_random_configurations_reproduce_the_reference_tokens(seed):
    """Every policy, block size, preemption mode and cache setting, no aborts: every request
    finishes with exactly the unpressured tokens and the pool ends whole."""
    rng = random.Random(100 + seed)
    block_size = rng.choice([1, 2, 4, 8, 16])
    num_blocks = max(4, rng.randrange(48, 160) // block_size)
    num_cpu_blocks = rng.choice([0, 3, 40])
    num_tier_blocks = rng.choice([0, 2, 30])
    config = SchedulerConfig(
        policy=rng.choice(["continuous", "static", "dynamic"]), static_batch_size=rng.randrange(1, 6),
        dynamic_batch_window_s=2.5, max_num_seqs=rng.randrange(1, 7), max_num_batched_tokens=24,
        max_prefill_tokens_per_step=rng.randrange(1, 25), max_total_kv_tokens=100_000,
        preemption_mode=rng.choice(["recompute", "swap"]), max_queue_time_s=1e9)
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=rng.random() < 0.7,
                        num_cpu_blocks=num_cpu_blocks, num_host_tier_blocks=num_tier_blocks)
    clock = StepClock()
    scheduler = Scheduler(config, kv, clock=clock)
    model = FakePagedModel(num_blocks, block_size, num_cpu_blocks, num_tier_blocks).attach(scheduler)
    requests = make_requests(rng, clock)[:40]
    pending = list(requests)
    steps = 0
    while pending or scheduler.has_unfinished():
        steps += 1
        assert steps < 20_000, "no progress"
        clock.now += 1.0
        for _ in range(rng.randrange(0, 3)):
            if pending:
                pending[0].arrival_time = clock.now
                scheduler.add_request(pending.pop(0))
        engine_step(scheduler, model)
    for request in requests:
        assert request.status is RequestStatus.FINISHED
        assert request.output_token_ids == expected_output(request.prompt_token_ids, request.sampling.max_tokens)
    assert_pool_whole(scheduler)
