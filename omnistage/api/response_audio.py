"""Audio on /v1/responses, as chat has it.

Out: ``modalities: ["text", "audio"]`` with ``audio: {"voice", "format"}`` (chat's
fields; a stream is pcm16) asks the pipeline's first final audio stage to speak the
answer. The words stay an ``output_text`` part with its events (the only message part
the openai SDK's types know, so its clients read the words as ever); the audio is
added: streamed, as ``response.audio.delta`` events (24 kHz pcm16, base64) and
``response.audio.done`` (the SDK's event types for them); whole, as the part's
``audio`` (``data``: the encoded file, base64; ``format``).

In: an ``input_audio`` part (chat's shape) in the last user message goes to the stage
that hears it: a listener (ASR) before the thinker, or a thinker that takes audio itself.
Audio in earlier messages (a stored conversation's earlier turns) is not heard again: a
prompt holds one spoken input.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass

from omnistage.api.audio_out import DEFAULT_INPUT_RATE, AudioEncoder, encode_whole
from omnistage.api.routes.common import audio_finals, require_hearing
from omnistage.api.schemas.responses import ResponsesRequest
from omnistage.protocol.chunk_meta import AudioMeta
from omnistage.protocol.errors import ApiError
from omnistage.protocol.messages import OutputChunk
from omnistage.service import PipelineService


@dataclass(frozen=True)
class AudioPlan:
    """Who speaks the answer, in which voice, sent how."""

    stage: int  # the final audio stage
    voice: str
    format: str
    streamed: bool


def audio_plan(omni: PipelineService, body: ResponsesRequest) -> AudioPlan | None:
    """The answer's audio, if ``modalities`` asks for it (400s as chat's)."""
    fmt = body.audio.format if body.audio else "wav"
    audio = audio_finals(omni, body.modalities, fmt, body.stream)
    if not audio:
        return None
    voice = body.audio.voice if body.audio else "default"
    return AudioPlan(audio[0], voice, fmt, body.stream)


def heard(omni: PipelineService, body: ResponsesRequest) -> tuple[bytes, str] | None:
    """The last user message's spoken input (its bytes and format), if it has one."""
    users = [i for i, item in enumerate(body.input) if item.role == "user"]
    if not users:
        return None
    index = users[-1]
    parts = body.input[index].audio_parts()
    if not parts:
        return None
    param = f"input.{index}.content"
    require_hearing(omni, param)
    if len(parts) > 1:
        raise ApiError(
            400, "a message may carry one input_audio part", "invalid_request_error", param
        )
    try:
        return parts[0].decoded(), parts[0].format
    except ValueError as exc:
        raise ApiError(400, str(exc), "invalid_request_error", param) from None


class Spoken:
    """One answer's audio as its chunks come: streamed, each resampled to 24 kHz pcm16
    at once (one resampler across chunks, so they join without seams); whole, kept to
    be encoded in the asked format at the end."""

    def __init__(self, plan: AudioPlan) -> None:
        self.plan = plan
        self.data = ""  # a whole answer's encoded file, base64 (after ``finish``)
        self._rate = DEFAULT_INPUT_RATE
        self._pcm: list[bytes] = []
        self._encoder: AudioEncoder | None = None

    def add(self, out: OutputChunk) -> str:
        """A chunk of the audio stage's: the base64 of the 24 kHz pcm16 ready to stream
        ("" for none, and always for a whole answer)."""
        if isinstance(out.meta, AudioMeta):
            self._rate = out.meta.sample_rate
        if not out.data:
            return ""
        if not self.plan.streamed:
            self._pcm.append(out.data)
            return ""
        if self._encoder is None:
            self._encoder = AudioEncoder("pcm16", self._rate)
        return base64.b64encode(self._encoder.feed(out.data)).decode()

    def finish(self) -> str:
        """What is left to stream (base64); a whole answer is encoded into ``data``."""
        if not self.plan.streamed:
            whole = encode_whole(b"".join(self._pcm), self._rate, self.plan.format)
            self.data = base64.b64encode(whole).decode()
            return ""
        if self._encoder is None:
            return ""
        encoder, self._encoder = self._encoder, None
        return base64.b64encode(encoder.finish()).decode()
