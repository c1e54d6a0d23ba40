"""Incremental detokenization and stop strings (pure Python)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens kept as left context: some decoders drop a leading space at the start of text.
_CONTEXT_TOKENS = 4


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas, never splitting a UTF-8 character.

    Text is decoded over a sliding window: the delta is the window's text minus the text
    of its already-emitted head; while the new tail still ends in an incomplete byte
    sequence (decoded as U+FFFD), nothing is emitted.
    """

    def __init__(self, decode: Callable[[list[int]], str], prompt_token_ids: Sequence[int]) -> None:
        self._decode = decode
        self._ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._prefix = 0
        self._read = len(self._ids)

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        head = self._decode(self._ids[self._prefix : self._read])
        text = self._decode(self._ids[self._prefix :])
        if len(text) <= len(head) or text.endswith(REPLACEMENT_CHAR):
            return ""
        self._prefix = self._read
        self._read = len(self._ids)
        return text[len(head) :]


class StopStringMatcher:
    """Holds back text that might be the start of a stop string until it is decided."""

    def __init__(self, stop: Sequence[str]) -> None:
        self._stop = tuple(stop)
        self._pending = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """Return (text safe to emit, whether a stop string was found)."""
        if not self._stop:
            return text, False
        buffer = self._pending + text
        hit = min((i for i in (buffer.find(s) for s in self._stop) if i >= 0), default=-1)
        if hit >= 0:
            self._pending = ""
            return buffer[:hit], True
        keep = self._partial_match_length(buffer)
        self._pending = buffer[len(buffer) - keep :] if keep else ""
        return buffer[: len(buffer) - keep], False

    def flush(self) -> str:
        """The held-back text, once the output ends for another reason."""
        text, self._pending = self._pending, ""
        return text

    def _partial_match_length(self, buffer: str) -> int:
        longest = max(len(s) for s in self._stop) - 1
        for size in range(min(longest, len(buffer)), 0, -1):
            tail = buffer[-size:]
            if any(s.startswith(tail) for s in self._stop):
                return size
        return 0
