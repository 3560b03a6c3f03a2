"""Scheduler: chunked prefill, budgets, priority, batching policies, preemption, admission limits.

Driven by tests/fake_paged_model.py: a deterministic "model" that reads its history back
through the block tables, so every final token sequence is checkable against
`expected_output` (the unpressured, uncached answer).
"""

import pytest
from fake_paged_model import (FakePagedModel, assert_pool_whole, engine_step, expected_output, outputs_of,
                              run_until_idle)

from kvmesh.core.config import SchedulerConfig
from kvmesh.kv.kv_cache_manager import KVCacheManager
from kvmesh.core.seams import SamplingParams
from kvmesh.core.errors import InvalidRequestError, OverloadedError
from kvmesh.worker.engine_loop.request import Request, RequestStatus
from kvmesh.worker.engine_loop.scheduler import Scheduler
from kvmesh.worker.engine_loop.engine import worker_stats


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def build(num_blocks=64, block_size=4, num_cpu_blocks=0, prefix=True, clock=None, **sched):
    config = SchedulerConfig(**sched)
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=prefix, num_cpu_blocks=num_cpu_blocks)
    scheduler = Scheduler(config, kv, clock=clock or FakeClock())
    return scheduler, FakePagedModel(num_blocks, block_size, num_cpu_blocks)


def submit(scheduler, rid, prompt, max_tokens=4, priority=0, **kw) -> Request:
    request = Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                      arrival_time=scheduler.clock(), priority=priority, **kw)
    scheduler.add_request(request)
    return request


def is_decode(entry) -> bool:
    return entry.sample and entry.num_scheduled_tokens == 1 and entry.request.num_output_tokens > 0


def test_single_request_matches_the_reference_and_returns_its_blocks():
    scheduler, model = build()
    request = submit(scheduler, "a", range(1, 11), max_tokens=6)
    run_until_idle(scheduler, model)
    assert request.output_token_ids == expected_output(list(range(1, 11)), 6)
    assert request.status is RequestStatus.FINISHED
    assert_pool_whole(scheduler)


def test_chunked_prefill_splits_a_long_prompt_and_decodes_never_stall():
    scheduler, model = build(max_num_batched_tokens=12, max_prefill_tokens_per_step=8)
    short = submit(scheduler, "short", range(3), max_tokens=20)
    engine_step(scheduler, model)  # short's prompt
    long_prompt = list(range(100, 140))
    long = submit(scheduler, "long", long_prompt, max_tokens=3)
    chunks = []
    while long.num_output_tokens == 0:
        output = engine_step(scheduler, model)
        sizes = output.num_scheduled_tokens
        assert sizes["short"] == 1, "the decode must run every step of the long prefill"
        chunks.append(sizes.get("long", 0))
        assert output.total_num_scheduled_tokens <= 12
    assert sum(chunks) == 40 and max(chunks) == 8 and len(chunks) == 5
    run_until_idle(scheduler, model)
    assert long.output_token_ids == expected_output(long_prompt, 3)
    assert short.output_token_ids == expected_output(list(range(3)), 20)
    assert_pool_whole(scheduler)


def test_decodes_go_before_a_more_important_prefill():
    scheduler, model = build(max_num_batched_tokens=8, max_prefill_tokens_per_step=8)
    low = submit(scheduler, "low", [1, 2], max_tokens=12, priority=1)
    engine_step(scheduler, model)
    submit(scheduler, "urgent", range(100, 140), max_tokens=2, priority=0)
    for _ in range(5):  # urgent's 40-token prompt in chunks of 7, low decoding every step
        sizes = engine_step(scheduler, model).num_scheduled_tokens
        assert sizes["low"] == 1 and sizes["urgent"] == 7
    run_until_idle(scheduler, model)
    assert low.output_token_ids == expected_output([1, 2], 12)


def test_budgets_and_max_num_seqs_hold_every_step():
    scheduler, model = build(num_blocks=256, max_num_seqs=3, max_num_batched_tokens=10, max_prefill_tokens_per_step=6)
    requests = [submit(scheduler, f"r{i}", range(i, i + 5 + 3 * i), max_tokens=2 + i % 3) for i in range(8)]
    outputs = run_until_idle(scheduler, model)
    for output in outputs:
        assert len(output.scheduled) <= 3
        assert output.total_num_scheduled_tokens <= 10
        assert sum(e.num_scheduled_tokens for e in output.scheduled if not is_decode(e)) <= 6
    assert max(len(o.scheduled) for o in outputs) == 3
    for r in requests:
        assert r.output_token_ids == expected_output(r.prompt_token_ids, r.sampling.max_tokens)
    stats = scheduler.stats()
    assert 0 < stats.batch_fill_rate <= 1 and stats.num_steps == len(outputs)
    assert_pool_whole(scheduler)


def test_admission_follows_priority_then_arrival():
    clock = FakeClock()
    scheduler, model = build(clock=clock, max_num_seqs=1)
    order = []
    for rid, priority in [("low1", 5), ("high", 0), ("low2", 5), ("mid", 2)]:
        submit(scheduler, rid, [1, 2, 3], max_tokens=1, priority=priority)
        clock.now += 1
    while scheduler.has_unfinished():
        output = engine_step(scheduler, model)
        order += [e.request_id for e in output.scheduled if e.request_id not in order]
    assert order == ["high", "mid", "low1", "low2"]


