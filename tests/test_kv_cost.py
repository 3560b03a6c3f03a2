"""The one KV-cost rule, and router and worker agreeing on it for the same request."""

import pytest

from kvmesh.core.config import SchedulerConfig
from kvmesh.kv.kv_cost import blocks_for_tokens, request_kv_tokens
from kvmesh.router.admission import request_cost_tokens
from kvmesh.worker.engine_loop.admission import EngineAdmission
from kvmesh.core.seams import SamplingParams
from kvmesh.worker.engine_loop.request import Request


def test_block_rounding_n_and_cached_prefix():
    assert blocks_for_tokens(0, 16) == 0
    assert blocks_for_tokens(17, 16) == 2
    assert request_kv_tokens(40, 30, 16) == 80
    assert request_kv_tokens(100, 20, 16, n=3) == 3 * 128
    # 528 prompt tokens of which 512 (32 full blocks) are cached: only the rest is new
    assert request_kv_tokens(528, 32, 16, cached_prompt_tokens=512) == 16 * (35 - 32)
    # a partial cached block counts for nothing; the cache cannot cover more than the prompt
    assert request_kv_tokens(40, 8, 16, cached_prompt_tokens=15) == 48
    with pytest.raises(ValueError):
        blocks_for_tokens(4, 0)


@pytest.mark.parametrize("prompt,max_tokens,n", [(1, 1, 1), (15, 8, 4), (40, 30, 1), (100, 20, 3), (529, 7, 2)])
def test_router_and_worker_agree(prompt, max_tokens, n):
    block_size = 16
    sampling = SamplingParams(max_tokens=max_tokens, n=n)
    worker = EngineAdmission(SchedulerConfig(), capacity_tokens=1 << 20, block_size=block_size,
                                 clock=lambda: 0.0)
    child = Request.__new__(Request)
    child.prompt_token_ids = list(range(prompt))
    child.sampling = sampling
    per_child = worker.reservation_for(child)
    assert request_cost_tokens(prompt, sampling, block_size=block_size) == n * per_child
