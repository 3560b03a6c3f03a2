"""Real prompt text with an exact token count, cut from the bundled public-domain corpus.

Load tests need prompts whose length under the *served* tokenizer is exactly what the
workload asked for (vLLM's random dataset samples token ids and decodes them; SGLang's
generated-shared-prefix dataset does the same). Random ids decode to gibberish that
re-tokenizes to a different length, so here the ids are a window of real prose instead:

    corpus ids (cyclic):  ... | t[o] t[o+1] ... t[o+n-1] | ...
                                 └──── window of n ────┘   o = seeded offset

A window is kept only if it *round-trips*: encode(decode(window)) == window. Then the text
and the ids describe the same prompt, so a text target (HTTP) and an id target (in-process
engine) see the same tokens, and a shared prefix stays bit-identical (same block hashes).
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from kvmesh.core.errors import InvalidRequestError

logger = logging.getLogger(__name__)

CORPUS_PATH = Path(__file__).parent / "data" / "corpus.txt"
# Offsets tried before giving up on a round-tripping window (BPE merges across the window
# edges fail for a few percent of offsets; 64 tries make a miss vanishingly unlikely).
_MAX_WINDOW_TRIES = 64


def load_corpus_text(path: str | Path = CORPUS_PATH) -> str:
    """The corpus prose without its '#' header lines."""
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    return "\n".join(line for line in lines if not line.startswith("#")).strip() + "\n"


class TokenCorpus:
    """The corpus tokenized once under one tokenizer; cuts exact-length prompts from it.

    `tokenizer` is a HF tokenizer object (anything with `encode(text, add_special_tokens=)`
    and `decode(ids)`); counts exclude special tokens (the engine adds none for prompt ids).
    """

    def __init__(self, tokenizer, text: str | None = None):
        self.tokenizer = tokenizer
        self.token_ids: tuple[int, ...] = tuple(self.encode(text if text is not None else load_corpus_text()))
        if len(self.token_ids) < 16:
            raise InvalidRequestError("the corpus is too short to cut prompts from")

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, token_ids) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=False)

    def round_trips(self, token_ids: tuple[int, ...]) -> bool:
        return tuple(self.encode(self.decode(token_ids))) == tuple(token_ids)

    def window(self, offset: int, num_tokens: int) -> tuple[int, ...]:
        """num_tokens ids starting at offset, wrapping around the corpus end."""
        n = len(self.token_ids)
        return tuple(self.token_ids[(offset + i) % n] for i in range(num_tokens))

    def sample_prompt(self, num_tokens: int, rng: np.random.Generator,
                      prefix_ids: tuple[int, ...] = ()) -> tuple[tuple[int, ...], str]:
        """(ids, text) of exactly len(prefix_ids) + num_tokens tokens: prefix then a window.

        The whole prompt (prefix included) must round-trip, so the prefix's ids are the same
        in every prompt of a family, whether the target receives ids or text.
        """
        if num_tokens < 1:
            raise InvalidRequestError(f"prompt suffix must be >= 1 token, got {num_tokens}")
        for _ in range(_MAX_WINDOW_TRIES):
            offset = int(rng.integers(0, len(self.token_ids)))
            ids = tuple(prefix_ids) + self.window(offset, num_tokens)
            if self.round_trips(ids):
                return ids, self.decode(ids)
        # Rare: fall back to ids only; text targets then re-tokenize to a nearby length.
        logger.warning("no round-tripping window of %d tokens after %d tries", num_tokens, _MAX_WINDOW_TRIES)
        return ids, self.decode(ids)
