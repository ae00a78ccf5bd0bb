"""POST /v1/audio/transcriptions: an audio file in (multipart form), its text out.

Served by the pipeline's ASR stage on its own (the file goes straight to it, never to
the thinker). OpenAI's form fields: ``file``, ``model``, ``language``, ``prompt``,
``temperature``, ``response_format`` (json, text, srt, vtt, verbose_json; see
api/transcripts.py), ``timestamp_granularities[]`` (segment only) and ``stream`` (json
or text only: ``transcript.text.delta`` events as segments are decoded, then
``transcript.text.done``); plus omnistage's ``stage`` (which ASR stage, by id or name).

A normal FastAPI route, not a fast path: the multipart parsing and the transcription
dwarf FastAPI's own cost.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import APIRouter, Request
from pydantic import ValidationError
from starlette.datastructures import FormData, UploadFile
from starlette.responses import Response

from omnistage.api.errors import invalid_body
from omnistage.api.ids import next_id
from omnistage.api.routes.common import (
    check_model,
    collect_into,
    engine_stages,
    json_response,
    peeked,
    pick_stage,
    service,
    sse_response,
)
from omnistage.api.schemas.transcriptions import FORM_DOC, TranscriptionForm
from omnistage.api.streaming import sse
from omnistage.api.transcripts import (
    MEDIA_TYPES,
    STREAMABLE_FORMATS,
    Segment,
    Transcript,
    render,
)
from omnistage.protocol.chunk_meta import TextMeta
from omnistage.protocol.codec import MAX_MESSAGE_BYTES
from omnistage.protocol.enums import EngineName
from omnistage.protocol.errors import ApiError, as_api_error, error_body
from omnistage.protocol.front import PipelineRequest
from omnistage.protocol.messages import OutputChunk, Prompt
from omnistage.service import OutputStream

router = APIRouter()

PATH = "/v1/audio/transcriptions"
# OpenAI's limit on the file, which the body limit lets through on this route (with room
# for the rest of the form; see api/app.py).
MAX_FILE_BYTES = 25 * 1024 * 1024
TRANSCRIPTION_BODY_BYTES = MAX_FILE_BYTES + 1024 * 1024
# The file travels to the replica in one message: leave room for the rest of it.
_MAX_AUDIO_BYTES = MAX_MESSAGE_BYTES - 1024 * 1024


@router.post(PATH, openapi_extra=FORM_DOC)
async def transcriptions(request: Request) -> Response:
    omni = service(request)
    stages = engine_stages(
        omni, EngineName.ASR, "ASR stage: transcriptions are not served", "no_asr_stage"
    )
    form = await request.form(max_files=1, max_fields=64)
    try:
        fields, audio, audio_format = await _read_form(form)
    finally:
        await form.close()
    check_model(omni, fields.model)
    sid = int(pick_stage(omni, stages, fields.stage, "ASR stage", "no_asr_stage").stage_id)
    prompt = Prompt(audio=audio, audio_format=audio_format)
    rid, params = f"transcription-{next_id()}", {sid: fields.asr_params()}
    stream = await omni.open(PipelineRequest(rid, prompt, [sid], stage_params=params, only=True))
    if fields.stream:
        # Waiting for the first segment turns an undecodable file into a 400.
        outputs = await peeked(stream)
        return sse_response(_events(outputs, stream), stream)
    heard = await collect_into(request, stream, _Heard())
    if heard is None:
        return Response(status_code=499)
    body = render(heard.transcript(), fields.response_format)
    if isinstance(body, dict):
        return json_response(body)
    return Response(body, media_type=MEDIA_TYPES[fields.response_format])


async def _read_form(form: FormData) -> tuple[TranscriptionForm, bytes, str | None]:
    """The checked fields, the file's bytes and its format hint (its name's suffix)."""
    values = {k: v for k, v in form.multi_items() if k in TranscriptionForm.model_fields}
    try:
        fields = TranscriptionForm.model_validate(values)
    except ValidationError as exc:
        raise invalid_body(exc.errors()) from None
    granularities = form.getlist("timestamp_granularities[]") + form.getlist(
        "timestamp_granularities"
    )
    for value in granularities:
        if value != "segment":
            raise _bad(
                f"timestamp_granularities: only 'segment' is supported, got {value!r}"
                + (" (no word timestamps)" if value == "word" else ""),
                "timestamp_granularities[]",
            )
    if "logprobs" in form.getlist("include[]") + form.getlist("include"):
        raise _bad("include: logprobs are not supported for transcriptions", "include[]")
    if fields.stream and fields.response_format not in STREAMABLE_FORMATS:
        raise _bad(
            f"stream: response_format {fields.response_format!r} cannot be streamed "
            f"(only {' or '.join(STREAMABLE_FORMATS)})",
            "stream",
        )
    upload = form.get("file")
    if upload is None:
        raise _bad("file: an audio file is required", "file")
    if not isinstance(upload, UploadFile):
        raise _bad("file: must be uploaded as a file (a form part with a filename)", "file")
    if upload.size is not None and upload.size > _MAX_AUDIO_BYTES:
        raise _too_large(upload.size)
    audio = await upload.read()
    if len(audio) > _MAX_AUDIO_BYTES:
        raise _too_large(len(audio))
    if not audio:
        raise _bad("file: the uploaded file is empty", "file")
    return fields, audio, _format_hint(upload.filename)


def _format_hint(filename: str | None) -> str | None:
    suffix = (filename or "").rpartition(".")[2].lower()
    return suffix if suffix and suffix != (filename or "").lower() and suffix.isalnum() else None


@dataclass
class _Heard:
    """A transcription's outputs as they arrive (a ``collect_into`` sink)."""

    segments: list[Segment] = field(default_factory=list)
    language: str = ""
    duration: float = 0.0

    def add(self, out: OutputChunk) -> None:
        meta = out.meta
        if not isinstance(meta, TextMeta):
            return
        if meta.segment is not None:
            self.segments.append(meta.segment)
        if out.finished:
            self.language = meta.language or self.language
            self.duration = meta.duration if meta.duration is not None else self.duration

    def transcript(self) -> Transcript:
        return Transcript(self.segments, self.language, self.duration)


async def _events(
    outputs: AsyncIterator[OutputChunk], stream: OutputStream
) -> AsyncIterator[bytes]:
    """OpenAI's transcription stream: text deltas, then the whole text. A failure after
    the status line is an error event, as in every other stream."""
    parts: list[str] = []
    try:
        async for out in outputs:
            # The first delta without Whisper's leading space: the deltas join to the text.
            delta = out.text if parts else out.text.lstrip()
            if delta:
                parts.append(delta)
                yield sse({"type": "transcript.text.delta", "delta": delta})
    except Exception as exc:
        e = as_api_error(exc)
        yield sse(error_body(e.message, e.type, e.param, e.code))
        return
    finally:
        stream.close()
    yield sse({"type": "transcript.text.done", "text": "".join(parts).rstrip()})


def _bad(message: str, param: str) -> ApiError:
    return ApiError(400, message, "invalid_request_error", param)


def _too_large(size: int) -> ApiError:
    return ApiError(
        413,
        f"file: {size} bytes is over the {_MAX_AUDIO_BYTES} bytes a transcription takes",
        "invalid_request_error",
        "file",
        "request_too_large",
    )
