"""Each stream's token ids against its prompt's greedy output: did a fault lose or repeat
tokens? The campaign's requests are greedy with ignore_eos, so a stream that nothing
disturbed is exactly the first `expected_output_tokens` of its prompt's greedy continuation.

    references = greedy_references(config, records)    # once per distinct prompt, in process
    check = compare_stream(record.output_token_ids, references[prompt][:expected])
    check.verdict    # ok | missing | repeated | diverged

  missing   the stream is the reference with tokens left out (a resumption that skipped some,
            or a stream that ended short)
  repeated  the stream is the reference with tokens sent twice (a resumption that re-sent some)
  diverged  from some token on, the stream is another continuation: neither of the above
            (numerics of a different batch or of a recomputed prefix can flip a near-tie)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

VERDICTS = ("ok", "missing", "repeated", "diverged")
_ALIGN_TOKENS = 8  # after a gap or a repeat, this many tokens (or the rest) must line up again


@dataclass(frozen=True)
class StreamCheck:
    verdict: str  # one of VERDICTS
    at: int | None = None  # index in the stream of the first token that differs
    count: int = 0  # tokens missing or repeated there

    def to_json(self) -> dict:
        return {"verdict": self.verdict, "at": self.at, "count": self.count}


def compare_stream(got: Sequence[int], reference: Sequence[int]) -> StreamCheck:
    """`got` against the tokens it should have been (`reference`, already cut to length)."""
    got, reference = list(got), list(reference)
    if got == reference:
        return StreamCheck("ok")
    at = next((i for i, (a, b) in enumerate(zip(got, reference)) if a != b), min(len(got), len(reference)))
    if at == len(got):  # a clean prefix: the end is missing
        return StreamCheck("missing", at, len(reference) - len(got))
    if at == len(reference):  # the whole reference, then more: a re-sent tail, or something else
        extra = len(got) - at
        return StreamCheck("repeated" if at >= extra and got[at - extra:at] == got[at:] else "diverged", at, extra)
    for shift in range(1, max(len(got), len(reference)) - at + 1):
        if _aligned(got, at, reference, at + shift):
            return StreamCheck("missing", at, shift)
        if at >= shift and got[at - shift:at] == got[at:at + shift] and _aligned(got, at + shift, reference, at):
            return StreamCheck("repeated", at, shift)
    return StreamCheck("diverged", at)


def _aligned(got: list[int], g: int, reference: list[int], r: int) -> bool:
    """got[g:] continues as reference[r:] wherever both go on, for at least a few tokens (or
    to the end of the stream)."""
    overlap = min(len(got) - g, len(reference) - r)
    return (overlap >= min(_ALIGN_TOKENS, len(got) - g) and overlap > 0
            and got[g:g + overlap] == reference[r:r + overlap])


def greedy_references(config, prompts: dict[tuple[int, ...], int]) -> dict[tuple[int, ...], list[int]]:
    """{prompt token ids: its first `n` greedy tokens (EOS ignored)} from an engine of the
    same config in this process (the model the cluster's workers serve), max_num_seqs prompts
    at a time, its KV pool made large enough for them (only the pool's size differs)."""
    from kvmesh.load_tests.family_checkpoints import greedy_continuations  # torch: the engine
    from kvmesh.worker.engine_api import Engine  # as above

    batch = config.scheduler.max_num_seqs
    items = sorted(prompts.items(), key=lambda item: item[1])  # like lengths together
    block = config.cache.block_size
    worst = max((-(-(len(p) + n) // block) + 1 for p, n in items), default=1)
    engine = Engine.from_config(config.replace(cache={"num_blocks": max(config.cache.num_blocks, batch * worst)}))
    out: dict[tuple[int, ...], list[int]] = {}
    for start in range(0, len(items), batch):
        chunk = items[start:start + batch]
        longest = max(n for _, n in chunk)  # greedy is a prefix property: cut each to its own n
        for (prompt, n), tokens in zip(chunk, greedy_continuations(engine, [list(p) for p, _ in chunk], longest)):
            out[prompt] = tokens[:n]
    return out
