"""Failover resumption in the engine (tiny random Llama): a request that arrives with the
output another worker already streamed continues it exactly, streaming only what follows."""

import pytest

from kvmesh.core.config import KvmeshConfig
from kvmesh.core.errors import InvalidRequestError
from kvmesh.core.seams import GenerateRequest, SamplingParams
from kvmesh.worker.engine_loop.engine import Engine

PROMPT = "The rules of the house: shoes off, lights out at ten, and"


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return Engine.from_config(KvmeshConfig.from_dict({
        "model": {"path": tiny_model_dir, "dtype": "fp32", "max_model_len": 512},
        "cache": {"num_blocks": 64, "block_size": 8}}))


def _run(engine, rid, max_tokens=16, stop=(), **resume):
    engine.add_request(GenerateRequest(rid, prompt=PROMPT, **resume,
                                       sampling=SamplingParams(max_tokens=max_tokens, temperature=0, stop=stop)))
    deltas = []
    while engine.has_unfinished():
        deltas += engine.step()
        engine.check_integrity()
    return deltas


@pytest.mark.parametrize("cut", [1, 7, 15])
def test_a_resumed_request_streams_exactly_the_rest(engine, cut):
    whole = _run(engine, f"whole-{cut}")
    tokens = [t for d in whole for t in d.token_ids]
    streamed = whole[:cut]  # what reached the client before the worker died (one token a delta)
    streamed_ids = [t for d in streamed for t in d.token_ids]
    rest = _run(engine, f"rest-{cut}", resume_token_ids=tuple(streamed_ids),
                resume_text_chars=sum(len(d.text) for d in streamed))
    assert streamed_ids + [t for d in rest for t in d.token_ids] == tokens
    assert "".join(d.text for d in streamed + rest) == "".join(d.text for d in whole)
    final = rest[-1]
    assert final.finished and final.finish_reason == whole[-1].finish_reason
    assert final.usage.prompt_tokens == whole[-1].usage.prompt_tokens
    assert final.usage.completion_tokens == len(tokens)


def test_resumption_is_refused_when_it_cannot_continue(engine):
    with pytest.raises(InvalidRequestError):
        _run(engine, "spent", max_tokens=2, resume_token_ids=(5, 6))
    with pytest.raises(InvalidRequestError):
        _run(engine, "bad-id", resume_token_ids=(10**9,))
    with pytest.raises(InvalidRequestError):
        engine.add_request(GenerateRequest("n2", prompt=PROMPT, resume_token_ids=(5,),
                                           sampling=SamplingParams(max_tokens=4, n=2, temperature=0)))
    assert not engine.has_unfinished()
