"""The batched sampler (worker/runner/sampler.py): one argmax for all greedy rows, batched filters
for the sampled ones, per-request generators kept."""

import torch

from kvmesh.core.seams import SamplingParams
import pytest

from kvmesh.worker.runner.sampler import SamplingRow, first_argmax, sample

VOCAB = 50


def _row(seed=None, **params):
    gen = None if seed is None else torch.Generator().manual_seed(seed)
    return SamplingRow(SamplingParams(**params), [1, 2, 3], [4], gen)


def _logits(n):
    return torch.randn(n, VOCAB, generator=torch.Generator().manual_seed(7)) * 3


def test_greedy_rows_take_the_argmax_and_logits_are_untouched():
    logits = _logits(5)
    before = logits.clone()
    rows = [_row(temperature=0), _row(temperature=0.8, seed=1), _row(temperature=0), _row(temperature=0),
            _row(temperature=1.0, top_k=1)]
    got = sample(logits, rows, torch.Generator().manual_seed(0)).token_ids
    best = logits.argmax(dim=-1).tolist()
    assert [got[0], got[2], got[3]] == [best[0], best[2], best[3]]
    assert got[4] == best[4], "top_k=1 leaves only the argmax"
    assert logits.equal(before)


def test_filters_that_leave_one_token_pick_the_argmax():
    logits = _logits(3)
    rows = [_row(top_p=1e-6, seed=3), _row(min_p=1.0, seed=4), _row(top_k=1, top_p=0.5, min_p=0.5)]
    got = sample(logits, rows, torch.Generator().manual_seed(0)).token_ids
    assert got == logits.argmax(dim=-1).tolist()


def test_top_k_keeps_only_the_k_best():
    logits = _logits(1).expand(64, VOCAB).contiguous()
    rows = [_row(top_k=3, seed=i) for i in range(64)]
    got = set(sample(logits, rows, torch.Generator().manual_seed(0)).token_ids)
    assert got <= set(torch.topk(logits[0], 3).indices.tolist()) and len(got) > 1


def test_seeded_row_samples_the_same_alone_or_batched():
    logits = _logits(4)
    alone = sample(logits[2:3], [_row(seed=11, top_p=0.9)], torch.Generator().manual_seed(0)).token_ids
    rows = [_row(temperature=0), _row(seed=5, top_k=5), _row(seed=11, top_p=0.9), _row(min_p=0.1)]
    batched = sample(logits, rows, torch.Generator().manual_seed(99)).token_ids
    assert batched[2] == alone[0]


def test_logprobs_are_those_of_the_chosen_tokens():
    logits = _logits(3)
    rows = [_row(temperature=0, logprobs=True), _row(seed=2, logprobs=True), _row(temperature=0)]
    result = sample(logits, rows, torch.Generator().manual_seed(0))
    want = torch.log_softmax(logits, dim=-1)
    for i, t in enumerate(result.token_ids):
        assert abs(result.logprobs[i] - float(want[i, t])) < 1e-6


@pytest.mark.parametrize("vocab", [49152, 32000, 1000, 300, 7])
def test_first_argmax_is_argmax_with_ties_nan_and_inf(vocab):
    gen = torch.Generator().manual_seed(vocab)
    many_ties = torch.randint(0, 4, (16, vocab), generator=gen).float()
    noise = torch.randn(16, vocab, generator=gen)
    special = noise.clone()
    special[0] = float("-inf")
    special[1, vocab // 2] = float("nan")
    special[2, -1] = float("inf")
    special[3, 0] = special[3, -1] = float("inf")
    special[4, vocab - 3:] = float("nan")
    for x in (many_ties, noise, special, noise.bfloat16(), noise[:1]):
        assert torch.equal(first_argmax(x), x.argmax(dim=-1))
