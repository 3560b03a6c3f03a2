"""Engine behaviour on a tiny random Llama: bad input, sampling reproducibility, stop
conditions, forward failures, n > 1, cancellation through the async front."""

import asyncio

import pytest

from kvmesh.core.config import KvmeshConfig
from kvmesh.core.seams import FinishReason, GenerateRequest, RequestDelta, SamplingParams, Usage, request_usage
from kvmesh.worker.runtime.async_engine import AsyncEngine, merge_deltas
from kvmesh.worker.engine_loop.engine import Engine
from kvmesh.core.errors import InvalidRequestError, OverloadedError


def _config(model_dir, **sections):
    data = {"model": {"path": model_dir, "dtype": "fp32", "max_model_len": 256},
            "cache": {"num_blocks": 64, "block_size": 8}}
    for name, values in sections.items():
        data.setdefault(name, {}).update(values)
    return KvmeshConfig.from_dict(data)


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return Engine.from_config(_config(tiny_model_dir))


def run(engine, requests):
    """Add requests, step to completion checking invariants; returns id -> deltas."""
    for r in requests:
        engine.add_request(r)
    out: dict[str, list] = {}
    while engine.has_unfinished():
        for d in engine.step():
            out.setdefault(d.request_id, []).append(d)
        engine.check_integrity()
    assert engine.stats().num_blocks_used == 0
    return out


def tokens(deltas, sample_index=0):
    return [t for d in deltas if d.sample_index == sample_index for t in d.token_ids]


def req(rid, prompt="Hello there, my friend", **sampling):
    sampling.setdefault("max_tokens", 8)
    return GenerateRequest(rid, prompt=prompt, sampling=SamplingParams(**sampling))


@pytest.mark.parametrize("bad, message", [
    (GenerateRequest("e1", prompt=""), "empty"),
    (GenerateRequest("e2", prompt="x " * 300), "max_model_len"),
    (req("e3", max_tokens=0), "max_tokens"),
    (req("e4", max_tokens=254), "max_model_len"),
    (req("e5", temperature=-0.5), "temperature"),
    (req("e6", top_p=0.0), "top_p"),
    (req("e7", top_p=1.5), "top_p"),
    (req("e8", top_k=-2), "top_k"),
    (GenerateRequest("e9", prompt_token_ids=(1, 2, 10 ** 9)), "unknown token"),
    (GenerateRequest("e10", prompt="a", prompt_token_ids=(1,)), "exactly one"),
])
def test_bad_input_gets_typed_error_and_engine_stays_healthy(engine, bad, message):
    with pytest.raises(InvalidRequestError, match=message):
        engine.add_request(bad)
    out = run(engine, [req("ok-after-" + bad.request_id, max_tokens=3)])
    assert out["ok-after-" + bad.request_id][-1].finish_reason == FinishReason.LENGTH


def test_duplicate_id_rejected_and_unknown_abort_is_noop(engine):
    engine.add_request(req("dup", max_tokens=4))
    with pytest.raises(InvalidRequestError, match="in flight"):
        engine.add_request(req("dup", max_tokens=4))
    assert engine.abort("no-such-request") == []
    out = run(engine, [])
    assert len(tokens(out["dup"])) == 4


def test_an_id_may_be_reused_once_its_request_has_finished(engine):
    """The scheduler reports a finished request on the step after it ends; a new request with
    the same id added in between must not be taken for it (and closed)."""
    first = run(engine, [req("again", max_tokens=5, temperature=0)])
    second = run(engine, [req("again", max_tokens=5, temperature=0)])
    for out in (first, second):
        assert [d.finish_reason for d in out["again"] if d.finished] == [FinishReason.LENGTH]
        assert len(tokens(out["again"])) == 5
    assert tokens(first["again"]) == tokens(second["again"])


def test_greedy_is_deterministic_and_batch_independent(engine):
    alone = run(engine, [req("g0", max_tokens=12, temperature=0)])
    batched = run(engine, [req(f"g{i}", prompt=p, max_tokens=12, temperature=0)
                           for i, p in enumerate(["Hello there, my friend", "Other words here", "1 2 3"], start=1)])
    assert tokens(alone["g0"]) == tokens(batched["g1"])


