"""A needle-in-a-haystack probe of long-context retrieval (article 000's check for KV
quantization: perplexity on short text can hide what a coarse KV cache does to recall
far back in the context).

A fact ("The secret code is 4817.") is placed at a relative depth of a filler context cut
from held-out text, and the prompt ends with the question's lead-in ("... The secret code
is"); the model retrieves the fact if its greedy continuation starts with the answer's
tokens. Depth 0.0 puts the needle at the very start (the hardest for a lossy cache: every
later token attends across the most quantized keys), 1.0 just before the question.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvmesh.core.config import ConfigError

NEEDLE_TEXT = " The secret code is {code}."
QUESTION_TEXT = "\nQuestion: what is the secret code? Answer: The secret code is"
DEFAULT_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)


@dataclass(frozen=True)
class NeedlePrompt:
    depth: float  # relative position of the needle in the filler, 0.0 .. 1.0
    prompt_ids: tuple[int, ...]
    answer_ids: tuple[int, ...]  # the tokens a correct greedy continuation starts with


def needle_prompts(tokenizer, filler_text: str, context_tokens: int, depths=DEFAULT_DEPTHS,
                   code: str = "4817") -> list[NeedlePrompt]:
    """One prompt per depth, each `context_tokens` of filler plus the needle and the question.

    tokenizer: anything with encode(text) -> list[int]. The filler is repeated when the text
    is shorter than context_tokens."""
    if context_tokens < 1:
        raise ConfigError(f"needle context must be >= 1 token, got {context_tokens}")
    if not depths or any(not 0.0 <= d <= 1.0 for d in depths):
        raise ConfigError(f"needle depths must be in [0, 1], got {list(depths)}")
    filler = list(tokenizer.encode(filler_text))
    if not filler:
        raise ConfigError("needle filler text is empty")
    filler = (filler * (context_tokens // len(filler) + 1))[:context_tokens]
    needle = list(tokenizer.encode(NEEDLE_TEXT.format(code=code)))
    question = list(tokenizer.encode(QUESTION_TEXT))
    answer = tuple(tokenizer.encode(f" {code}."))
    prompts = []
    for depth in depths:
        at = round(depth * context_tokens)
        prompts.append(NeedlePrompt(depth, tuple(filler[:at] + needle + filler[at:] + question), answer))
    return prompts


def retrieved(prompt: NeedlePrompt, generated: list[int]) -> bool:
    """Did the greedy continuation reproduce the answer's tokens?"""
    return tuple(generated[:len(prompt.answer_ids)]) == prompt.answer_ids
