"""POST /v1/chat/completions: text, or text and audio, streaming or not."""

from __future__ import annotations

import asyncio
import base64
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from starlette.background import BackgroundTask
from starlette.responses import Response, StreamingResponse

from omnistage.api.audio_out import AudioEncoder, encode_whole, require_av
from omnistage.api.errors import ApiError
from omnistage.api.ids import next_id
from omnistage.api.logprobs import chat_logprobs
from omnistage.api.routes.common import (
    ChunkShape,
    check_model,
    collect,
    json_response,
    openai_usage,
    output_stage_params,
    peeked,
    service,
    sse_events,
)
from omnistage.api.schemas import ChatCompletionRequest, ChatMessageIn, body_schema, parse_body
from omnistage.api.service import OutputStream, PipelineService
from omnistage.protocol.errors import BadRequestError
from omnistage.protocol.messages import ChatMessage, OutputChunk, Prompt, ToolCall

router = APIRouter()

# OpenAI's chat audio formats, all 24 kHz mono (api/audio_out.py); a stream is pcm16.
AUDIO_FORMATS = ("wav", "mp3", "flac", "opus", "aac", "pcm16")
# How long the audio id stays meaningful to clients (OpenAI's expires_at); nothing is
# stored server-side, so this is informational.
AUDIO_TTL_S = 3600


@dataclass(frozen=True)
class _Plan:
    """Which final stages answer which part of the response."""

    text: list[int]  # one choice per text stage
    audio: list[int]  # audio stage i goes with choice i
    audio_format: str


@router.post("/v1/chat/completions", openapi_extra=body_schema(ChatCompletionRequest))
async def chat_completions(request: Request) -> Response:
    body = await parse_body(request, ChatCompletionRequest)
    omni = service(request)
    check_model(omni, body.model)
    if body.n != 1:
        raise ApiError(400, "n > 1 is not supported by this pipeline", "invalid_request_error", "n")
    plan = _plan(omni, body)
    prompt, audio_param = _prompt(omni, body)
    stage_params = output_stage_params(omni, body, plan.text)
    if plan.audio:
        voice = body.audio.voice if body.audio else "default"
        for sid in plan.audio:
            stage_params.setdefault(sid, {}).update(voice=voice)
    request_id = f"chatcmpl-{next_id()}"
    # A stream's status line waits until the audio stages have checked their params
    # (voice, speed): a bad one is then a 400, not an error event after a 200.
    ack = bool(body.stream and plan.audio)
    stream = await omni.open(
        request_id, prompt, plan.text + plan.audio, body.sampling_params(), stage_params, ack=ack
    )
    created, model = int(time.time()), omni.served_model
    try:
        if body.stream:
            outputs = await peeked(stream, frozenset(plan.audio if ack else ()))
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            shape = ChunkShape(request_id, "chat.completion.chunk", created, model, include_usage)
            events = _events(outputs, stream, shape, plan)
            # The background close covers a client that leaves before the first byte.
            return StreamingResponse(
                events, media_type="text/event-stream", background=BackgroundTask(stream.close)
            )
        got = await collect(request, stream)
    except BadRequestError as exc:
        # The listener names the audio "file" (as the transcription endpoint calls it).
        if exc.param == "file" and audio_param:
            exc.param = audio_param
        raise
    if got is None:
        return Response(status_code=499)
    choices = []
    for i, sid in enumerate(plan.text):
        text = got.text_of(sid)
        message: dict[str, Any] = {"role": "assistant", "content": text}
        calls = got.calls_of(sid)
        if calls:
            message["content"] = text or None
            message["tool_calls"] = [
                _tool_call(request_id, j, name, arguments)
                for j, (name, arguments) in enumerate(calls)
            ]
        if i < len(plan.audio):
            audio_sid = plan.audio[i]
            pcm = b"".join(got.audio.get(audio_sid, []))
            rate = got.sample_rate.get(audio_sid, 22050)
            data = await asyncio.to_thread(encode_whole, pcm, rate, plan.audio_format)
            message["content"] = None  # as OpenAI: the words are the audio's transcript
            message["audio"] = {
                "id": f"audio_{request_id.removeprefix('chatcmpl-')}",
                "data": base64.b64encode(data).decode(),
                "transcript": text,
                "expires_at": created + AUDIO_TTL_S,
            }
        finish = got.finish.get(sid, "stop")
        logprobs = chat_logprobs(got.logprobs.get(sid, [])) if body.logprobs else None
        choices.append(
            {"index": i, "message": message, "finish_reason": finish, "logprobs": logprobs}
        )
    return json_response(
        {
            "id": request_id,
            "object": "chat.completion",
            "created": created,
            "model": model,
            "choices": choices,
            "usage": openai_usage(stream.usage()),
        }
    )


def _prompt(omni: PipelineService, body: ChatCompletionRequest) -> tuple[Prompt, str | None]:
    """The messages, and the audio of the last user turn for a stage that listens (with
    the field that holds it, for errors about it)."""
    messages = [_message(m) for m in body.messages]
    heard = [(i, m.audio_parts()) for i, m in enumerate(body.messages) if m.audio_parts()]
    if not heard:
        return Prompt(messages=messages), None
    index, parts = heard[-1]
    param = f"messages.{index}.content"
    if not omni.graph.stages_reading("audio"):
        raise ApiError(
            400,
            f"pipeline {omni.config.pipeline!r} has no stage that takes audio input",
            "invalid_request_error",
            param,
        )
    last_user = max((i for i, m in enumerate(body.messages) if m.role == "user"), default=-1)
    if len(heard) > 1 or len(parts) > 1 or index != last_user:
        raise ApiError(
            400,
            "only the last user message may carry audio, one input_audio part",
            "invalid_request_error",
            param,
        )
    try:
        audio = parts[0].decoded()
    except ValueError as exc:
        raise ApiError(400, str(exc), "invalid_request_error", param) from None
    return Prompt(messages=messages, audio=audio, audio_format=parts[0].format), param