def test_seeded_sampling_reproducible_alone_and_in_batch(engine):
    params = dict(max_tokens=16, temperature=1.0, top_p=0.95, top_k=50, seed=1234)
    a = run(engine, [req("s-alone", **params)])
    b = run(engine, [req("s-batch", **params), req("other1", prompt="Noise noise", temperature=1.0, max_tokens=16),
                     req("other2", prompt="More unrelated text", temperature=0.7, max_tokens=10, seed=7)])
    assert tokens(a["s-alone"]) == tokens(b["s-batch"])
    c = run(engine, [req("s-other-seed", **{**params, "seed": 99})])
    assert tokens(c["s-other-seed"]) != tokens(a["s-alone"])


def test_stop_token_ids_and_min_tokens(engine):
    probe = run(engine, [req("probe", max_tokens=10, temperature=0)])
    seq = tokens(probe["probe"])
    stop_at = seq[3]
    first = seq.index(stop_at)
    out = run(engine, [req("stop-id", max_tokens=10, temperature=0, stop_token_ids=(stop_at,))])
    assert tokens(out["stop-id"]) == seq[:first + 1]
    assert out["stop-id"][-1].finish_reason == FinishReason.STOP
    # ignore_eos + max_tokens: exactly max_tokens, the benchmark convention
    out = run(engine, [req("exact", max_tokens=9, temperature=0, ignore_eos=True)])
    assert len(tokens(out["exact"])) == 9


def test_stop_string_is_not_emitted_and_found_across_tokens(engine):
    probe = run(engine, [req("probe-s", max_tokens=12, temperature=0)])
    text = "".join(d.text for d in probe["probe-s"])
    assert len(text) > 6
    stop = text[3:6]  # three characters: likely spans a token boundary
    out = run(engine, [req("stop-s", max_tokens=12, temperature=0, stop=(stop,))])
    got = "".join(d.text for d in out["stop-s"])
    assert got == text[:text.index(stop)]
    assert out["stop-s"][-1].finish_reason == FinishReason.STOP


def test_logprobs_and_usage(engine):
    out = run(engine, [req("lp", max_tokens=5, temperature=0, logprobs=True)])
    lps = [lp for d in out["lp"] if d.logprobs for lp in d.logprobs]
    assert len(lps) == 5 and all(lp <= 0.0 for lp in lps)
    final = out["lp"][-1]
    assert final.finished and final.usage.completion_tokens == 5 and final.usage.prompt_tokens > 0
    assert final.timings.ttft_s is not None and final.timings.ttft_s >= 0


def test_n_samples_share_prompt_blocks(engine):
    prompt = "A long shared prompt " * 6
    out = run(engine, [req("multi", prompt=prompt, max_tokens=6, temperature=1.0, seed=5, n=3)])
    finals = [d for d in out["multi"] if d.finished]
    assert sorted(d.sample_index for d in finals) == [0, 1, 2]
    assert len({tuple(tokens(out["multi"], i)) for i in range(3)}) > 1, "samples differ"
    assert all(d.usage.cached_tokens > 0 for d in finals if d.sample_index > 0), "later samples reuse the prompt"
    # each sample its own output: ignore_eos runs every one to max_tokens, no fewer
    out = run(engine, [req("each", prompt=prompt, max_tokens=6, temperature=1.0, seed=5, n=3, ignore_eos=True)])
    assert [len(tokens(out["each"], i)) for i in range(3)] == [6, 6, 6]
    assert all(d.usage.completion_tokens == 6 for d in out["each"] if d.finished)


def test_each_of_n_samples_runs_to_max_tokens_and_reports_its_own_usage(engine):
    """Siblings never share their output list: each reaches max_tokens on its own tokens, and
    its final usage counts those (per sample; request_usage sums them for the request)."""
    out = run(engine, [req("pair", prompt="Tell me", max_tokens=7, temperature=1.0, seed=5, n=2, ignore_eos=True)])
    finals = sorted((d for d in out["pair"] if d.finished), key=lambda d: d.sample_index)
    for final in finals:
        assert len(tokens(out["pair"], final.sample_index)) == final.usage.completion_tokens == 7
    total = request_usage([d.usage for d in finals])
    assert total == Usage(finals[0].usage.prompt_tokens, 14, min(d.usage.cached_tokens for d in finals))
    assert request_usage([]) is None


