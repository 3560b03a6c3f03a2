"""Draft proposers for speculative decoding: who guesses the next few tokens of a request.

A proposer answers, for each decode-ready request, up to `num_tokens` guessed continuation
tokens; the target model then scores them all in one forward (worker/modeling/
rejection_sampler.py) and keeps the longest prefix it agrees with. Every proposer here is
deterministic (it proposes its single most likely continuation), so its draft distribution
is one-hot and the rejection rule needs no draft probabilities (vLLM's ngram path does the
same). Another proposer (a small draft checkpoint) plugs in by implementing `DraftProposer`.

Prompt lookup (n-gram), the longest recent match wins:

    tokens   = [a b c d x y a b c]      min_n = 1, max_n = 3, num_tokens = 2
    suffix n=3 is [a b c]; its latest earlier occurrence starts at 0
    proposal = the tokens after it:  [d x]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from kvmesh.worker.engine_loop.request import Request


@dataclass(frozen=True)
class DraftAsk:
    """One request the speculator wants drafts for this step."""

    request: Request
    num_tokens: int  # at most this many drafts (>= 1)


class DraftProposer(Protocol):
    method: str  # the metric label: ngram | self_draft | ...
    prior_s_per_token: float  # its cost per draft before the speculator has measured it

    def propose(self, asks: Sequence[DraftAsk]) -> dict[str, list[int]]:
        """request_id -> drafts (possibly fewer than asked, or none) for each ask."""
        ...

    def forget(self, request_id: str) -> None:
        """The request ended (any terminal state): drop what is held for it."""
        ...

    def catch_up_forwards(self, request: Request) -> float:
        """What reading the known tokens of `request` it lacks (a draft model's KV that is
        behind) would cost before drafting, in single-token forwards; 0 without state."""
        ...


def find_ngram_continuation(tokens: Sequence[int], min_n: int, max_n: int, num_tokens: int) -> list[int]:
    """The up to `num_tokens` tokens that followed the earlier occurrence of the longest
    suffix of `tokens` of length in [min_n, max_n] (the latest such occurrence on a tie).
    [] = no suffix of at least min_n tokens occurred before."""
    length = len(tokens)
    if length < 2 or min_n > length - 1:
        return []
    last = tokens[-1]
    best_end, best_n = -1, 0
    # Candidates end where the last token occurred before, latest first: recent context
    # predicts best (edits, code), and only a longer match may replace an earlier find.
    for end in range(length - 2, -1, -1):
        if tokens[end] != last:
            continue
        n = 1
        while n < max_n and end - n >= 0 and tokens[end - n] == tokens[length - 1 - n]:
            n += 1
        if n > best_n and n >= min_n:
            best_end, best_n = end, n
            if n == max_n:
                break
    if best_end < 0:
        return []
    return list(tokens[best_end + 1:best_end + 1 + num_tokens])


class NgramProposer:
    """Prompt lookup: drafts come from the request's own prompt + output. No model, no KV;
    strong where the answer repeats its input (editing, summarising, code)."""

    method = "ngram"
    prior_s_per_token = 0.0  # a list search: negligible next to a forward

    def __init__(self, min_n: int, max_n: int, max_lookback_tokens: int = 4096):
        self.min_n = min_n
        self.max_n = max_n
        # Only the recent window is searched: the cost per step stays bounded on long contexts.
        self.max_lookback_tokens = max_lookback_tokens

    def propose(self, asks: Sequence[DraftAsk]) -> dict[str, list[int]]:
        out = {}
        for ask in asks:
            tokens = ask.request.all_token_ids[-self.max_lookback_tokens:]
            drafts = find_ngram_continuation(tokens, self.min_n, self.max_n, ask.num_tokens)
            if drafts:
                out[ask.request.request_id] = drafts
        return out

    def forget(self, request_id: str) -> None:
        pass  # holds nothing per request

    def catch_up_forwards(self, request: Request) -> float:
        return 0.0