def _message(m: ChatMessageIn) -> ChatMessage:
    calls = None
    if m.tool_calls:
        calls = [ToolCall(c.id, c.function.name, c.function.arguments) for c in m.tool_calls]
    return ChatMessage(m.role, m.text(), calls, m.tool_call_id)


def _tool_call(request_id: str, index: int, name: str, arguments: str) -> dict[str, Any]:
    return {
        "id": _call_id(request_id, index),
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def _call_id(request_id: str, index: int) -> str:
    return f"call_{request_id.removeprefix('chatcmpl-')}_{index}"


def _plan(omni: PipelineService, body: ChatCompletionRequest) -> _Plan:
    modalities = set(body.modalities or ["text"])
    text = omni.graph.finals_with({"text"})
    if not text:
        raise ApiError(400, "this pipeline produces no text output", "invalid_request_error")
    if "audio" not in modalities:
        return _Plan(text, [], "")
    audio = omni.graph.finals_with({"audio"})
    if not audio:
        raise ApiError(
            400,
            f"pipeline {omni.config.pipeline!r} has no audio output stage",
            "invalid_request_error",
            "modalities",
        )
    fmt = body.audio.format if body.audio else "wav"
    if fmt not in AUDIO_FORMATS:
        raise ApiError(
            400,
            f"audio.format {fmt!r} is not supported; use one of {', '.join(AUDIO_FORMATS)}",
            "invalid_request_error",
            "audio.format",
        )
    if body.stream and fmt != "pcm16":
        raise ApiError(
            400,
            "streamed audio is sent as pcm16 chunks: set audio.format to 'pcm16'",
            "invalid_request_error",
            "audio.format",
        )
    require_av()
    return _Plan(text, audio[: len(text)], fmt)


def _events(
    outputs: AsyncIterator[OutputChunk], stream: OutputStream, shape: ChunkShape, plan: _Plan
) -> AsyncIterator[bytes]:
    index = {sid: i for i, sid in enumerate(plan.text)}
    index.update({sid: i for i, sid in enumerate(plan.audio)})
    audio_id = f"audio_{shape.request_id.removeprefix('chatcmpl-')}"
    # A choice is finished when all of its stages are.
    open_stages = {i: {sid for sid, j in index.items() if j == i} for i in set(index.values())}
    finish: dict[int, str] = {}
    # Choices with audio: their text goes out as the audio transcript.
    spoken = {index[sid] for sid in plan.audio}
    started_calls: set[tuple[int, int]] = set()  # (stage, call index) already announced
    # One 24 kHz resampler per choice, kept across its chunks so they join seamlessly.
    pcm24: dict[int, AudioEncoder] = {}

    def resampled(i: int, out: OutputChunk) -> bytes:
        if out.modality != "audio":
            return b""
        encoder = pcm24.get(i)
        if encoder is None:
            rate = int((out.meta or {}).get("sample_rate", 22050))
            encoder = pcm24[i] = AudioEncoder("pcm16", rate)
        data = encoder.feed(out.data) if out.data else b""
        if out.finished:
            data += pcm24.pop(i).finish()
        return data

    def render(out: OutputChunk) -> list[bytes]:
        i = index[out.stage_id]
        events = []
        delta: dict[str, Any] | None = None
        if out.modality == "audio":
            data = resampled(i, out)
            if data:
                delta = {"audio": {"id": audio_id, "data": base64.b64encode(data).decode()}}
        elif out.modality == "tool_call" and out.meta:
            delta = {"tool_calls": [call_delta(out)]}
        elif out.text and i in spoken:
            # With audio, OpenAI sends the words once: as the audio's transcript.
            delta = {"audio": {"id": audio_id, "transcript": out.text}}
        elif out.text:
            delta = {"content": out.text}
        if delta is not None or out.logprobs:
            choice: dict[str, Any] = {"index": i, "delta": delta or {}, "finish_reason": None}
            if out.logprobs:
                choice["logprobs"] = chat_logprobs(out.logprobs)
            events.append(shape.chunk([choice]))
        if out.finished:
            if out.stage_id in plan.text:
                finish[i] = out.finish_reason or "stop"
            open_stages[i].discard(out.stage_id)
            if not open_stages[i]:
                reason = finish.get(i, "stop")
                events.append(shape.chunk([{"index": i, "delta": {}, "finish_reason": reason}]))
        return events

    def call_delta(out: OutputChunk) -> dict[str, Any]:
        assert out.meta is not None
        key = (out.stage_id, int(out.meta["index"]))
        if key in started_calls:
            return {"index": key[1], "function": {"arguments": out.text}}
        started_calls.add(key)
        call = _tool_call(shape.request_id, key[1], str(out.meta["name"]), out.text)
        return {"index": key[1], **call}

    def role(i: int) -> dict[str, Any]:
        if i in spoken:
            audio = {"id": audio_id, "transcript": "", "expires_at": shape.created + AUDIO_TTL_S}
            return {"role": "assistant", "content": None, "audio": audio}
        return {"role": "assistant", "content": ""}

    opening = [
        shape.chunk([{"index": i, "delta": role(i), "finish_reason": None}]) for i in open_stages
    ]
    return sse_events(outputs, stream, shape, render, opening)
