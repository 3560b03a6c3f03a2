"""The worker side of the router channels (worker/runtime/delta_channel.py), no Ray: one
message per engine step for all of a replica's requests, merged and bounded when the reader
lags, ended requests released; and the machine-fit topology of `kvmesh serve`."""

import asyncio

import pytest

from kvmesh.core.config import KvmeshConfig
from kvmesh.core.seams import FinishReason, GenerateRequest, RequestDelta, SamplingParams
from kvmesh.router.launch import machine_topology
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
        message = await anext(batches)
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
                for delta in message:
                    tokens[delta.request_id] = tokens.get(delta.request_id, 0) + len(delta.token_ids)
            await batches.aclose()
            await engine.submit(_request("r0", max_tokens=1), channel)  # the id is free again
            return tokens, messages
        finally:
            await engine.shutdown()

    tokens, messages = asyncio.run(scenario())
    assert tokens == {f"r{i}": 10 for i in range(8)}
    assert messages <= 2 * 10 + 2  # ~one a step (submits land a step or two apart), never one a request a step


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


@pytest.mark.parametrize("cpus,expected", [(1, (1, 1)), (2, (1, 2)), (4, (1, 4)), (8, (1, 7)), (9, (2, 4)),
                                           (16, (3, 5))])
def test_serve_topology_fits_the_machine(cpus, expected):
    assert machine_topology(cpus) == expected