def test_static_policy_admits_nothing_until_the_batch_has_finished():
    scheduler, model = build(policy="static", static_batch_size=2)
    a = submit(scheduler, "a", [1, 2], max_tokens=2)
    b = submit(scheduler, "b", [3, 4], max_tokens=6)
    c = submit(scheduler, "c", [5, 6], max_tokens=2)
    while b.status is not RequestStatus.FINISHED:
        a_done = a.is_finished
        output = engine_step(scheduler, model)
        assert "c" not in output.num_scheduled_tokens
        if a_done:  # a's slot stays empty: the batch runs to completion
            assert set(output.num_scheduled_tokens) == {"b"}
    output = engine_step(scheduler, model)
    assert set(output.num_scheduled_tokens) == {"c"}
    run_until_idle(scheduler, model)
    assert c.output_token_ids == expected_output([5, 6], 2)


def test_continuous_policy_fills_the_freed_slot_at_once():
    scheduler, model = build(max_num_seqs=2)
    a = submit(scheduler, "a", [1, 2], max_tokens=2)
    submit(scheduler, "b", [3, 4], max_tokens=6)
    submit(scheduler, "c", [5, 6], max_tokens=2)
    while not a.is_finished:
        engine_step(scheduler, model)
    output = engine_step(scheduler, model)
    assert set(output.num_scheduled_tokens) == {"b", "c"}


def test_dynamic_policy_waits_for_the_window_or_a_full_batch():
    clock = FakeClock()
    scheduler, model = build(clock=clock, policy="dynamic", static_batch_size=3, dynamic_batch_window_s=1.0)
    submit(scheduler, "a", [1, 2], max_tokens=1)
    submit(scheduler, "b", [3, 4], max_tokens=1)
    assert engine_step(scheduler, model).is_empty
    clock.now += 0.5
    assert engine_step(scheduler, model).is_empty
    submit(scheduler, "c", [5, 6], max_tokens=1)  # batch full: starts without waiting out the window
    assert set(engine_step(scheduler, model).num_scheduled_tokens) == {"a", "b", "c"}
    submit(scheduler, "d", [7, 8], max_tokens=1)
    assert engine_step(scheduler, model).is_empty
    clock.now += 1.01  # window elapsed: a partial batch starts
    assert set(engine_step(scheduler, model).num_scheduled_tokens) == {"d"}


def _pressure_workload(scheduler):
    return [submit(scheduler, f"p{i}", range(10 * i, 10 * i + 6 + i), max_tokens=9) for i in range(5)]


@pytest.mark.parametrize("mode,prefix", [("recompute", True), ("recompute", False), ("swap", True)])
def test_preemption_reproduces_the_unpressured_tokens(mode, prefix):
    relaxed, relaxed_model = build(num_blocks=64)
    relaxed_requests = _pressure_workload(relaxed)
    run_until_idle(relaxed, relaxed_model)
    assert relaxed.stats().num_preemptions_recompute == relaxed.stats().num_preemptions_swap == 0
    reference = outputs_of(relaxed_requests)
    # 10 blocks of 4 tokens for five requests needing 4-5 blocks each: over-committed on purpose.
    scheduler, model = build(num_blocks=10, num_cpu_blocks=32, prefix=prefix, preemption_mode=mode,
                             max_total_kv_tokens=10_000)
    requests = _pressure_workload(scheduler)
    run_until_idle(scheduler, model)
    assert outputs_of(requests) == reference
    for r in requests:
        assert r.output_token_ids == expected_output(r.prompt_token_ids, 9)
    preemptions = scheduler.stats()
    assert getattr(preemptions, f"num_preemptions_{mode}") > 0
    assert sum(r.num_preemptions for r in requests) == (preemptions.num_preemptions_recompute
                                                        + preemptions.num_preemptions_swap)
    assert_pool_whole(scheduler)


def test_swap_falls_back_to_recompute_when_swap_space_is_full():
    scheduler, model = build(num_blocks=10, num_cpu_blocks=1, preemption_mode="swap", max_total_kv_tokens=10_000)
    requests = _pressure_workload(scheduler)
    run_until_idle(scheduler, model)
    stats = scheduler.stats()
    assert stats.num_preemptions_recompute > 0
    for r in requests:
        assert r.output_token_ids == expected_output(r.prompt_token_ids, 9)
    assert_pool_whole(scheduler)


def test_preemption_picks_the_least_important_newest_request():
    clock = FakeClock()
    scheduler, model = build(clock=clock, num_blocks=6, max_total_kv_tokens=10_000)
    vip = submit(scheduler, "vip", range(7), max_tokens=12, priority=0)
    clock.now += 1
    old = submit(scheduler, "old", range(20, 27), max_tokens=12, priority=1)
    clock.now += 1
    new = submit(scheduler, "new", range(40, 47), max_tokens=12, priority=1)
    preempted = []
    while scheduler.has_unfinished():
        preempted += engine_step(scheduler, model).preempted_ids
    assert preempted and preempted[0] == "new"
    assert vip.num_preemptions == 0
    for r in (vip, old, new):
        assert r.output_token_ids == expected_output(r.prompt_token_ids, 12)


def test_queue_timeout_rejects_and_holds_nothing():
    clock = FakeClock()
    scheduler, model = build(clock=clock, num_blocks=16, max_num_seqs=1, max_queue_time_s=5.0)
    running = submit(scheduler, "running", range(5), max_tokens=8)
    stuck = submit(scheduler, "stuck", range(5), max_tokens=2)
    engine_step(scheduler, model)
    clock.now += 6.0
    output = engine_step(scheduler, model)
    assert [(f.request_id, f.status) for f in output.finished] == [("stuck", RequestStatus.REJECTED)]
    assert stuck.status is RequestStatus.REJECTED and stuck.block_ids == [] and stuck.reserved_kv_tokens == 0
    assert running.status is RequestStatus.DECODING  # already served: never rejected by the queue clock
    run_until_idle(scheduler, model)
    assert_pool_whole(scheduler)