def test_evict_all_ends_every_request_retryably_and_returns_their_blocks(engine):
    """What a drained worker does with the requests its grace did not cover."""
    for i in range(3):
        engine.add_request(req(f"evict-{i}", max_tokens=50))
    for _ in range(3):
        engine.step()
    finals = engine.evict_all("worker drained")
    assert sorted(d.request_id for d in finals) == ["evict-0", "evict-1", "evict-2"]
    assert all(d.finished and d.error_type == "WorkerFailedError" and d.error == "worker drained" for d in finals)
    assert not engine.has_unfinished() and engine.stats().num_blocks_used == 0
    engine.check_integrity()


def test_forward_failure_fails_only_that_step(engine):
    calls = {"n": 0}

    def fail_once():
        calls["n"] += 1
        if calls["n"] == 2:  # a fault that cannot be produced otherwise: injected at the runner seam
            raise RuntimeError("injected device error")

    engine.runner.fault_hook = fail_once
    try:
        out = run(engine, [req("f1", max_tokens=6), req("f2", max_tokens=6)])
    finally:
        engine.runner.fault_hook = None
    for rid in ("f1", "f2"):
        assert out[rid][-1].finish_reason == FinishReason.ERROR
        assert out[rid][-1].error_type == "WorkerFailedError" and "injected" in out[rid][-1].error
    after = run(engine, [req("f3", max_tokens=4)])
    assert after["f3"][-1].finish_reason == FinishReason.LENGTH


def test_overload_and_queue_limits(tiny_model_dir):
    engine = Engine.from_config(_config(tiny_model_dir, scheduler={"max_queue_len": 2, "max_total_kv_tokens": 128}))
    engine.add_request(req("q1", max_tokens=40))
    with pytest.raises(OverloadedError) as info:
        engine.add_request(req("q2", prompt="word " * 60, max_tokens=40))  # fits ever, not now
    assert info.value.retry_after_s > 0
    with pytest.raises(InvalidRequestError):
        engine.add_request(req("q3", prompt="word " * 120, max_tokens=60))  # can never fit 128 tokens
    run(engine, [])


def test_async_cancel_frees_blocks(tiny_model_dir):
    async def scenario():
        aengine = AsyncEngine.from_config(_config(tiny_model_dir))
        try:
            got = []

            async def consume():
                async for d in aengine.generate(req("c1", max_tokens=200, ignore_eos=True)):
                    got.append(d)

            task = asyncio.create_task(consume())
            while len(got) < 3:
                await asyncio.sleep(0.01)
            assert (await aengine.stats_async()).num_blocks_used > 0
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            for _ in range(200):
                if (await aengine.stats_async()).num_blocks_used == 0:
                    break
                await asyncio.sleep(0.02)
            stats = await aengine.stats_async()
            assert stats.num_blocks_used == 0 and stats.num_running == 0 and stats.num_waiting == 0
            with pytest.raises(InvalidRequestError):
                async for _ in aengine.generate(GenerateRequest("bad", prompt="")):
                    pass
        finally:
            await aengine.shutdown()

    asyncio.run(scenario())


def test_queue_timeout_rejects_as_retryable_and_holds_nothing(tiny_model_dir):
    engine = Engine.from_config(_config(tiny_model_dir, scheduler={"max_num_seqs": 1, "max_queue_time_s": 0.05}))
    out = run(engine, [req("long", max_tokens=120, ignore_eos=True), req("starved", max_tokens=4)])
    assert len(tokens(out["long"])) == 120
    final = out["starved"][-1]
    assert final.finish_reason == FinishReason.ERROR and final.error_type == "OverloadedError"
    assert final.retry_after_s > 0 and final.usage.completion_tokens == 0


