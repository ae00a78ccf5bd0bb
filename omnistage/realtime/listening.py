"""One user turn's transcription by the pipeline's listener stage.

The turn's audio (24 kHz pcm16) goes to the listener as the user speaks; ``finish``
ends the input and returns the transcript, and each piece of text the listener
finishes on the way is passed to ``on_delta`` (the session's
``input_audio_transcription.delta`` events).
"""

from __future__ import annotations

from collections.abc import Callable

from omnistage.api.service import OutputStream, PipelineService
from omnistage.engines.audio import wav_bytes
from omnistage.protocol.messages import PipelineRequest, Prompt
from omnistage.protocol.params import StageParams, TranscriptionParams
from omnistage.realtime.conversation import new_id

RATE = 24_000


class TurnListener:
    def __init__(
        self,
        service: PipelineService,
        stage: int,
        params: TranscriptionParams | None = None,
        on_delta: Callable[[str], None] | None = None,
    ) -> None:
        self._service = service
        self._stage = stage
        self._params = StageParams(transcription=params or TranscriptionParams())
        self._on_delta = on_delta
        self._audio = bytearray()
        self._stream: OutputStream | None = None
        self._closed = False

    def feed(self, pcm: bytes) -> None:
        """More of the turn's audio."""
        if not self._closed:
            self._audio += pcm

    async def finish(self) -> str:
        """The turn's transcript, once its audio is complete."""
        prompt = Prompt(audio=wav_bytes(bytes(self._audio), RATE), audio_format="wav")
        request = PipelineRequest(
            f"realtime-transcription-{new_id('t')}",
            prompt,
            [self._stage],
            stage_params={self._stage: self._params},
            only=True,
        )
        self._stream = stream = await self._service.open(request)
        pieces: list[str] = []
        try:
            async for out in stream:
                if out.text:
                    text = out.text if not pieces else _joined(pieces, out.text)
                    pieces.append(text)
                    if self._on_delta is not None:
                        self._on_delta(text)
        finally:
            stream.close()
        return "".join(pieces).strip()

    def close(self) -> None:
        """The turn was dropped: free what the listener holds for it."""
        self._closed = True
        if self._stream is not None:
            self._stream.close()


def _joined(pieces: list[str], text: str) -> str:
    """Segments arrive without separators; keep the words apart."""
    if pieces[-1].endswith(" ") or text.startswith(" "):
        return text
    return " " + text
