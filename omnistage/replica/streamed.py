"""A request's streamed input on the replica (``AddRequest.input_streaming``).

The prompt is the first piece; the head sends the rest as ``InputChunk`` messages, each
exactly once per attempt and in order on one connection, and all of them again to a
replica that takes the stage over after a failure. ``InputPieces`` takes each next piece
once and hands them to the engine (``EngineRequest.prompt_chunks``) until the last.
Engines that read only whole prompts get the pieces joined (``engines.base.joined_prompt``).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

from omnistage.aio import Mailbox
from omnistage.protocol.messages import InputChunk, Prompt

log = logging.getLogger(__name__)


class InputPieces:
    """The pieces of one request's input, in order, each once."""

    def __init__(self, first: bytes) -> None:
        self._box: Mailbox[bytes | None] = Mailbox()
        self.next_seq = 0
        self.ended = False
        if first:
            self._box.put_nowait(first)

    def take(self, chunk: InputChunk) -> None:
        if self.ended or chunk.seq < self.next_seq:
            return  # a repeat
        if chunk.seq > self.next_seq:
            # Cannot happen on one ordered connection; a gap would corrupt the input.
            log.warning(
                "request %s: input piece %d arrived, expected %d; dropped",
                chunk.request_id,
                chunk.seq,
                self.next_seq,
            )
            return
        self.next_seq += 1
        if chunk.data:
            self._box.put_nowait(chunk.data)
        if chunk.last:
            self.ended = True
            self._box.put_nowait(None)

    async def read(self) -> AsyncIterator[bytes]:
        """Every piece (the prompt's first), as it arrives, until the last."""
        while (piece := await self._box.get()) is not None:
            yield piece


def prompt_piece(prompt: Prompt) -> bytes:
    """The first piece of a streamed input: the prompt's audio, else its text as UTF-8."""
    if prompt.audio is not None:
        return prompt.audio
    return (prompt.text or "").encode()
