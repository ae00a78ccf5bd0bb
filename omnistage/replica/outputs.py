"""Output coalescing: what a replica produced in one loop tick leaves as one message.

Consecutive text chunks of the same request produced in the same tick merge into one
chunk. A slow engine (one token per step) still streams chunk by chunk; a fast one
stops paying per-message costs for pieces nobody could have seen apart anyway. Only
text merges: audio or image pieces may be self-contained files.
"""

from __future__ import annotations

from omnistage.protocol.enums import Modality
from omnistage.protocol.messages import OutputChunk

# Members this hot path compares against, bound once (see protocol/enums.py).
_TEXT = Modality.TEXT


class OutputCoalescer:
    def __init__(self) -> None:
        self._pending: dict[str, list[OutputChunk]] = {}
        self._next_seq: dict[str, int] = {}

    def __bool__(self) -> bool:
        return bool(self._pending)

    def start_at(self, request_id: str, seq: int) -> None:
        """Number this request's chunks from ``seq`` (a retry continues the sequence)."""
        self._next_seq[request_id] = seq

    def forget(self, request_id: str) -> None:
        self._next_seq.pop(request_id, None)

    def add(self, chunk: OutputChunk) -> None:
        """Queue ``chunk`` (its ``seq`` is assigned here, per request, from 0)."""
        rid = chunk.request_id
        queued = self._pending.setdefault(rid, [])
        if queued and _mergeable(queued[-1], chunk):
            last = queued[-1]
            last.text += chunk.text
            last.finished = chunk.finished
            last.finish_reason = chunk.finish_reason
            last.usage = chunk.usage or last.usage
            last.error = chunk.error
            last.error_kind = chunk.error_kind
            last.error_param = chunk.error_param
            last.error_code = chunk.error_code
        else:
            chunk.seq = self._next_seq.get(rid, 0)
            self._next_seq[rid] = chunk.seq + 1
            queued.append(chunk)
        if chunk.finished:
            self._next_seq.pop(rid, None)

    def drain(self) -> list[OutputChunk]:
        """Everything queued, in order within each request."""
        out = [c for chunks in self._pending.values() for c in chunks]
        self._pending = {}
        return out


def _mergeable(a: OutputChunk, b: OutputChunk) -> bool:
    return (
        not a.finished
        and a.error is None
        and a.modality == b.modality == _TEXT
        and not a.data
        and not b.data
    )


class ReplayFilter:
    """Drops the output a client already has when a request is run again.

    On a retry, an engine that cannot continue from where the failed replica stopped
    produces its whole output again; a deterministic engine produces the same output,
    so skipping the first ``text_chars`` characters of text and the first
    ``data_chunks`` chunks that carry data leaves exactly what is new.
    """

    def __init__(self, text_chars: int, data_chunks: int) -> None:
        self.text_left = text_chars
        self.data_left = data_chunks

    def apply(self, text: str, data: bytes) -> tuple[str, bytes]:
        """The part of one engine chunk the client has not seen."""
        if data and self.data_left > 0:
            self.data_left -= 1
            data = b""
        if text and self.text_left > 0:
            cut = min(self.text_left, len(text))
            self.text_left -= cut
            text = text[cut:]
        return text, data
