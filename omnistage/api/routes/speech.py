"""POST /v1/audio/speech: text in, audio bytes out, streamed as sentences are spoken.

Served by the pipeline's TTS stage on its own (the text goes straight to it). The
response starts once the first sentence is synthesized; each sentence's PCM is then
resampled to 24 kHz and encoded in ``response_format`` (mp3 by default, as OpenAI) as
it arrives, so every format streams (see api/audio_out.py; a WAV stream carries a
header with unknown sizes, as any live WAV stream does).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import Response

from omnistage.api.audio_out import MEDIA_TYPES, OUTPUT_RATE, AudioEncoder, require_av
from omnistage.api.body import parse_body
from omnistage.api.ids import next_id
from omnistage.api.routes.common import (
    check_model,
    engine_stages,
    peeked,
    pick_stage,
    service,
    streaming_response,
)
from omnistage.api.schemas.speech import SpeechRequest
from omnistage.protocol.chunk_meta import AudioMeta
from omnistage.protocol.enums import EngineName
from omnistage.protocol.front import PipelineRequest
from omnistage.protocol.messages import OutputChunk, Prompt
from omnistage.protocol.params import SpeechParams, StageParams
from omnistage.service import OutputStream, PipelineService


async def speech(request: Request) -> Response:
    body = await parse_body(request, SpeechRequest)
    omni = service(request)
    check_model(omni, body.model)
    sid = _tts_stage(omni, body.stage)
    require_av()  # a missing encoder is a 500 now, not a broken stream after a 200
    params = {sid: StageParams(speech=SpeechParams(voice=body.voice, speed=body.speed))}
    rid, prompt = f"speech-{next_id()}", Prompt(text=body.input)
    stream = await omni.open(PipelineRequest(rid, prompt, [sid], stage_params=params, only=True))
    outputs = await peeked(stream)
    audio = _audio(outputs, stream, body.response_format)
    return streaming_response(audio, stream, MEDIA_TYPES[body.response_format])


def _tts_stage(omni: PipelineService, wanted: str | None) -> int:
    stages = engine_stages(omni, EngineName.TTS, "TTS stage", "no_tts_stage")
    return int(pick_stage(omni, stages, wanted, "TTS stage", "no_tts_stage").stage_id)


async def _audio(
    outputs: AsyncIterator[OutputChunk], stream: OutputStream, fmt: str
) -> AsyncIterator[bytes]:
    # Encoding a sentence takes a few ms of CPU (mp3, AAC): off the event loop.
    encoder: AudioEncoder | None = None
    try:
        async for out in outputs:
            if encoder is None and isinstance(out.meta, AudioMeta):
                encoder = AudioEncoder(fmt, out.meta.sample_rate)
                if fmt == "wav":
                    yield encoder.feed(b"")  # the header, as soon as the rate is known
            if encoder is not None and out.data:
                data = await asyncio.to_thread(encoder.feed, out.data)
                if data:
                    yield data
        # No audio at all still makes a valid (empty) file.
        encoder = encoder or AudioEncoder(fmt, OUTPUT_RATE)
        tail = await asyncio.to_thread(encoder.finish)
        if tail:
            yield tail
    finally:
        stream.close()