def test_overloaded_with_retry_after_and_never_fits_is_invalid():
    clock = FakeClock()
    scheduler, model = build(clock=clock, num_blocks=8, block_size=4)  # budget: 32 tokens
    with pytest.raises(InvalidRequestError):
        submit(scheduler, "huge", range(30), max_tokens=3)  # 33 > 32, can never fit
    overcommitted, _ = build(num_blocks=8, block_size=4, max_total_kv_tokens=1000)
    with pytest.raises(InvalidRequestError):
        submit(overcommitted, "huge", range(30), max_tokens=3)  # over-commit, but bigger than the pool
    first = submit(scheduler, "first", range(10), max_tokens=10)  # reserves 20
    assert scheduler.admission.reserved_tokens == 20
    with pytest.raises(OverloadedError) as exc:
        submit(scheduler, "second", range(50, 60), max_tokens=3)  # 13 -> 16; 20 + 16 > 32
    assert exc.value.retry_after_s > 0 and exc.value.retryable
    assert "second" not in scheduler.requests
    # Once a request drains, retry-after follows the measured drain rate.
    clock.now += 2.0
    scheduler.abort_requests(["first"])
    assert scheduler.stats().drain_tokens_per_s == pytest.approx(20 / 2.0)
    submit(scheduler, "big", range(10), max_tokens=10)  # 20 reserved again
    with pytest.raises(OverloadedError) as exc:
        submit(scheduler, "third", range(50, 60), max_tokens=10)  # 20 + 20 - 32 = 8 over, at 10 tokens/s
    assert exc.value.retry_after_s == pytest.approx(0.8)
    assert first.output_token_ids == []  # never truncated, never half-served silently
    # The same prompt as "big" shares its two full prompt blocks: 20 - 8 = 12 more fits.
    same = submit(scheduler, "same-prefix", range(10), max_tokens=10)
    assert same.reserved_kv_tokens == 12 and scheduler.admission.reserved_tokens == 32


def test_queue_full_and_bad_requests():
    scheduler, _ = build(max_queue_len=2, max_new_tokens=16)
    submit(scheduler, "a", [1])
    submit(scheduler, "b", [1])
    with pytest.raises(OverloadedError):
        submit(scheduler, "c", [1])
    with pytest.raises(InvalidRequestError):
        submit(scheduler, "a", [1])  # duplicate id
    scheduler.abort_requests("a")
    # Empty prompts, bad sampling parameters and context overflow are the Engine's single
    # validation (test_engine_basic.py); the scheduler only refuses what this worker cannot hold.
    with pytest.raises(InvalidRequestError):
        scheduler.finish_requests(["b"], RequestStatus.DECODING)


def test_abort_unknown_is_a_noop_and_abort_frees_everything():
    scheduler, model = build()
    assert scheduler.abort_requests(["nope"]) == []
    a = submit(scheduler, "a", range(9), max_tokens=5)
    b = submit(scheduler, "b", range(9), max_tokens=5)
    engine_step(scheduler, model)
    aborted = scheduler.abort_requests(["a", "b", "nope"])
    assert aborted == [a, b] and a.status is RequestStatus.CANCELLED
    output = scheduler.schedule()
    assert {f.request_id for f in output.finished} == {"a", "b"} and not output.scheduled
    assert_pool_whole(scheduler)


def test_abort_between_schedule_and_update_is_skipped():
    scheduler, model = build()
    a = submit(scheduler, "a", range(6), max_tokens=3)
    b = submit(scheduler, "b", range(10, 16), max_tokens=3)
    output = scheduler.schedule()
    sampled = model.execute(output)
    scheduler.abort_requests(["a"])  # the client left while the forward ran
    scheduler.update_from_output(output, sampled)
    scheduler.check_integrity()
    assert a.output_token_ids == [] and a.status is RequestStatus.CANCELLED
    assert b.num_output_tokens == 1
    run_until_idle(scheduler, model)
    assert b.output_token_ids == expected_output(list(range(10, 16)), 3)
    assert_pool_whole(scheduler)


def test_request_status_and_token_accounting():
    assert [s.is_finished for s in RequestStatus] == [False] * 3 + [True] * 4
    request = Request("r", [1, 2, 3], SamplingParams(max_tokens=2), arrival_time=0.0)
    request.append_output_token(9)
    assert (request.all_token_ids, request.num_tokens, request.num_prompt_tokens, request.num_output_tokens) == (
        [1, 2, 3, 9], 4, 3, 1)
    assert request.num_tokens_to_compute == 4


def test_stats_report_kv_use_queue_and_fill_rate():
    scheduler, model = build(max_num_seqs=1, max_num_batched_tokens=8, max_prefill_tokens_per_step=8)
    submit(scheduler, "a", range(8), max_tokens=2)
    submit(scheduler, "b", range(20, 25), max_tokens=2)
    engine_step(scheduler, model)  # a's whole prompt: 8 of 8 tokens
    stats = scheduler.stats()
    assert (stats.num_running, stats.num_waiting, stats.queued_prompt_tokens) == (1, 1, 5)
    assert stats.kv_tokens_used == 8 and stats.kv_tokens_reserved == 12 + 8
    assert stats.peak_kv_tokens == 8 and stats.batch_fill_rate == 1.0
    engine_step(scheduler, model)  # a's decode: 1 of 8 tokens, a finishes
    stats = scheduler.stats()
    assert stats.batch_fill_rate == pytest.approx((1.0 + 1 / 8) / 2)
    assert stats.mean_kv_tokens == pytest.approx((8 + 9) / 2) and stats.peak_kv_tokens == 9


