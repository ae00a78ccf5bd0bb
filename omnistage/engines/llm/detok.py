"""Incremental detokenization with stop strings.

Decoding each new token alone breaks multi-byte characters and merged pieces, so the
text is decoded over a short window of recent tokens and only the part that is stable
(not ending in a partial character) is released. Text that might be the start of a stop
string is held back until it is clearly not one.
"""

from __future__ import annotations

from typing import Any

_REPLACEMENT = "\ufffd"


class Detokenizer:
    def __init__(self, tokenizer: Any, stop: tuple[str, ...] = ()) -> None:
        self._tokenizer = tokenizer
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self._stop = stop
        self._hold = max((len(s) for s in stop), default=1) - 1
        self.text = ""  # everything decoded so far (before stop truncation)
        self._sent = 0  # characters of ``text`` already released
        self.stopped = False

    def add(self, token_id: int) -> str:
        """Feed one token; return the newly releasable text (may be empty)."""
        self._ids.append(token_id)
        decode = self._tokenizer.decode
        prefix = decode(self._ids[self._prefix_offset : self._read_offset])
        full = decode(self._ids[self._prefix_offset :])
        if len(full) > len(prefix) and not full.endswith(_REPLACEMENT):
            self.text += full[len(prefix) :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
        return self._release(final=False)

    def finish(self) -> str:
        """Release whatever is left (at the end of generation)."""
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        if self.stopped:
            return ""
        for stop in self._stop:
            at = self.text.find(stop, max(0, self._sent - len(stop)))
            if at != -1:
                self.stopped = True
                out = self.text[self._sent : at]
                self._sent = at
                return out
        end = len(self.text) if final else max(self._sent, len(self.text) - self._hold)
        out = self.text[self._sent : end]
        self._sent = end
        return out

    @property
    def released(self) -> str:
        return self.text[: self._sent]
