"""The worker side of the router channels (worker/runtime/delta_channel.py), no Ray: one
message per engine step for all of a replica's requests, merged and bounded when the reader
lags, ended requests released; the message format (core/delta_wire.py); and the machine-fit
topology of `kvmesh serve`. The channel's socket: tests/test_channel_socket.py."""

import asyncio
import random

import pytest

from kvmesh.core import delta_wire
from kvmesh.core.config import KvmeshConfig
from kvmesh.core.seams import FinishReason, GenerateRequest, RequestDelta, SamplingParams, Usage
from kvmesh.router.launch import machine_defaults, machine_topology
from kvmesh.load_tests.null_engine import NullEngine
from kvmesh.worker.runtime.async_engine import AsyncEngine
from kvmesh.worker.runtime.delta_channel import DeltaChannel


def _request(rid: str, max_tokens: int, n: int = 1) -> GenerateRequest:
    return GenerateRequest(rid, prompt_token_ids=(1, 2, 3), sampling=SamplingParams(max_tokens=max_tokens, n=n,
                                                                                     ignore_eos=True))


def test_a_lagging_reader_gets_one_merged_delta_per_sample_and_ended_requests_are_released():
    async def scenario():
        channel = DeltaChannel(asyncio.get_running_loop())
        ended = []
        channel.open_request("a", 1, ended.append)
        channel.open_request("b", 2, ended.append)
        for step in range(50):  # 50 steps while nobody reads
            channel.put(RequestDelta("a", text="x", token_ids=(step,)))
            channel.put(RequestDelta("b", text="y", token_ids=(step,), sample_index=step % 2))
        channel.put(RequestDelta("a", finished=True, finish_reason=FinishReason.LENGTH))
        channel.put(RequestDelta("b", finished=True, finish_reason=FinishReason.LENGTH, sample_index=0))
        channel.put(RequestDelta("b", error_type="WorkerFailedError", error="boom",
                                 finish_reason=FinishReason.ERROR, finished=True, sample_index=1))
        channel.put(RequestDelta("a", text="late"))  # after its end: dropped
        batches = channel.batches()
        message = delta_wire.to_request_deltas(delta_wire.decode(await anext(batches)))
        await batches.aclose()
        return message, ended, channel.request_ids()

    message, ended, live = asyncio.run(scenario())
    a = [d for d in message if d.request_id == "a"]
    assert len(a) == 1 and a[0].token_ids == tuple(range(50)) and a[0].finished  # one delta, all tokens
    b = [d for d in message if d.request_id == "b"]
    assert len(b) <= 52  # b's samples interleave, so they merge only as far as they run
    assert sum(len(d.token_ids) for d in b) == 50 and b[-1].error_type == "WorkerFailedError"
    assert [d.request_id for d in ended] == ["a", "b"] and live == []


def test_every_step_of_all_a_replica_s_requests_leaves_as_one_message():
    """AsyncEngine.submit over the null engine: 8 requests on one channel, read as they come,
    arrive in about one message per step (not 8), every token once, and the engine forgets
    each request at its end (a second submit of the same id is accepted)."""
    config = KvmeshConfig.from_dict({"scheduler": {"max_num_seqs": 16}})

    async def scenario():
        engine = AsyncEngine(NullEngine(config, step_s=0.01))
        channel = DeltaChannel(asyncio.get_running_loop())
        ended = []
        try:
            for i in range(8):
                await engine.submit(_request(f"r{i}", max_tokens=10), channel, on_end=ended.append)
            tokens: dict[str, int] = {}
            messages = 0
            batches = channel.batches()
            while len(ended) < 8:
                message = await asyncio.wait_for(anext(batches), 10)
                messages += 1
                for delta in delta_wire.decode(message):
                    tokens[delta.request_id] = tokens.get(delta.request_id, 0) + len(delta.token_ids)
            await batches.aclose()
            await engine.submit(_request("r0", max_tokens=1), channel)  # the id is free again
            return tokens, messages
        finally:
            await engine.shutdown()

    tokens, messages = asyncio.run(scenario())
    assert tokens == {f"r{i}": 10 for i in range(8)}
    assert messages <= 2 * 10 + 2  # ~one a step (submits land a step or two apart), never one a request a step


def _counted(null: NullEngine, method: str) -> list[int]:
    """Count the calls of `null.<method>` from now on (a one-element list, read after the run)."""
    calls = [0]
    original = getattr(null, method)

    def counted(*args):
        calls[0] += 1
        return original(*args)

    setattr(null, method, counted)
    return calls


async def _run_to_end(engine: AsyncEngine, request: GenerateRequest) -> RequestDelta:
    """Submit `request` on a channel of its own and read it to its end; its final delta."""
    channel = DeltaChannel(asyncio.get_running_loop())
    ended = []
    await asyncio.wait_for(engine.submit(request, channel, on_end=ended.append), 10)
    batches = channel.batches()
    while not ended:
        await asyncio.wait_for(anext(batches), 10)
    await batches.aclose()
    return ended[0]


def test_the_step_thread_sleeps_until_an_idle_engine_s_next_work_is_due():
    """An engine that says when its next work is due (idle_wait_s) is not polled meanwhile:
    the null engine at 50 ms steps is stepped about once a step, not every 2 ms (which the
    stack benchmark would count as the stack's CPU)."""
    null = NullEngine(KvmeshConfig.from_dict({"scheduler": {"max_num_seqs": 4}}), step_s=0.05)
    steps = _counted(null, "step")

    async def scenario():
        engine = AsyncEngine(null)
        try:
            await _run_to_end(engine, _request("r", max_tokens=8))
        finally:
            await engine.shutdown()

    asyncio.run(scenario())
    assert steps[0] <= 3 * 8  # 8 tokens over ~0.35 s: polling every 2 ms would step ~175 times


