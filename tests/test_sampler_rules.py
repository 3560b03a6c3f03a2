"""The sampler's rules on hand-made logits, through `sample` only: penalties, min_p, top_k,
top_p, min_tokens blocking, temperature, and draws that follow the distribution.
(Greedy rows, logprobs and batch-invariant seeded rows: tests/test_sampler.py when present.)"""

import pytest
import torch

from kvmesh.core.seams import SamplingParams
from kvmesh.worker.runner.sampler import SamplingRow, sample

PROBS = torch.tensor([0.5, 0.3, 0.15, 0.05])


def row(prompt=(), output=(), generator=None, blocked=(), **params) -> SamplingRow:
    return SamplingRow(SamplingParams(**params), list(prompt), list(output), generator, tuple(blocked))


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def drawn(probs: torch.Tensor, draws: int = 300, **params) -> set[int]:
    """The tokens `draws` seeded draws produce from `probs` (as logits) under `params`."""
    logits = torch.log(probs).unsqueeze(0)
    return {sample(logits, [row(generator=gen(s), **params)], gen(0)).token_ids[0] for s in range(draws)}


def test_no_logprobs_unless_asked():
    assert sample(torch.zeros(1, 4), [row(temperature=0.0)], gen(0)).logprobs is None


@pytest.mark.parametrize("params, kept", [
    ({}, {0, 1, 2, 3}),
    ({"top_k": 2}, {0, 1}),
    ({"top_p": 0.5}, {0}),  # the smallest prefix reaching 0.5
    ({"top_p": 0.6}, {0, 1}),
    ({"min_p": 0.25}, {0, 1, 2}),  # below 0.25 x the top probability (0.125) is dropped
])
def test_filters_keep_exactly_what_each_rule_says(params, kept):
    assert drawn(PROBS, **params) == kept


def test_draw_frequencies_follow_the_distribution():
    probs = torch.tensor([0.7, 0.2, 0.1])
    logits = torch.log(probs).unsqueeze(0)
    counts = torch.zeros(3)
    g = gen(1)
    for _ in range(3000):
        counts[sample(logits, [row()], g).token_ids[0]] += 1
    assert torch.allclose(counts / counts.sum(), probs, atol=0.03)


def test_penalties():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    # repetition: seen tokens (prompt or output) are pushed away from being chosen
    assert sample(logits, [row(prompt=[0], temperature=0.0, repetition_penalty=4.0)], gen(0)).token_ids == [2]
    # presence/frequency: output counts subtract from the logits (token 0 twice: 2 - 2 x 1.0)
    assert sample(logits, [row(output=[0, 0], temperature=0.0, frequency_penalty=1.0)], gen(0)).token_ids == [2]
    assert sample(logits, [row(output=[0], temperature=0.0, presence_penalty=1.5)], gen(0)).token_ids == [2]


def test_blocked_tokens_only_until_min_tokens():
    logits = torch.tensor([[5.0, 1.0, 0.0]])
    early = row(output=[1], blocked=[0], temperature=0.0, max_tokens=8, min_tokens=2)
    assert sample(logits, [early], gen(0)).token_ids == [1]
    late = row(output=[1, 1], blocked=[0], temperature=0.0, max_tokens=8, min_tokens=2)
    assert sample(logits, [late], gen(0)).token_ids == [0]


def test_temperature_sharpens():
    logits = torch.tensor([[1.0, 0.0]])
    cold = sum(sample(logits, [row(temperature=0.05)], gen(s)).token_ids[0] == 0 for s in range(100))
    warm = sum(sample(logits, [row(temperature=5.0)], gen(s)).token_ids[0] == 0 for s in range(100))
    assert cold == 100 and warm < 90
