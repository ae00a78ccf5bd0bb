"""A request's streamed input as the head keeps it (``PipelineRequest.input_streaming``).

Every piece fed is kept, numbered from 0, until the request ends: a replica that takes
over a stage reading the input after a failure gets all of them again (``replay``), then
the rest as they arrive, and drops nothing it has not seen (see ``InputChunk.seq``).
Plain state, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from omnistage.protocol.messages import InputChunk


@dataclass(slots=True)
class StreamedInput:
    request_id: str
    pieces: list[bytes] = field(default_factory=list)
    ended: bool = False
    # Bytes held, for a view of what a long-running stream costs.
    held_bytes: int = 0

    def append(self, data: bytes, last: bool) -> int | None:
        """Keep the next piece; its seq, or None when the input has already ended (a feed
        after the last piece is ignored)."""
        if self.ended:
            return None
        self.pieces.append(data)
        self.held_bytes += len(data)
        self.ended = last
        return len(self.pieces) - 1

    def chunk(self, seq: int, attempt: int) -> InputChunk:
        """Piece ``seq`` as sent to a replica running ``attempt``."""
        last = self.ended and seq == len(self.pieces) - 1
        return InputChunk(self.request_id, attempt, seq, self.pieces[seq], last)

    def replay(self, attempt: int) -> list[InputChunk]:
        """Every piece so far, for a replica that starts (or restarts) a stage."""
        return [self.chunk(seq, attempt) for seq in range(len(self.pieces))]