def test_async_batches_and_the_step_hook(tiny_model_dir):
    """generate_batches hands out the request's one queue in batches; the engine's phase clock
    reports each step that did work (what the actor's step-time metric observes), from the
    step thread."""
    step_times_s: list[float] = []

    async def scenario():
        aengine = AsyncEngine.from_config(_config(tiny_model_dir))
        aengine.engine.phase_clock.observers.append(lambda report: step_times_s.append(report.total_s))
        try:
            batches = []
            async for batch in aengine.generate_batches(req("b1", max_tokens=12, ignore_eos=True)):
                batches.append(batch)
                # A consumer that falls behind: once the request has finished in the engine,
                # everything it produced meanwhile is waiting and comes as one batch.
                while (await aengine.stats_async()).num_running:
                    await asyncio.sleep(0.01)
            return batches
        finally:
            await aengine.shutdown()

    batches = asyncio.run(scenario())
    deltas = [d for batch in batches for d in batch]
    assert len(batches) == 2 and all(batches)
    assert len(batches[1]) == 1, "what waited is one merged delta: one message to the router, not one a token"
    assert [d.finished for d in deltas] == [False] * (len(deltas) - 1) + [True]
    assert sum(len(d.token_ids) for d in deltas) == 12
    assert len(step_times_s) >= 12 and all(t > 0 for t in step_times_s)
def test_merge_deltas_joins_a_sample_s_consecutive_deltas_only():
    a = RequestDelta("r", text="a", token_ids=(1,), logprobs=(-0.1,))
    b = RequestDelta("r", text="b", token_ids=(2,), logprobs=(-0.2,))
    other_sample = RequestDelta("r", text="x", token_ids=(9,), logprobs=(-0.9,), sample_index=1)
    final = RequestDelta("r", text="c", token_ids=(3,), logprobs=(-0.3,), finished=True,
                         finish_reason=FinishReason.LENGTH)
    after_final = RequestDelta("r", text="z", token_ids=(4,), logprobs=(-0.4,))
    error = RequestDelta("r", finished=True, finish_reason=FinishReason.ERROR, error="boom", error_type="WorkerFailedError")
    merged = merge_deltas([a, b, final, after_final])
    assert merged[0] == RequestDelta("r", text="abc", token_ids=(1, 2, 3), logprobs=(-0.1, -0.2, -0.3), finished=True,
                                     finish_reason=FinishReason.LENGTH)
    assert merged[1] == after_final  # nothing joins a finished delta
    assert merge_deltas([a, other_sample, b]) == [a, other_sample, b]
    assert merge_deltas([a, error]) == [a, error]
    assert merge_deltas([a, RequestDelta("r", text="b", token_ids=(2,))]) == [a, RequestDelta("r", text="b", token_ids=(2,))]


def _steps_until_done(engine, first, later, after_steps):
    """Add `first`, step `after_steps` times, add `later`, run to the end. Returns (tokens by
    id, step of each id's first token, step each id finished), checking invariants."""
    for r in first:
        engine.add_request(r)
    out, first_token, finished, step = {}, {}, {}, 0
    while engine.has_unfinished():
        step += 1
        if step == after_steps + 1:
            for r in later:
                engine.add_request(r)
        for d in engine.step():
            out.setdefault(d.request_id, []).append(d)
            if d.token_ids:
                first_token.setdefault(d.request_id, step)
            if d.finished:
                finished[d.request_id] = step
        engine.check_integrity()
    assert engine.stats().num_blocks_used == 0
    return {rid: tokens(deltas) for rid, deltas in out.items()}, first_token, finished


def _low_and_vip(engine):
    """Two greedy low-priority requests of 24 tokens, one important of 4, and the tokens
    each produces on an unpressured engine (the reference a preempted request must match)."""
    greedy = dict(temperature=0.0, ignore_eos=True)
    low = [GenerateRequest(f"low{i}", prompt=f"Low priority story number {i}, told slowly",
                           sampling=SamplingParams(max_tokens=24, **greedy), priority=1) for i in range(2)]
    vip = GenerateRequest("vip", prompt="Urgent: the answer is", sampling=SamplingParams(max_tokens=4, **greedy))
    return low, vip, {rid: tokens(deltas) for rid, deltas in run(engine, [*low, vip]).items()}


