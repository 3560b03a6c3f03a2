"""The sampler on hand-made logits: each stage of the pipeline (penalties, greedy, min_p,
top_k, top_p, the seeded draw) and its contract (logprobs from the unmodified distribution,
the caller's logits untouched, a seeded row samples the same alone or in a batch)."""

import pytest
import torch

from kvmesh.core.seams import SamplingParams
from kvmesh.worker.modeling.sampler import SamplingRow, _filter, sample


def row(prompt=(), output=(), generator=None, blocked=(), **params) -> SamplingRow:
    return SamplingRow(SamplingParams(**params), list(prompt), list(output), generator, tuple(blocked))


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_greedy_takes_the_argmax_and_reports_its_logprob():
    logits = torch.tensor([[0.1, 2.0, -1.0, 1.5]])
    before = logits.clone()
    result = sample(logits, [row(temperature=0.0, logprobs=True)], gen(0))
    assert result.token_ids == [1]
    assert result.logprobs == [pytest.approx(float(torch.log_softmax(before, -1)[0, 1]))]
    assert torch.equal(logits, before)  # the caller's logits are not modified


def test_no_logprobs_unless_asked():
    assert sample(torch.zeros(1, 4), [row(temperature=0.0)], gen(0)).logprobs is None


def test_filters_keep_what_each_rule_says():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    assert _filter(probs, SamplingParams(top_k=2)).tolist() == pytest.approx([0.625, 0.375, 0, 0])
    assert _filter(probs, SamplingParams(top_p=0.5)).tolist() == pytest.approx([1, 0, 0, 0])
    assert _filter(probs, SamplingParams(top_p=0.6)).tolist() == pytest.approx([0.625, 0.375, 0, 0])
    # min_p 0.25: anything below 0.25 x the top probability (0.125) is dropped
    assert _filter(probs, SamplingParams(min_p=0.25)).tolist() == pytest.approx([0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0])


def test_draws_only_from_what_the_filters_kept():
    logits = torch.log(torch.tensor([[0.4, 0.35, 0.25]]))
    drawn = {sample(logits, [row(top_k=2, generator=gen(s))], gen(0)).token_ids[0] for s in range(200)}
    assert drawn == {0, 1}


def test_draw_frequencies_follow_the_distribution():
    probs = torch.tensor([0.7, 0.2, 0.1])
    logits = torch.log(probs).unsqueeze(0)
    counts = torch.zeros(3)
    g = gen(1)
    for _ in range(3000):
        counts[sample(logits, [row()], g).token_ids[0]] += 1
    assert torch.allclose(counts / counts.sum(), probs, atol=0.03)


def test_a_seeded_row_samples_the_same_alone_or_in_a_batch():
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    alone = sample(logits[1:2], [row(generator=gen(7))], gen(0)).token_ids[0]
    rows = [row(generator=gen(99)), row(generator=gen(7)), row(temperature=0.0)]
    batched = sample(logits, rows, gen(123)).token_ids
    assert batched[1] == alone
    assert batched[2] == int(torch.argmax(logits[2]))


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
    cold = sum(sample(logits, [row(temperature=0.05)], g).token_ids[0] == 0 for g in [gen(s) for s in range(100)])
    warm = sum(sample(logits, [row(temperature=5.0)], g).token_ids[0] == 0 for g in [gen(s) for s in range(100)])
    assert cold == 100 and warm < 90