def test_the_idle_step_thread_waits_for_a_command_instead_of_polling_its_inbox():
    """With nothing to run, the step thread sleeps until a command sets its wakeup: over 0.4 s
    idle it looks at the engine about once (a 50 ms poll would look ~8 times), and a request
    submitted then still starts at once and runs to its end."""
    null = NullEngine(KvmeshConfig.from_dict({"scheduler": {"max_num_seqs": 4}}), step_s=0.001)
    looks = _counted(null, "has_unfinished")

    async def scenario():
        engine = AsyncEngine(null)
        try:
            await asyncio.sleep(0.4)
            idle_looks = looks[0]
            return idle_looks, await _run_to_end(engine, _request("r", max_tokens=3))
        finally:
            await engine.shutdown()

    idle_looks, final = asyncio.run(scenario())
    assert idle_looks <= 3 and final.finished


def test_a_refused_submit_leaves_nothing_on_the_channel():
    config = KvmeshConfig.from_dict({"scheduler": {"max_num_seqs": 1}})

    async def scenario():
        engine = AsyncEngine(NullEngine(config, step_s=0.01))
        channel = DeltaChannel(asyncio.get_running_loop())
        try:
            await engine.submit(_request("one", max_tokens=1000), channel)
            with pytest.raises(Exception) as refused:
                await engine.submit(_request("two", max_tokens=5), channel)
            await engine.abort("one")
            return type(refused.value).__name__, channel.request_ids()
        finally:
            await engine.shutdown()

    refused, live = asyncio.run(scenario())
    assert refused == "OverloadedError" and "two" not in live


def _random_stream(rng: random.Random, rid: str, n: int) -> list[RequestDelta]:
    """Deltas of an n-sample request as an engine emits them: samples interleaved, some with
    logprobs, each sample's last delta final (one may end with an error instead)."""
    left = {i: rng.randint(1, 6) for i in range(n)}
    logprobs = rng.random() < 0.3
    out = []
    while left:
        i = rng.choice(sorted(left))
        left[i] -= 1
        token = rng.randint(0, 99)
        lp = (-0.5,) if logprobs else None
        if left[i]:
            out.append(RequestDelta(rid, text=f"t{token}", token_ids=(token,), logprobs=lp, sample_index=i))
            continue
        del left[i]
        if rng.random() < 0.1:
            out.append(RequestDelta(rid, finished=True, finish_reason=FinishReason.ERROR, error="boom",
                                    error_type="WorkerFailedError", sample_index=i))
        else:
            out.append(RequestDelta(rid, text=f"t{token}", token_ids=(token,), logprobs=lp, finished=True,
                                    finish_reason=FinishReason.LENGTH, usage=Usage(3, 4), sample_index=i))
    return out


def _per_sample(deltas: list[RequestDelta]) -> dict[int, tuple]:
    """What a client reads of each sample: its text, token ids, logprobs and how it ended."""
    out: dict[int, tuple] = {}
    for d in deltas:
        text, ids, lps, end = out.get(d.sample_index, ("", (), (), None))
        out[d.sample_index] = (text + d.text, ids + d.token_ids, lps + (d.logprobs or ()),
                               (d.finish_reason, d.error_type, d.usage) if d.finished else end)
    return out


def test_packed_messages_carry_every_token_and_final_in_order_whatever_the_split():
    """Any split of a request's deltas into messages (the reader keeping up, or lagging by any
    number of steps), packed, encoded, decoded and read back, gives each sample the same text,
    tokens, logprobs and ending as the deltas themselves; plain increments travel as TokenDelta."""
    rng = random.Random(7)
    for case in range(300):
        deltas = _random_stream(rng, f"t/r{case}", rng.randint(1, 3))
        cuts = sorted(rng.sample(range(1, len(deltas)), rng.randint(0, len(deltas) - 1))) if len(deltas) > 1 else []
        read: list[RequestDelta] = []
        for start, end in zip([0] + cuts, cuts + [len(deltas)]):
            items = delta_wire.decode(delta_wire.encode(delta_wire.pack(deltas[start:end])))
            assert all(isinstance(i, RequestDelta) or type(i) is delta_wire.TokenDelta for i in items)
            assert all(not delta_wire.is_plain(i) for i in items if isinstance(i, RequestDelta))
            read += delta_wire.to_request_deltas(items)
        assert _per_sample(read) == _per_sample(deltas), case


@pytest.mark.parametrize("cpus,expected", [(1, (1, 1)), (2, (1, 2)), (4, (1, 4)), (8, (1, 7)), (9, (2, 4)),
                                           (16, (3, 5))])
def test_serve_topology_fits_the_machine(cpus, expected):
    assert machine_topology(cpus) == expected


@pytest.mark.parametrize("cpus,sched_idle", [(1, True), (2, True), (4, True), (8, False), (16, False)])
def test_router_runs_on_idle_cores_where_the_engine_takes_every_core(cpus, sched_idle):
    """Up to 4 cores the engine has a thread on each, so the router replica gets SCHED_IDLE;
    above, one core is left to the stack and the replica keeps the ordinary policy."""
    workers, threads = machine_topology(cpus)
    assert machine_defaults(cpus) == {"parallel": {"num_workers": workers, "cpu_threads": threads},
                                      "router": {"sched_idle": sched_idle}}
