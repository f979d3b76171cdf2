"""Incremental detokenisation with stop strings matched across token boundaries.

Text deltas never end inside a UTF-8 character (a trailing U+FFFD means "wait for the next token"), and while
stop strings are set, the last len(longest stop) - 1 characters are held back so emitted text is never retracted.
"""

from __future__ import annotations

_CONTEXT_TOKENS = 5  # prompt tokens decoded with the output so leading spaces/merges come out right


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], stop: list[str], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.stop = stop
        self.skip_special_tokens = skip_special_tokens
        self._holdback = max((len(s) for s in stop), default=1) - 1
        self._ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self.text = ""
        self._sent = 0  # characters of `text` already returned by take_delta
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def append(self, token_id: int) -> bool:
        """Add one token's text; True when a stop string completed (the text is cut before it)."""
        self._ids.append(token_id)
        prefix = self._decode(self._ids[self._prefix_offset:self._read_offset])
        full = self._decode(self._ids[self._prefix_offset:])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return False  # incomplete character: wait for more bytes
        piece = full[len(prefix):]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        search_from = max(0, len(self.text) - self._holdback)
        self.text += piece
        return self._cut_at_stop(search_from)

    def _cut_at_stop(self, search_from: int) -> bool:
        hits = [i for i in (self.text.find(s, search_from) for s in self.stop) if i >= 0]
        if not hits:
            return False
        self.text = self.text[: min(hits)]
        self.stopped = True
        return True

    def flush(self) -> None:
        """At the end of a request: add text still held for an incomplete character (unless a stop string hit)."""
        if self.stopped or self._read_offset == len(self._ids):
            return
        prefix = self._decode(self._ids[self._prefix_offset:self._read_offset])
        search_from = max(0, len(self.text) - self._holdback)
        self.text += self._decode(self._ids[self._prefix_offset:])[len(prefix):]
        self._read_offset = len(self._ids)
        self._cut_at_stop(search_from)

    def take_delta(self, finished: bool) -> str:
        """Text not yet returned; holds back a possible stop-string prefix unless the request has finished."""
        end = len(self.text) if finished or not self.stop else max(self._sent, len(self.text) - self._holdback)
        delta = self.text[self._sent:end]
        self._sent = end
        return delta
