"""Engine runs the engine-level tests share: the tiny random Llama engine, and one greedy
request run to its end with the invariants checked after every step."""

from __future__ import annotations

from typing import NamedTuple

from kvmesh.core.config import KvmeshConfig
from kvmesh.core.seams import GenerateRequest, SamplingParams, Usage
from kvmesh.worker.engine_loop.engine import Engine


def tiny_engine(model_dir: str, **cache) -> Engine:
    """fp32, max_model_len 512, block size 8 unless `cache` says otherwise."""
    return Engine.from_config(KvmeshConfig.from_dict({
        "model": {"path": model_dir, "dtype": "fp32", "max_model_len": 512},
        "cache": {"block_size": 8, **cache}}))


class GreedyRun(NamedTuple):
    tokens: list[int]
    usage: Usage
    num_forward_tokens: int  # tokens the model ran for this request


def generate_greedy(engine: Engine, request_id: str, prompt: str, salt: str | None = None,
                    max_tokens: int = 8) -> GreedyRun:
    engine.add_request(GenerateRequest(request_id, prompt=prompt, cache_salt=salt,
                                       sampling=SamplingParams(max_tokens=max_tokens, temperature=0)))
    before = engine.num_forward_tokens
    tokens, final = [], None
    while engine.has_unfinished():
        for delta in engine.step():
            tokens.extend(delta.token_ids)
            final = delta if delta.finished else final
        engine.check_integrity()
    return GreedyRun(tokens, final.usage, engine.num_forward_tokens - before)


def generate_all_greedy(engine: Engine, prompts: list[tuple[int, ...]], new_tokens: int) -> dict[str, list[int]]:
    """Token-id prompts r0, r1, ... all added at once, each generating exactly new_tokens
    greedy tokens; invariants checked after every step, every block returned at the end."""
    for i, ids in enumerate(prompts):
        engine.add_request(GenerateRequest(f"r{i}", prompt_token_ids=ids, sampling=SamplingParams(
            max_tokens=new_tokens, temperature=0, ignore_eos=True)))
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for delta in engine.step():
            tokens[delta.request_id].extend(delta.token_ids)
        engine.check_integrity()
    assert engine.stats().num_blocks_used == 0, "every finished request returns its blocks"
    return tokens