def test_tokens_to_compute_counts_prompt_not_yet_computed_and_output_to_come_not_the_cached_prefix():
    """The router's load signal: forward-pass tokens left (the forward of the last known
    token yields the next output, so a prompt of P with O outputs costs P + O - 1)."""
    scheduler, model = build(max_num_seqs=1, max_num_batched_tokens=8, max_prefill_tokens_per_step=8)
    submit(scheduler, "a", range(8), max_tokens=2)
    submit(scheduler, "b", range(20, 25), max_tokens=2)
    assert scheduler.stats().tokens_to_compute == (8 + 2 - 1) + (5 + 2 - 1)
    engine_step(scheduler, model)  # a's whole prompt and its first output token
    assert scheduler.stats().tokens_to_compute == 1 + (5 + 2 - 1)
    run_until_idle(scheduler, model)
    assert scheduler.stats().tokens_to_compute == 0
    # a's prompt is cached now (two full blocks of 4): a request sharing it is pinned to
    # those blocks at admission and costs only its 2-token tail and its 3 outputs.
    submit(scheduler, "c", [*range(8), 50, 51], max_tokens=3)
    assert scheduler.stats().tokens_to_compute == 2 + 3 - 1


def test_check_integrity_catches_a_lost_request():
    scheduler, model = build()
    submit(scheduler, "a", range(6), max_tokens=3)
    engine_step(scheduler, model)
    scheduler.running.clear()  # corrupt: the request is neither waiting nor running
    with pytest.raises(AssertionError):
        scheduler.check_integrity()


def test_blocks_shared_with_a_running_request_are_committed_once():
    scheduler, model = build(num_blocks=16, block_size=4)  # 64 tokens
    prefix = list(range(100, 124))  # 6 full blocks
    first = submit(scheduler, "first", prefix + [1, 2], max_tokens=4)  # 32 tokens reserved
    engine_step(scheduler, model)  # prefilled: its prefix blocks are in the cache, still held by it
    second = submit(scheduler, "second", prefix + [3, 4], max_tokens=4)
    assert second.num_pinned_tokens == 24 and second.reserved_kv_tokens == 8  # uncached tail + output
    assert scheduler.stats().kv_tokens_reserved == 32 + 8  # the prefix is first's; not counted again
    scheduler.abort_requests(["first"])
    # first is gone; second still pins the 6 prefix blocks, now paid for by nobody else
    assert scheduler.stats().kv_tokens_reserved == 24 + 8
    scheduler.check_integrity()
    run_until_idle(scheduler, model)
    assert second.output_token_ids == expected_output(prefix + [3, 4], 4)
    assert scheduler.stats().kv_tokens_reserved == 0
    assert_pool_whole(scheduler)


def test_a_request_waits_for_the_prefix_a_running_request_is_computing_instead_of_computing_it_twice():
    scheduler, model = build(num_blocks=32, block_size=4, max_num_batched_tokens=64, max_prefill_tokens_per_step=8)
    prefix = list(range(200, 216))  # 4 full blocks, prefilled over two steps of 8
    leader = submit(scheduler, "leader", prefix + [1, 2], max_tokens=2)
    follower = submit(scheduler, "follower", prefix + [3, 4], max_tokens=2)
    first = engine_step(scheduler, model)
    assert [e.request.request_id for e in first.scheduled] == ["leader"]  # follower held back
    outputs = run_until_idle(scheduler, model)
    assert follower.num_cached_tokens == 16  # the whole prefix, computed once by the leader
    computed = sum(e.num_scheduled_tokens for o in [first, *outputs] for e in o.scheduled)
    assert computed == (18 + 1) + (2 + 1)  # leader's prompt + 1 decode; follower's tail + 1 decode
    assert leader.output_token_ids == expected_output(prefix + [1, 2], 2)
    assert follower.output_token_ids == expected_output(prefix + [3, 4], 2)
    assert_pool_whole(scheduler)


def test_a_prefix_an_admitted_request_will_compute_is_reserved_once_and_topped_up_if_it_never_comes():
    scheduler, model = build(num_blocks=32, block_size=4)
    prefix = list(range(300, 316))  # 4 full blocks
    leader = submit(scheduler, "leader", prefix + [1, 2], max_tokens=2)  # 20 tokens: all its own
    follower = submit(scheduler, "follower", prefix + [3, 4], max_tokens=2)
    assert leader.reserved_kv_tokens == 20 and follower.reserved_kv_tokens == 4  # the prefix is the leader's
    run_until_idle(scheduler, model)
    assert follower.num_cached_tokens == 16 and follower.output_token_ids == expected_output(prefix + [3, 4], 2)
    assert_pool_whole(scheduler)
    # The leader goes away before computing anything: the follower reserves the rest at its start.
    prefix = list(range(400, 416))
    submit(scheduler, "leader-2", prefix + [1, 2], max_tokens=2)
    follower = submit(scheduler, "follower-2", prefix + [3, 4], max_tokens=2)
    assert follower.reserved_kv_tokens == 4
    scheduler.abort_requests(["leader-2"])
    engine_step(scheduler, model)
    assert follower.reserved_kv_tokens == 20 and scheduler.admission.reserved_tokens == 20
    run_until_idle(scheduler, model)
    assert follower.output_token_ids == expected_output(prefix + [3, 4], 2)
    assert_pool_whole(scheduler)


