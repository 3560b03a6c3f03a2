"""The KV cost of a request: the one rule both admission controllers (router and worker) use.

A request of n samples, each of prompt + max_tokens tokens, reserves whole blocks:

    cost = n x K x ceil((prompt + max_tokens) / K)          K = block_size

The engine submits the n samples as n children, each reserving its own prompt + output at
block granularity, so the router must count the same n x K x ceil(S / K) or it admits work
the workers then refuse. `cached_prompt_tokens` (a multiple of K: full blocks already resident
and shared) is subtracted once per sample, since a cache hit allocates no new block.
"""

from __future__ import annotations

from kvmesh.core.errors import RequestBudgetMismatchError
from kvmesh.core.seams import RequestBudget, SamplingParams


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    """Whole blocks needed to hold `num_tokens` (ceil division)."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    return -(-num_tokens // block_size)


def request_kv_tokens(prompt_tokens: int, max_tokens: int, block_size: int, *, n: int = 1,
                      cached_prompt_tokens: int = 0) -> int:
    """KV tokens the request reserves: n x K x ceil((prompt + max_tokens) / K), less the full
    blocks of its prompt already cached (`cached_prompt_tokens`, whole blocks only)."""
    cached_blocks = min(cached_prompt_tokens, prompt_tokens) // block_size
    per_sample_blocks = blocks_for_tokens(prompt_tokens + max_tokens, block_size) - cached_blocks
    return n * block_size * per_sample_blocks


def request_budget(prompt_tokens: int, sampling: SamplingParams, block_size: int) -> RequestBudget:
    """The request's budget (core/seams.RequestBudget): the one place its KV and output
    figures are computed from its prompt and sampling."""
    return RequestBudget(prompt_tokens=prompt_tokens, max_tokens=sampling.max_tokens, n=sampling.n,
                         block_size=block_size,
                         kv_tokens=request_kv_tokens(prompt_tokens, sampling.max_tokens, block_size, n=sampling.n))


def check_budget(budget: RequestBudget, prompt_tokens: int, sampling: SamplingParams, block_size: int) -> None:
    """Raise RequestBudgetMismatchError unless `budget` is the budget of this request on a
    worker of `block_size`: the worker serves the figures it was sent or none at all."""
    expected = request_budget(prompt_tokens, sampling, block_size)
    if budget != expected:
        raise RequestBudgetMismatchError(f"the request's carried budget {budget} does not match the request "
                                         f"({expected}); the router and this worker disagree")
