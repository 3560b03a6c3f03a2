"""Incremental detokenization with stop strings.

Text is produced by decoding a short window of tokens (TGI's prefix/read offsets) so each
step costs O(window), not O(output). A window that ends in U+FFFD is an incomplete UTF-8
character: nothing is emitted until the next token completes it, so every streamed delta is
valid UTF-8. Stop strings are searched in the accumulated text (so they are found across
token boundaries); the last len(longest stop) - 1 characters are held back while streaming
so a stop string is never partially emitted, and the matched stop string is not emitted.
"""

from __future__ import annotations

from collections.abc import Sequence

_WINDOW = 6  # tokens of left context re-decoded with each new token (merges, leading spaces)


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: Sequence[int], stop: Sequence[str] = ()):
        self._tok = tokenizer
        self._ids: list[int] = list(prompt_token_ids[-_WINDOW:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._text = ""  # all output text decoded so far (stop string cut off once found)
        self._emitted = 0  # characters of _text already returned by take_delta
        self._stop = tuple(stop)
        self._holdback = max((len(s) for s in self._stop), default=1) - 1
        self.stop_hit: str | None = None

    @property
    def text(self) -> str:
        return self._text

    def push(self, token_id: int) -> None:
        """Add one generated token; sets `stop_hit` when a stop string completes."""
        if self.stop_hit is not None:
            return
        self._ids.append(token_id)
        prefix = self._tok.decode(self._ids[self._prefix_offset:self._read_offset], skip_special_tokens=True)
        full = self._tok.decode(self._ids[self._prefix_offset:], skip_special_tokens=True)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return  # incomplete character (or a special token): wait for more
        new = full[len(prefix):]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        if len(self._ids) > 4 * _WINDOW:  # keep the window bounded
            drop = self._prefix_offset
            self._ids = self._ids[drop:]
            self._prefix_offset, self._read_offset = 0, self._read_offset - drop
        search_from = max(0, len(self._text) - self._holdback)
        self._text += new
        if self._stop:
            self._find_stop(search_from)

    def _find_stop(self, search_from: int) -> None:
        best = None
        for s in self._stop:
            pos = self._text.find(s, search_from)
            if pos != -1 and (best is None or pos < best[0]):
                best = (pos, s)
        if best is not None:
            self._text = self._text[:best[0]]
            self.stop_hit = best[1]

    def mark_emitted(self, num_chars: int) -> None:
        """The first `num_chars` characters of the text were streamed elsewhere (failover)."""
        self._emitted = min(num_chars, len(self._text))

    def take_delta(self, finished: bool) -> str:
        """Text not yet returned; while unfinished, the possible start of a stop string is held back."""
        end = len(self._text) if (finished or self.stop_hit is not None) else max(self._emitted, len(self._text) - self._holdback)
        delta = self._text[self._emitted:end]
        self._emitted = end
        return delta