def test_a_prefix_claimed_by_a_waiting_request_stays_committed_and_resident_when_its_computer_ends():
    """The follower was admitted against the prefix the leader was to compute (claimed, not
    pinned: nothing was resident). The leader ends before the follower starts (one running
    request at a time): the follower pins the prefix then, so the committed total keeps it
    (leader's 20 tokens out, the prefix's 16 in: what a router counting the follower's claim
    sees) and it cannot be evicted. Unpinned, the total dropped to the follower's 4, the room
    was admitted into, and the follower's start added the prefix back past the budget."""
    scheduler, model = build(num_blocks=32, block_size=4, max_num_seqs=1)
    prefix = list(range(500, 516))  # 4 full blocks
    leader = submit(scheduler, "leader", prefix + [1, 2], max_tokens=2)
    follower = submit(scheduler, "follower", prefix + [3, 4], max_tokens=2)
    assert follower.reserved_kv_tokens == 4 and follower.num_pinned_tokens == 0
    while leader.status is not RequestStatus.FINISHED:
        engine_step(scheduler, model)
    assert follower.num_output_tokens == 0 and follower.num_pinned_tokens == 16
    assert scheduler.stats().kv_tokens_reserved == 16 + 4  # the prefix, now pinned, and its own
    engine_step(scheduler, model)  # the follower starts: nothing to top up
    assert follower.reserved_kv_tokens == 4 and scheduler.stats().kv_tokens_reserved == 16 + 4
    run_until_idle(scheduler, model)
    assert follower.num_cached_tokens == 16 and follower.output_token_ids == expected_output(prefix + [3, 4], 2)
    assert_pool_whole(scheduler)


# ---- priority preemption (scheduler.priority_preemption) ----------------------------------

def _run_collecting(scheduler, model):
    """Run to idle (integrity checked every step by engine_step) -> ({request id: step of its
    first token}, {request id: step it finished}) for the requests unfinished at the start."""
    first_token_step, finished_step, step = {}, {}, 0
    tracked = dict(scheduler.requests)
    while scheduler.has_unfinished():
        step += 1
        engine_step(scheduler, model)
        for rid, r in tracked.items():
            if r.num_output_tokens and rid not in first_token_step:
                first_token_step[rid] = step
            if r.is_finished and rid not in finished_step:
                finished_step[rid] = step
    return first_token_step, finished_step


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_a_more_important_request_preempts_for_a_slot_and_everyone_finishes_exactly(mode):
    clock = FakeClock()
    scheduler, model = build(clock=clock, max_num_seqs=2, priority_preemption=True, preemption_mode=mode,
                             num_cpu_blocks=32 if mode == "swap" else 0)
    old = submit(scheduler, "old", range(10), max_tokens=20, priority=1)
    clock.now += 1
    engine_step(scheduler, model)
    new = submit(scheduler, "new", range(20, 30), max_tokens=20, priority=1)
    for _ in range(3):
        engine_step(scheduler, model)
    clock.now += 1
    vip = submit(scheduler, "vip", range(40, 45), max_tokens=3, priority=0)
    output = engine_step(scheduler, model)
    # The newest-started request of the less important class made room, in the same step.
    assert output.preempted_ids == ("new",) and "vip" in output.num_scheduled_tokens
    assert "new" not in output.num_scheduled_tokens and "old" in output.num_scheduled_tokens
    run_until_idle(scheduler, model)
    assert (new.num_priority_preemptions, old.num_priority_preemptions, vip.num_preemptions) == (1, 0, 0)
    assert scheduler.stats().num_preemptions_priority == 1
    for r in (old, new, vip):
        assert r.output_token_ids == expected_output(r.prompt_token_ids, r.sampling.max_tokens)
    assert_pool_whole(scheduler)


def test_without_priority_preemption_the_important_request_waits_for_a_slot():
    scheduler, model = build(max_num_seqs=2)
    low = [submit(scheduler, f"low{i}", range(10 * i, 10 * i + 10), max_tokens=12, priority=1) for i in range(2)]
    engine_step(scheduler, model)
    vip = submit(scheduler, "vip", range(40, 45), max_tokens=3, priority=0)
    first, finished = _run_collecting(scheduler, model)
    assert first["vip"] > min(finished[r.request_id] for r in low)  # only once a low one ended
    assert scheduler.stats().num_preemptions_priority == 0
    assert vip.output_token_ids == expected_output(vip.prompt_token_ids, 3)


def test_priority_preemption_frees_blocks_in_an_overcommitted_pool():
    clock = FakeClock()
    # 12 blocks of 4 tokens; admission over-committed, so the low requests fill the pool.
    scheduler, model = build(clock=clock, num_blocks=12, max_total_kv_tokens=10_000, priority_preemption=True)
    lows = []
    for i in range(3):
        lows.append(submit(scheduler, f"low{i}", range(10 * i, 10 * i + 8), max_tokens=8, priority=1))
        clock.now += 1
        engine_step(scheduler, model)
    assert scheduler.kv.pool.num_free_blocks == 4
    vip = submit(scheduler, "vip", range(50, 70), max_tokens=4, priority=0)  # its prompt needs 5 blocks
    output = engine_step(scheduler, model)
    assert "vip" in output.num_scheduled_tokens and output.preempted_ids[0] == "low2"  # newest low first
    run_until_idle(scheduler, model)
    assert vip.num_preemptions == 0 and scheduler.stats().num_preemptions_priority >= 1
    for r in (*lows, vip):
        assert r.output_token_ids == expected_output(r.prompt_token_ids, r.sampling.max_tokens)
    assert_pool_whole(scheduler)


