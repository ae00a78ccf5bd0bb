"""One phrase of a user turn, heard by the pipeline's listener stage as it is spoken.

The phrase's audio (24 kHz pcm16) streams into a listener request
(``PipelineRequest.input_streaming``) from its first piece: the listener replica
resamples it and cuts it at its own pauses as it arrives, so ``finish`` (which ends
the input) waits only for the last stretch to be transcribed.
"""

from __future__ import annotations

import asyncio

from omnistage.protocol.front import PipelineRequest
from omnistage.protocol.messages import Prompt
from omnistage.protocol.params import StageParams, TranscriptionParams
from omnistage.realtime.conversation import new_id
from omnistage.realtime.input_buffer import RATE
from omnistage.service import OutputStream, PipelineService


class TurnListener:
    def __init__(
        self,
        service: PipelineService,
        stage: int,
        params: TranscriptionParams | None = None,
    ) -> None:
        self._service = service
        self._stage = stage
        self._params = StageParams(transcription=params or TranscriptionParams())
        self._opening: asyncio.Task[OutputStream] | None = None
        self._stream: OutputStream | None = None
        self._pending: list[bytes] = []  # pieces fed while the request was being opened
        self._closed = False

    def feed(self, pcm: bytes) -> None:
        """More of the phrase's audio."""
        if self._closed or not pcm:
            return
        if self._stream is not None:
            self._stream.feed(pcm)
            return
        self._pending.append(pcm)
        if self._opening is None:
            self._opening = asyncio.ensure_future(self._open())

    async def _open(self) -> OutputStream:
        request = PipelineRequest(
            f"realtime-transcription-{new_id('t')}",
            Prompt(audio=b"", audio_format="pcm16", sample_rate=RATE),
            [self._stage],
            stage_params={self._stage: self._params},
            only=True,
            input_streaming=True,
        )
        stream = await self._service.open(request)
        if self._closed:
            stream.close()
            return stream
        for piece in self._pending:
            stream.feed(piece)
        self._pending.clear()
        self._stream = stream
        return stream

    async def finish(self) -> str:
        """The phrase's transcript, once its audio is complete."""
        if self._opening is None:
            return ""  # nothing was said
        stream = await self._opening
        if self._closed:
            return ""
        stream.feed(b"", last=True)
        pieces: list[str] = []
        try:
            async for out in stream:
                if out.text:
                    text = out.text if not pieces else _joined(pieces, out.text)
                    pieces.append(text)
        finally:
            stream.close()
        return "".join(pieces).strip()

    def close(self) -> None:
        """The phrase was dropped: free what the listener holds for it."""
        self._closed = True
        if self._stream is not None:
            self._stream.close()
        elif self._opening is not None:
            self._opening.add_done_callback(_close_opened)


def _close_opened(task: asyncio.Task[OutputStream]) -> None:
    if not task.cancelled() and task.exception() is None:
        task.result().close()


def _joined(pieces: list[str], text: str) -> str:
    """Segments arrive without separators; keep the words apart."""
    if pieces[-1].endswith(" ") or text.startswith(" "):
        return text
    return " " + text
