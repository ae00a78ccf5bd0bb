"""POST /v1/audio/speech: text in, audio bytes out, streamed as sentences are spoken.

Served by the pipeline's TTS stage on its own (the text goes straight to it). The
response starts once the first sentence is synthesized; a WAV response then carries a
streaming header (sizes unknown, as for any live WAV stream) followed by raw PCM.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from starlette.background import BackgroundTask
from starlette.responses import Response, StreamingResponse

from omnistage.api.errors import ApiError
from omnistage.api.ids import next_id
from omnistage.api.routes.common import check_model, peeked, service
from omnistage.api.schemas import SpeechRequest, body_schema, parse_body
from omnistage.api.service import OutputStream, PipelineService
from omnistage.engines.audio import wav_header
from omnistage.protocol.messages import OutputChunk, Prompt

router = APIRouter()

MEDIA_TYPES = {"wav": "audio/wav", "pcm": "audio/pcm"}


@router.post("/v1/audio/speech", openapi_extra=body_schema(SpeechRequest))
async def speech(request: Request) -> Response:
    body = await parse_body(request, SpeechRequest)
    omni = service(request)
    check_model(omni, body.model)
    sid = _tts_stage(omni, body.stage)
    params = {"voice": body.voice, "speed": body.speed}
    stream = await omni.open(
        f"speech-{next_id()}", Prompt(text=body.input), [sid], {}, {sid: params}, only=True
    )
    outputs = await peeked(stream)
    return StreamingResponse(
        _audio(outputs, stream, body.response_format),
        media_type=MEDIA_TYPES[body.response_format],
        background=BackgroundTask(stream.close),
    )


def _tts_stage(omni: PipelineService, wanted: str | None) -> int:
    stages = [s for s in omni.config.stages if s.engine == "tts"]
    if wanted is not None:
        stages = [s for s in stages if wanted in (str(s.stage_id), s.name)]
    if not stages:
        pipeline = omni.config.pipeline
        what = f"TTS stage {wanted!r}" if wanted else "TTS stage"
        raise ApiError(
            400 if wanted else 404,
            f"pipeline {pipeline!r} has no {what}",
            "invalid_request_error",
            "stage" if wanted else None,
            "no_tts_stage",
        )
    return stages[0].stage_id


async def _audio(
    outputs: AsyncIterator[OutputChunk], stream: OutputStream, fmt: str
) -> AsyncIterator[bytes]:
    header_sent = fmt != "wav"
    try:
        async for out in outputs:
            if not header_sent and out.meta and "sample_rate" in out.meta:
                yield wav_header(int(out.meta["sample_rate"]), data_bytes=None)
                header_sent = True
            if out.data:
                yield out.data
    finally:
        stream.close()