def test_a_request_is_preempted_for_priority_at_most_the_limit_and_classes_not_ranks_count():
    clock = FakeClock()
    scheduler, model = build(clock=clock, max_num_seqs=1, priority_preemption=True, max_priority_preemptions=1)
    low = submit(scheduler, "low", range(10), max_tokens=30, priority=5)
    engine_step(scheduler, model)
    clock.now += 1
    submit(scheduler, "vip1", range(40, 45), max_tokens=2, priority=0)
    assert engine_step(scheduler, model).preempted_ids == ("low",)
    run_until_idle_steps = 0
    while "low" not in {r.request_id for r in scheduler.running}:  # vip1 finishes, low resumes
        engine_step(scheduler, model)
        run_until_idle_steps += 1
        assert run_until_idle_steps < 20
    # A second important arrival cannot take low again: it has used its one preemption.
    submit(scheduler, "vip2", range(60, 65), max_tokens=2, priority=0)
    # Nor can one of the same class with a better rank (the router's fair rank lives in
    # `priority`; `priority_class` is what preemption compares).
    submit(scheduler, "rank0", range(70, 75), max_tokens=2, priority=0, priority_class=5)
    first, finished = _run_collecting(scheduler, model)
    assert first["vip2"] > finished["low"] and first["rank0"] > finished["low"]  # low ran to its end
    assert low.num_priority_preemptions == 1 and scheduler.stats().num_preemptions_priority == 1
    assert low.output_token_ids == expected_output(low.prompt_token_ids, 30)
    assert_pool_whole(scheduler)


# ---- priority preemption of KV reservations (scheduler.priority_preempts_kv_reservations) --

def _kv_bound(clock, num_started=5, **sched):
    """16 blocks of 4 = a 64-token budget, five low requests of 4 prompt + 8 output (12
    reserved each, 60 in all), the first `num_started` started one step apart (the rest
    admitted, not scheduled yet). A 12-token important request does not fit without taking
    one reservation."""
    sched.setdefault("priority_preemption", True)
    scheduler, model = build(num_blocks=16, clock=clock, **sched)
    lows = []
    for i in range(5):
        lows.append(submit(scheduler, f"low{i}", range(10 * i, 10 * i + 4), max_tokens=8, priority=1))
        clock.now += 1
        if i < num_started:
            engine_step(scheduler, model)
    return scheduler, model, lows


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_an_important_request_takes_the_newest_low_reservation_and_everyone_finishes_exactly(mode):
    clock = FakeClock()
    scheduler, model, lows = _kv_bound(clock, preemption_mode=mode, num_cpu_blocks=16 if mode == "swap" else 0)
    assert [r.status for r in lows] == [RequestStatus.DECODING] * 5
    vip = submit(scheduler, "vip", range(90, 94), max_tokens=8, priority=0)  # 60 + 12 > 64: takes one
    newest = lows[-1]
    assert (newest.owed_kv_tokens, newest.reserved_kv_tokens) == (12, 0)
    assert [r.owed_kv_tokens for r in lows[:-1]] == [0] * 4 and vip.reserved_kv_tokens == 12
    # The router sees the owed reservation as committed (no room for low newcomers) and,
    # of it, what the low classes hold (what a more important request may still take).
    reported = worker_stats(scheduler, "w0")
    assert (reported.kv_tokens_reserved, reported.kv_tokens_reserved_shared) == (72, 60)
    with pytest.raises(OverloadedError, match="12 owed to preempted requests"):
        submit(scheduler, "low5", range(60, 64), max_tokens=8, priority=1)  # cannot take its place
    output = engine_step(scheduler, model)
    assert output.preempted_ids == ("low4",) and "vip" in output.num_scheduled_tokens
    first, finished = _run_collecting(scheduler, model)
    assert finished["vip"] < finished["low4"]
    stats = scheduler.stats()
    assert (stats.num_preemptions_priority, stats.num_preemptions_priority_kv) == (1, 1)
    assert stats.num_preemptions_recompute + stats.num_preemptions_swap == 1
    assert (newest.num_preemptions, newest.num_priority_preemptions) == (1, 1)
    for r in (*lows, vip):  # nothing lost: the preempted request kept its tokens and finished exactly
        assert r.status is RequestStatus.FINISHED
        assert r.output_token_ids == expected_output(r.prompt_token_ids, r.sampling.max_tokens)
    assert_pool_whole(scheduler)  # blocks, reservations and owed reservations back to zero


def test_a_low_request_not_started_yet_loses_its_reservation_first_and_no_work():
    clock = FakeClock()
    scheduler, model, lows = _kv_bound(clock, num_started=4)  # low4 admitted, not scheduled yet
    assert lows[-1].status is RequestStatus.QUEUED
    vip = submit(scheduler, "vip", range(90, 94), max_tokens=8, priority=0)
    assert lows[-1].owed_kv_tokens == 12 and lows[3].owed_kv_tokens == 0
    output = engine_step(scheduler, model)
    assert output.preempted_ids == () and "vip" in output.num_scheduled_tokens  # it held no blocks
    assert "low4" not in output.num_scheduled_tokens  # nor room to reserve again yet
    run_until_idle(scheduler, model)
    stats = scheduler.stats()
    assert (stats.num_preemptions_priority_kv, stats.num_preemptions_recompute) == (1, 0)
    for r in (*lows, vip):
        assert r.output_token_ids == expected_output(r.prompt_token_ids, r.sampling.max_tokens)
    assert_pool_whole(scheduler)


