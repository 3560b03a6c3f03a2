"""Verification of drafted tokens: which of a request's k drafts the target model keeps.

A speculating request runs k + 1 rows through the target in one forward: its last known
token and its k drafts d_1..d_k. Row i's logits give the target's distribution p_i for the
token after d_1..d_i (row 0: after the known tokens). Each row is treated exactly as the
plain sampler would treat it at that point of the output: penalties and the min_tokens
block see the output with d_1..d_i appended (`position_rows`).

    greedy:   accept d_{i+1} while argmax p_i == d_{i+1}; the first mismatch emits
              argmax p_i instead; all k accepted emits argmax p_k too (the bonus token).
              Token-identical to decoding one token per step.
    sampled:  drafts here are one-hot (a deterministic proposer), so the standard rule
              accept with probability min(1, p_i(d) / q_i(d)) becomes p_i(d), and on
              rejection the next token is drawn from the residual
              max(p_i - q_i, 0) / sum = p_i with d removed, renormalised. Every emitted
              token is then distributed exactly as p_i (Leviathan et al. 2023, thm. 1).

Random numbers come from the request's own generator when it has a seed (reproducible in
any batch, though not the same stream as non-speculative decoding).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from kvmesh.worker.runner.sampler import SamplingRow, _apply_penalties, _filter


@dataclass(frozen=True)
class Verified:
    accepted: tuple[int, ...]  # the drafts kept, a prefix of the proposal
    next_token: int  # the correction (first rejected position) or the bonus token
    # Requests asking for logprobs: each emitted token's (accepted..., next) logprob under the
    # target's unmodified distribution at its position, as the plain sampler reports them.
    logprobs: tuple[float, ...] | None = None

    @property
    def token_ids(self) -> tuple[int, ...]:
        return self.accepted + (self.next_token,)


def position_rows(row: SamplingRow, drafts: tuple[int, ...]) -> list[SamplingRow]:
    """The k + 1 sampling rows of a speculating request: row i sees drafts[:i] as output."""
    return [row] + [dataclasses.replace(row, output_token_ids=list(row.output_token_ids) + list(drafts[:i]))
                    for i in range(1, len(drafts) + 1)]


def _draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One token from `probs` [V] (exponential race, as the plain sampler draws)."""
    q = torch.empty_like(probs).exponential_(1.0, generator=generator)
    return int((probs / q).argmax())


def verify(logits: torch.Tensor, drafts: list[tuple[int, ...]], rows: list[SamplingRow],
           default_generator: torch.Generator) -> list[Verified]:
    """logits: [sum(len(d) + 1), V] fp32, each request's k + 1 rows consecutive in `drafts`
    order; rows: one SamplingRow per request (as of its known output). Does not modify logits."""
    # Structured output masks are per position: constrained requests never speculate (Speculator.skip).
    assert all(r.allowed is None for r in rows), "a constrained request reached draft verification"
    flat_rows = [r for row, d in zip(rows, drafts) for r in position_rows(row, d)]
    assert logits.shape[0] == len(flat_rows), "one logits row per verified position"
    raw = logits
    if any(r.params.repetition_penalty != 1.0 or r.params.presence_penalty != 0.0
           or r.params.frequency_penalty != 0.0 or r.min_tokens_block for r in flat_rows):
        logits = logits.clone()
        _apply_penalties(logits, flat_rows)
    greedy_tokens = logits.argmax(dim=-1).tolist()
    drawn = [i for i, r in enumerate(flat_rows) if not r.params.greedy]
    probs: dict[int, torch.Tensor] = {}
    if drawn:
        params = [flat_rows[i].params for i in drawn]
        temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype)[:, None]
        filtered = _filter(torch.softmax(logits[drawn] / temps, dim=-1), params)
        probs = dict(zip(drawn, filtered))
    results = []
    start = 0
    for row, proposal in zip(rows, drafts):
        generator = row.generator or default_generator
        accepted: list[int] = []
        next_token = None
        for i, draft in enumerate(proposal):
            if row.params.greedy:
                target = greedy_tokens[start + i]
                if target != draft:
                    next_token = target
                    break
            else:
                p = probs[start + i]
                if torch.rand((), generator=generator).item() >= p[draft].item():
                    residual = p.clone()
                    residual[draft] = 0.0
                    next_token = _draw(residual / residual.sum(), generator)
                    break
            accepted.append(draft)
        if next_token is None:  # every draft kept: the last row gives one more token
            last = start + len(proposal)
            next_token = greedy_tokens[last] if row.params.greedy else _draw(probs[last], generator)
        logprobs = None
        if row.params.logprobs:  # before penalties and filtering, like the plain sampler's
            emitted = (*accepted, next_token)
            logprobs = tuple(torch.log_softmax(raw[start:start + len(emitted)], dim=-1)
                             [torch.arange(len(emitted)), torch.tensor(emitted)].tolist())
        results.append(Verified(tuple(accepted), next_token, logprobs))
        start += len(proposal) + 1
    return results