@pytest.mark.parametrize("preemption", [True, False])
def test_priority_preemption_serves_the_important_request_first_with_the_same_greedy_output(
        tiny_model_dir, engine, preemption):
    low, vip, reference = _low_and_vip(engine)
    # Two slots, both held by low-priority requests when the important one arrives.
    full = Engine.from_config(_config(tiny_model_dir, scheduler={"max_num_seqs": 2,
                                                                 "priority_preemption": preemption}))
    outputs, first_token, finished = _steps_until_done(full, low, [vip], after_steps=3)
    assert outputs == reference  # every request completes, with the same greedy tokens
    low_done = [finished[r.request_id] for r in low]
    stats = full.stats()  # what the router's GetStats carries
    if preemption:
        assert first_token["vip"] < min(low_done)  # served before any low-priority one ends
        assert stats.num_preemptions_priority == 1 and stats.num_preemptions_recompute == 1
    else:
        assert first_token["vip"] > min(low_done)  # waited for a slot
        assert stats.num_preemptions_priority == 0


@pytest.mark.parametrize("take_reservations", [True, False])
def test_an_important_request_takes_a_low_kv_reservation_and_the_low_one_resumes_with_the_same_greedy_tokens(
        tiny_model_dir, engine, take_reservations):
    low, vip, reference = _low_and_vip(engine)
    # Slots to spare, but a KV budget the two low requests fill exactly (8-token blocks).
    budget = sum(-(-(len(engine.tokenize(r)) + 24) // 8) * 8 for r in low)
    full = Engine.from_config(_config(tiny_model_dir, scheduler={
        "max_total_kv_tokens": budget, "priority_preemption": True,
        "priority_preempts_kv_reservations": take_reservations}))
    if not take_reservations:
        for r in low:
            full.add_request(r)
        with pytest.raises(OverloadedError, match="KV budget"):  # nothing taken: refused (retryable)
            full.add_request(vip)
        outputs = {rid: tokens(deltas) for rid, deltas in run(full, []).items()}
        assert outputs == {r.request_id: reference[r.request_id] for r in low}
        assert (full.stats().num_preemptions_priority, full.stats().num_preemptions_recompute) == (0, 0)
        return
    outputs, first_token, finished = _steps_until_done(full, low, [vip], after_steps=3)
    assert outputs == reference  # the preempted request recomputed and continued: same greedy tokens
    assert finished["vip"] < min(finished[r.request_id] for r in low)
    stats = full.stats()
    assert (stats.num_preemptions_priority_kv, stats.num_preemptions_recompute) == (1, 1)
    assert stats.kv_tokens_reserved == 0 and stats.num_blocks_used == 0


def test_paced_streams_merge_under_the_message_budget_and_never_hold_the_first_or_final_delta(tiny_model_dir,
                                                                                              monkeypatch):
    """The actor's streams (paced=True) send at most scheduler.stream_messages_per_s messages
    a second in all: after the first message a stream waits its share of the budget, and the
    tokens made meanwhile come as one merged delta. The first delta goes out at once (TTFT),
    and the final delta ends the wait (E2E). The pace here is a million seconds: the stream
    can only end because the final delta ended the wait (a wait that ran out would hang,
    which the guard below turns into a failure; no duration is compared)."""
    from kvmesh.worker.runtime import async_engine

    pace_s = 1e6
    monkeypatch.setattr(async_engine, "_MAX_PACE_S", pace_s)

    async def scenario(budget_per_s: float, paced: bool):
        aengine = AsyncEngine.from_config(_config(tiny_model_dir, scheduler={"stream_messages_per_s": budget_per_s}))
        try:
            batches = [batch async for batch in aengine.generate_batches(
                req("p1", max_tokens=16, ignore_eos=True), paced=paced)]
            return batches, aengine.pace_s()
        finally:
            await aengine.shutdown()

    def run(paced: bool):
        try:  # a hang guard, far beyond any run's length: not a timing assertion
            return asyncio.run(asyncio.wait_for(scenario(1 / pace_s, paced=paced), timeout=600))
        except TimeoutError:
            raise AssertionError("the final delta did not end the paced wait") from None

    batches, idle_pace_s = run(paced=True)
    deltas = [d for batch in batches for d in batch]
    assert sum(len(d.token_ids) for d in deltas) == 16 and deltas[-1].finished
    # the first message is not held back: it leaves before the final delta (it carries the
    # first token, and any the engine made before the loop took it: how many is a race)
    assert not deltas[0].finished and len(deltas[0].token_ids) < 16, "the first token is not held back"
    assert len(batches) == 2, "the rest waited out the pace and came merged, ended early by the final delta"
    assert idle_pace_s == 0.0, "no open stream, no wait"

    unpaced, _ = run(paced=False)
    assert len(unpaced) > 2, "in-process consumers (generate) are never paced"


def test_pace_is_the_stream_s_share_of_the_budget(tiny_model_dir):
    """streams / budget seconds, capped; a budget of 0 turns pacing off."""
    from kvmesh.worker.runtime import async_engine

    aengine = AsyncEngine.from_config(_config(tiny_model_dir, scheduler={"stream_messages_per_s": 100.0}))
    try:
        aengine._streams.update({f"r{i}": None for i in range(32)})
        assert aengine.pace_s() == pytest.approx(0.32)
        aengine._streams.update({f"s{i}": None for i in range(200)})
        assert aengine.pace_s() == async_engine._MAX_PACE_S
        aengine._stream_budget_per_s = 0.0
        assert aengine.pace_s() == 0.0
    finally:
        aengine._streams.clear()
        asyncio.run(aengine.shutdown())


def test_the_engine_is_built_and_used_on_its_step_thread_only(tiny_model_dir):
    """One OpenMP thread team a worker process: the model is loaded, stepped and read for
    prefix export on the step thread (AsyncEngine.from_config); a build error reaches the caller."""
    import threading

    from kvmesh.worker.runtime.async_engine import AsyncEngine
    from kvmesh.worker.engine_loop.engine import Engine

    built_on = []

    def build():
        built_on.append(threading.current_thread())
        return Engine.from_config(_config(tiny_model_dir))

    async def scenario():
        aengine = AsyncEngine(build=build)
        try:
            assert built_on == [aengine._thread] and aengine._thread is not threading.current_thread()
            ran_on = await aengine.locked_async(lambda engine: threading.current_thread())
            assert ran_on is aengine._thread
            assert await asyncio.to_thread(aengine.locked, lambda engine: threading.current_thread()) is aengine._thread
            deltas = [d async for d in aengine.generate(req("t1", max_tokens=3, ignore_eos=True))]
            assert sum(len(d.token_ids) for d in deltas) == 3
        finally:
            await aengine.shutdown()

    asyncio.run(scenario())

    def broken():
        raise ValueError("no such model")

    with pytest.raises(ValueError, match="no such model"):
        AsyncEngine(build=broken)


def test_the_engine_says_which_router_dispatches_its_figures_hold(engine):
    """Read with its stats, per router replica: the highest dispatch it took in, and those
    still running or waiting (the router stops counting exactly those: admission_budget.py)."""
    sampling = SamplingParams(max_tokens=3, temperature=0)
    engine.add_request(GenerateRequest("d-a", prompt="one two", sampling=sampling, dispatch=("replica-a", 1)))
    engine.add_request(GenerateRequest("d-b", prompt="three", sampling=SamplingParams(max_tokens=3, n=2),
                                       dispatch=("replica-b", 5)))
    engine.add_request(GenerateRequest("d-x", prompt="four", sampling=sampling))  # not a router's dispatch
    report = engine.dispatch_report()
    assert report["replica-a"].seen_seq == 1 and report["replica-a"].live_seqs == {1}
    assert report["replica-b"].seen_seq == 5 and report["replica-b"].live_seqs == {5}
    assert engine.stats().num_waiting + engine.stats().num_running == 4
    engine.abort("d-a")
    while engine.has_unfinished():
        engine.step()
    report = engine.dispatch_report()
    assert report["replica-a"].live_seqs == frozenset() and report["replica-b"].live_seqs == frozenset()
    assert report["replica-a"].seen_seq == 1 and report["replica-b"].seen_seq == 5
    with pytest.raises(InvalidRequestError):  # refused before the scheduler: not taken in
        engine.add_request(GenerateRequest("d-c", prompt="x" * 5000, sampling=sampling, dispatch=("replica-a", 2)))
    assert engine.dispatch_report()["replica-a"].seen_seq == 1