def test_reservations_are_taken_only_from_less_important_classes_as_many_as_needed():
    clock = FakeClock()
    scheduler, model = build(num_blocks=16, clock=clock, priority_preemption=True)
    lows = []
    for i, priority in enumerate([2, 1, 2, 1, 1]):  # 60 of the 64 tokens reserved
        lows.append(submit(scheduler, f"low{i}", range(10 * i, 10 * i + 4), max_tokens=8, priority=priority))
        clock.now += 1
        engine_step(scheduler, model)
    # Class 1 may take only class 2's: the newest started of those (low2, not low0).
    mid = submit(scheduler, "mid", range(80, 84), max_tokens=8, priority=1)
    assert [r.request_id for r in lows if r.owed_kv_tokens] == ["low2"]
    # Class 0 needs 24 (60 + 24 - 64 = 20 over): class 2's last one, then class 1's newest,
    # mid, not started yet. What low2 owes does not count against it.
    vip = submit(scheduler, "vip", range(90, 94), max_tokens=20, priority=0)
    assert sorted(r.request_id for r in (*lows, mid) if r.owed_kv_tokens) == ["low0", "low2", "mid"]
    assert scheduler.stats().num_preemptions_priority_kv == 3
    run_until_idle(scheduler, model)
    for r in (*lows, mid, vip):
        assert r.output_token_ids == expected_output(r.prompt_token_ids, r.sampling.max_tokens)
    assert_pool_whole(scheduler)


def test_a_taken_reservation_lets_its_pinned_prefix_go_and_is_owed_whole():
    clock = FakeClock()
    scheduler, model = build(num_blocks=16, clock=clock, priority_preemption=True)  # 64 tokens
    prefix = list(range(1, 9))  # two full blocks the low requests share
    first = submit(scheduler, "low0", prefix + [20, 21, 22, 23], max_tokens=4, priority=1)  # 16 reserved
    for _ in range(2):
        engine_step(scheduler, model)
    clock.now += 1
    sharing = [submit(scheduler, f"low{i}", prefix + [10 * i + j for j in range(4)], max_tokens=4, priority=1)
               for i in (1, 2)]
    assert [r.reserved_kv_tokens for r in sharing] == [8, 8]  # their prefix pinned, not reserved
    vip = submit(scheduler, "vip", range(90, 94), max_tokens=40, priority=0)  # 32 + 44 -> 48: 16 over
    for r in sharing:  # both taken (not started: newest first), pins released, owed whole
        assert (r.owed_kv_tokens, r.request_id in scheduler.kv._pins) == (16, False)
    run_until_idle(scheduler, model)
    for r in (first, *sharing, vip):
        assert r.output_token_ids == expected_output(r.prompt_token_ids, r.sampling.max_tokens)
    assert_pool_whole(scheduler)


def test_taking_reservations_counts_the_pinned_prefix_only_the_victims_hold():
    scheduler, model = build(num_blocks=16, priority_preemption=True)  # 64 tokens
    prefix = list(range(1, 9))
    first = submit(scheduler, "low0", prefix + [20, 21, 22, 23], max_tokens=4, priority=1)
    run_until_idle(scheduler, model)  # its prefix stays cached; nobody's reservation pays for it now
    lows = [submit(scheduler, f"low{i}", prefix + [10 * i + j for j in range(4)], max_tokens=4, priority=1)
            for i in (1, 2)]
    assert scheduler.stats().kv_tokens_reserved == 8 + 8 + 8  # two reservations + the pinned prefix once
    assert worker_stats(scheduler, "w0").kv_tokens_reserved_shared == 24  # only low requests pin it
    # 24 committed + 64 > 64: their reservations free 16, their pinned prefix the last 8.
    vip = submit(scheduler, "vip", range(90, 94), max_tokens=60, priority=0)
    assert [r.owed_kv_tokens for r in lows] == [16, 16] and scheduler.stats().kv_tokens_reserved == 64 + 32
    run_until_idle(scheduler, model)
    for r in (first, *lows, vip):
        assert r.output_token_ids == expected_output(r.prompt_token_ids, r.sampling.max_tokens)
    assert_pool_whole(scheduler)


@pytest.mark.parametrize("switch", [dict(priority_preempts_kv_reservations=False), dict(priority_preemption=False)])
def test_with_the_switch_off_no_reservation_is_taken(switch):
    clock = FakeClock()
    scheduler, model, lows = _kv_bound(clock, **switch)
    with pytest.raises(OverloadedError, match="KV budget"):
        submit(scheduler, "vip", range(90, 94), max_tokens=8, priority=0)
    assert not any(r.owed_kv_tokens for r in lows)
    run_until_idle(scheduler, model)
    stats = scheduler.stats()
    assert (stats.num_preemptions_priority, stats.num_preemptions_recompute) == (0, 0)
    assert_pool_whole(scheduler)


def test_a_reservation_is_taken_at_most_the_limit_then_the_request_runs_to_its_end():
    clock = FakeClock()
    scheduler, model = build(num_blocks=16, clock=clock, priority_preemption=True, max_priority_preemptions=1)
    low = submit(scheduler, "low", range(4), max_tokens=56, priority=1)  # reserves 60 of 64
    engine_step(scheduler, model)
    submit(scheduler, "vip1", range(90, 94), max_tokens=8, priority=0)
    assert low.owed_kv_tokens == 60
    steps = 0
    while not low.reserved_kv_tokens:  # vip1 runs and ends; then low reserves again and resumes
        engine_step(scheduler, model)
        steps += 1
        assert steps < 20
    with pytest.raises(OverloadedError):  # its one preemption is spent
        submit(scheduler, "vip2", range(90, 94), max_tokens=8, priority=0)
    run_until_idle(scheduler, model)
    assert low.output_token_ids == expected_output(low.prompt_token_ids, 56)
    assert scheduler.stats().num_preemptions_priority_kv == 1
    assert_pool_whole(scheduler)


