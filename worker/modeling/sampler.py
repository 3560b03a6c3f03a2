"""Batched sampling with per-request parameters.

One row of logits per request that samples this step. The pipeline, in vLLM's order:
penalties (repetition, presence, frequency) -> greedy short-cut -> temperature -> min_p ->
top_k -> top_p -> draw. Drawing uses the exponential-race trick (argmax(p / q) with
q ~ Exp(1)), with q drawn from the request's own generator when it has a seed, so a seeded
request samples the same tokens alone or in any batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvmesh.core.seams import SamplingParams


@dataclass
class SamplingRow:
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None  # per-request, seeded; None = the engine's generator
    min_tokens_block: tuple[int, ...] = ()  # token ids forbidden while output < min_tokens


@dataclass(frozen=True)
class SampleResult:
    token_ids: list[int]
    logprobs: list[float] | None  # logprob of each chosen token (from the unmodified distribution)


def _apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    vocab = logits.shape[1]
    for i, row in enumerate(rows):
        p = row.params
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(row.prompt_token_ids) | set(row.output_token_ids)), dtype=torch.long)
            seen = seen[seen < vocab]
            vals = logits[i, seen]
            logits[i, seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if (p.presence_penalty != 0.0 or p.frequency_penalty != 0.0) and row.output_token_ids:
            counts = torch.bincount(torch.tensor(row.output_token_ids, dtype=torch.long), minlength=vocab)[:vocab]
            logits[i] -= p.frequency_penalty * counts.to(logits.dtype) + p.presence_penalty * (counts > 0).to(logits.dtype)
        if row.min_tokens_block and len(row.output_token_ids) < p.min_tokens:
            logits[i, list(row.min_tokens_block)] = float("-inf")


def _filter(probs: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """probs: [V] -> filtered, renormalised probs (min_p, top_k, top_p)."""
    if p.min_p > 0.0:
        probs = torch.where(probs < p.min_p * probs.max(), torch.zeros_like(probs), probs)
    if p.top_k > 0 and p.top_k < probs.shape[0]:
        kth = torch.topk(probs, p.top_k).values[-1]
        probs = torch.where(probs < kth, torch.zeros_like(probs), probs)
    if p.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        cum = torch.cumsum(sorted_p, 0)
        drop_sorted = (cum - sorted_p) >= p.top_p  # keep the smallest prefix reaching top_p
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        probs = torch.where(drop, torch.zeros_like(probs), probs)
    return probs / probs.sum()


def sample(logits: torch.Tensor, rows: list[SamplingRow], default_generator: torch.Generator) -> SampleResult:
    """logits: [N, V] fp32, one row per entry of `rows`. Does not modify `logits`."""
    logits = logits.clone()
    want_logprobs = any(r.params.logprobs for r in rows)
    base_logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None
    _apply_penalties(logits, rows)
    chosen: list[int] = []
    for i, row in enumerate(rows):
        p = row.params
        if p.greedy:
            chosen.append(int(torch.argmax(logits[i])))
            continue
        probs = torch.softmax(logits[i] / p.temperature, dim=-1)
        probs = _filter(probs, p)
        gen = row.generator or default_generator
        q = torch.empty_like(probs).exponential_(1.0, generator=gen)
        chosen.append(int(torch.argmax(probs / q)))
    logprobs = None
    if base_logprobs is not None:
        logprobs = [float(base_logprobs[i, t]) for i, t in enumerate(chosen)]
    return SampleResult(chosen, logprobs)