# ---- admission on expected output (scheduler.admission_reserve: expected) -----------------

def _teach_short_outputs(scheduler, model, num_output_tokens=2):
    """MIN_SAMPLES requests of tenant t that stop after `num_output_tokens` (as at a stop token)."""
    from kvmesh.kv.output_estimate import MIN_SAMPLES
    for i in range(MIN_SAMPLES):  # one at a time: each reserves its whole max_tokens until taught
        submit(scheduler, f"teach{i}", range(100 + i, 104 + i), max_tokens=20, tenant_id="t")
        while scheduler.has_unfinished():
            engine_step(scheduler, model)
            scheduler.finish_requests([r.request_id for r in scheduler.running
                                       if r.num_output_tokens >= num_output_tokens])
            scheduler.check_integrity()


def test_expected_output_admits_more_and_preemption_covers_a_wrong_estimate():
    # 16 blocks of 4 = 64 tokens. A request of 4 prompt + 20 max_tokens reserves 24 on
    # max_tokens, 4 + 4 (the floor; it learned outputs of 2) = 8 on expected.
    plain, _ = build(num_blocks=16)
    for i in range(2):
        submit(plain, f"r{i}", range(10 * i, 10 * i + 4), max_tokens=20, tenant_id="t")
    with pytest.raises(OverloadedError):  # 48 + 24 > 64
        submit(plain, "r2", range(20, 24), max_tokens=20, tenant_id="t")

    scheduler, model = build(num_blocks=16, admission_reserve="expected", expected_output_floor_tokens=4)
    _teach_short_outputs(scheduler, model)
    requests = [submit(scheduler, f"r{i}", range(10 * i, 10 * i + 4), max_tokens=20, tenant_id="t")
                for i in range(6)]  # 6 x 8 = 48 reserved: three times as many as max_tokens admits
    assert [r.reserved_kv_tokens for r in requests] == [8] * 6
    run_until_idle(scheduler, model)  # this time they run to max_tokens: 6 x 24 tokens > the pool
    stats = scheduler.stats()
    assert stats.num_outgrown_estimates == 6 and stats.num_preemptions_recompute > 0
    for r in requests:  # nothing lost: every request completes with its exact output
        assert r.output_token_ids == expected_output(r.prompt_token_ids, 20)
    assert_pool_whole(scheduler)


def test_a_request_outgrowing_its_estimate_tops_its_reservation_up_block_by_block():
    scheduler, model = build(num_blocks=64, admission_reserve="expected", expected_output_floor_tokens=4)
    _teach_short_outputs(scheduler, model)
    request = submit(scheduler, "long", range(4), max_tokens=14, tenant_id="t")
    assert request.reserved_kv_tokens == 8  # 4 prompt + 4 estimated
    reserved = []
    while scheduler.has_unfinished():
        engine_step(scheduler, model)  # check_integrity: the admission total matches every step
        reserved.append((request.num_output_tokens, request.reserved_kv_tokens))
    # Past 4 outputs it grows a block at a time, and never beyond prompt + max_tokens (rounded).
    assert (4, 8) in reserved and (5, 12) in reserved and (9, 16) in reserved
    assert max(r for _, r in reserved) == 4 * 5  # ceil((4 + 14) / 4) blocks
    assert scheduler.stats().num_outgrown_estimates == 1
    assert_pool_whole(scheduler)


def test_a_low_priority_flood_cannot_take_the_kv_share_kept_for_more_important_classes():
    # 16 blocks of 4 = 64 tokens; each request 4 prompt + 8 output = 12 reserved.
    flooded, _ = build(num_blocks=16)  # no reserved share: the flood takes the pool
    for i in range(5):
        submit(flooded, f"low{i}", range(10 * i, 10 * i + 4), max_tokens=8, priority=1)
    with pytest.raises(OverloadedError):  # 60 + 12 > 64
        submit(flooded, "high", range(90, 94), max_tokens=8, priority=0)

    # A quarter kept for class 0: classes >= 1 may commit 48 between them.
    scheduler, model = build(num_blocks=16, kv_reserved_fraction=0.25, kv_reserved_below_class=1)
    lows = [submit(scheduler, f"low{i}", range(10 * i, 10 * i + 4), max_tokens=8, priority=1 + i % 2)
            for i in range(4)]
    with pytest.raises(OverloadedError, match="kept for more important classes") as refused:
        submit(scheduler, "low4", range(40, 44), max_tokens=8, priority=1)
    assert refused.value.retry_after_s > 0
    high = submit(scheduler, "high", range(90, 94), max_tokens=8, priority=0)  # 48 + 12 <= 64
    assert scheduler.admission.shared_class_reserved_tokens == 48
    reported = worker_stats(scheduler, "w0")  # the split the router applies the same rules to
    assert (reported.kv_tokens_reserved, reported.kv_tokens_reserved_shared) == (60, 48)
    run_until_idle(scheduler, model)  # check_integrity (class share included) after every step
    for r in [*lows, high]:
        assert r.output_token_ids == expected_output(r.prompt_token_ids, 8)
    assert scheduler.admission.shared_class_reserved_tokens == 0
    assert_pool_whole(scheduler)
    submit(scheduler, "low5", range(50, 54), max_tokens=8, priority=1)  # the share is free again
