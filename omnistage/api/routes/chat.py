"""POST /v1/chat/completions: text, audio and images in; text, or text and audio, out;
streaming or not."""

from __future__ import annotations

import asyncio
import base64
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from omnistage.api.audio_out import DEFAULT_INPUT_RATE, AudioEncoder, encode_whole
from omnistage.api.body import parse_body
from omnistage.api.ids import next_id
from omnistage.api.logprobs import chat_logprobs
from omnistage.api.media_parts import MediaFetch, media_bytes, media_parts
from omnistage.api.routes.common import (
    ChunkShape,
    Collected,
    audio_finals,
    collect,
    json_response,
    openai_usage,
    output_stage_params,
    peeked,
    require_hearing,
    sse_events,
    sse_response,
    text_call,
)
from omnistage.api.schemas.chat import ChatCompletionRequest, ChatMessageIn
from omnistage.protocol.chunk_meta import AudioMeta, ToolCallMeta
from omnistage.protocol.enums import FinishReason, Modality
from omnistage.protocol.errors import ApiError, BadRequestError
from omnistage.protocol.front import PipelineRequest
from omnistage.protocol.messages import ChatMessage, OutputChunk, Prompt, ToolCall
from omnistage.protocol.params import NO_PARAMS, SpeechParams, StageParams
from omnistage.service import OutputStream, PipelineService

# Members this hot path compares against, bound once (see protocol/enums.py).
_AUDIO = Modality.AUDIO
_TOOL_CALL = Modality.TOOL_CALL
_STOP = FinishReason.STOP


# How long the audio id stays meaningful to clients (OpenAI's expires_at); nothing is
# stored server-side, so this is informational.
AUDIO_TTL_S = 3600


@dataclass(frozen=True)
class _Plan:
    """Which final stages answer which part of the response."""

    text: list[int]  # one choice per text stage
    audio: list[int]  # audio stage i goes with choice i
    audio_format: str


async def chat_completions(request: Request) -> Response:
    body = await parse_body(request, ChatCompletionRequest)
    omni, text_stages = text_call(request, body)
    plan = _plan(omni, body, text_stages)
    shown = media_parts(body, omni.graph, omni.config.pipeline)
    prompt, audio_param = _prompt(omni, body)
    if shown:  # fetched once every check of the body has passed
        fetch: MediaFetch = request.app.state.media_fetch
        sound = body.audio_in_video()
        files = [(part.type, await media_bytes(where, part, fetch, sound)) for where, part in shown]
        prompt.images = [data for kind, data in files if kind == "image_url"] or None
        prompt.videos = [data for kind, data in files if kind == "video_url"] or None
        prompt.audio_in_video = sound and prompt.videos is not None
    stage_params = output_stage_params(omni, body, plan.text)
    if plan.audio:
        voice = StageParams(speech=SpeechParams(body.audio.voice if body.audio else "default"))
        for sid in omni.graph.speaking_for(plan.audio):
            stage_params[sid] = stage_params.get(sid, NO_PARAMS).merged(voice)
    request_id = f"chatcmpl-{next_id()}"
    # A stream's status line waits until the audio stages have checked their params
    # (voice, speed): a bad one is then a 400, not an error event after a 200.
    ack = bool(body.stream and plan.audio)
    finals = plan.text + plan.audio
    params = body.sampling_params()
    stream = await omni.open(
        PipelineRequest(request_id, prompt, finals, params, stage_params, ack=ack)
    )
    created = int(time.time())
    try:
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            model = omni.served_model
            shape = ChunkShape(request_id, "chat.completion.chunk", created, model, include_usage)
            outputs = await peeked(stream, frozenset(plan.audio if ack else ()))
            return sse_response(_events(outputs, stream, shape, plan), stream)
        got = await collect(request, stream)
    except BadRequestError as exc:
        # The listener names the audio "file" (as the transcription endpoint calls it).
        if exc.param == "file" and audio_param:
            exc.param = audio_param
        raise
    if got is None:
        return Response(status_code=499)
    audio = []  # audio stage i speaks choice i
    for i in range(min(len(plan.audio), len(plan.text))):
        audio.append(await _audio(got, plan, i, request_id, created))
    logprobs = body.logprobs
    choices = [_choice(got, plan, i, request_id, audio, logprobs) for i in range(len(plan.text))]
    return json_response(
        {
            "id": request_id,
            "object": "chat.completion",
            "created": created,
            "model": omni.served_model,
            "choices": choices,
            "usage": openai_usage(stream.usage()),
        }
    )


async def _audio(
    got: Collected, plan: _Plan, i: int, request_id: str, created: int
) -> dict[str, Any]:
    """The audio of choice ``i`` of a whole answer, encoded (off the event loop)."""
    sid = plan.audio[i]
    pcm = b"".join(got.audio.get(sid, []))
    rate = got.sample_rate.get(sid, DEFAULT_INPUT_RATE)
    data = await asyncio.to_thread(encode_whole, pcm, rate, plan.audio_format)
    return {
        "id": _audio_id(request_id),
        "data": base64.b64encode(data).decode(),
        "transcript": got.text_of(plan.text[i]),
        "expires_at": created + AUDIO_TTL_S,
    }


def _choice(
    got: Collected,
    plan: _Plan,
    i: int,
    request_id: str,
    audio: list[dict[str, Any]],
    logprobs: bool,
) -> dict[str, Any]:
    """Choice ``i`` of a whole (not streamed) answer, with its encoded ``audio[i]``."""
    sid = plan.text[i]
    text = got.text_of(sid)
    message: dict[str, Any] = {"role": "assistant", "content": text}
    calls = got.calls_of(sid)
    if calls:
        message["content"] = text or None
        message["tool_calls"] = [
            _tool_call(request_id, j, name, arguments) for j, (name, arguments) in enumerate(calls)
        ]
    if i < len(audio):
        message["content"] = None  # as OpenAI: the words are the audio's transcript
        message["audio"] = audio[i]
    finish = got.finish.get(sid, _STOP)
    choice_logprobs = chat_logprobs(got.logprobs.get(sid, [])) if logprobs else None
    return {"index": i, "message": message, "finish_reason": finish, "logprobs": choice_logprobs}


def _prompt(omni: PipelineService, body: ChatCompletionRequest) -> tuple[Prompt, str | None]:
    """The messages, and the audio of the last user turn for a stage that listens (with
    the field that holds it, for errors about it)."""
    messages = [_message(m) for m in body.messages]
    heard = [(i, m.audio_parts()) for i, m in enumerate(body.messages) if m.audio_parts()]
    if not heard:
        return Prompt(messages=messages), None
    index, parts = heard[-1]
    param = f"messages.{index}.content"
    require_hearing(omni, param)
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
        "id": f"call_{request_id.removeprefix('chatcmpl-')}_{index}",
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def _audio_id(request_id: str) -> str:
    return f"audio_{request_id.removeprefix('chatcmpl-')}"


def _plan(omni: PipelineService, body: ChatCompletionRequest, text: list[int]) -> _Plan:
    """The answer's stages: the final ``text`` stages, and with modalities audio as many
    audio stages (checking the audio format the answer can be sent in)."""
    fmt = body.audio.format if body.audio else "wav"
    audio = audio_finals(omni, body.modalities, fmt, body.stream)
    return _Plan(text, audio[: len(text)], fmt if audio else "")


def _events(
    outputs: AsyncIterator[OutputChunk], stream: OutputStream, shape: ChunkShape, plan: _Plan
) -> AsyncIterator[bytes]:
    """The SSE body of a streamed answer: each choice's role, then its deltas."""
    chunks = _Chunks(shape, plan)
    return sse_events(outputs, stream, shape, chunks.render, chunks.opening())


class _Chunks:
    """The chunks of a streamed answer, one output at a time. A choice is finished when
    all of its stages are; a choice with audio sends its words once, as OpenAI does: as
    the audio's transcript."""

    def __init__(self, shape: ChunkShape, plan: _Plan) -> None:
        self._shape = shape
        self._text = set(plan.text)
        self._choice = {sid: i for i, sid in enumerate(plan.text)}
        self._choice.update({sid: i for i, sid in enumerate(plan.audio)})
        self._audio_id = _audio_id(shape.request_id)
        # Each choice's stages that have not finished yet.
        self._open = {
            i: {sid for sid, j in self._choice.items() if j == i}
            for i in set(self._choice.values())
        }
        self._spoken = {self._choice[sid] for sid in plan.audio}
        self._finish: dict[int, FinishReason] = {}
        self._started_calls: set[tuple[int, int]] = set()  # (stage, call index) announced
        # One 24 kHz resampler per choice, kept across its chunks so they join seamlessly.
        self._pcm24: dict[int, AudioEncoder] = {}

    def opening(self) -> list[bytes]:
        """Each choice's first chunk: its role (and, with audio, the audio's id)."""
        return [
            self._shape.chunk([{"index": i, "delta": self._role(i), "finish_reason": None}])
            for i in self._open
        ]

    def render(self, out: OutputChunk) -> list[bytes]:
        i = self._choice[out.stage_id]
        events = []
        delta = self._delta(i, out)
        if delta is not None or out.logprobs:
            choice: dict[str, Any] = {"index": i, "delta": delta or {}, "finish_reason": None}
            if out.logprobs:
                choice["logprobs"] = chat_logprobs(out.logprobs)
            events.append(self._shape.chunk([choice]))
        if out.finished:
            events += self._stage_finished(i, out)
        return events

    def _delta(self, i: int, out: OutputChunk) -> dict[str, Any] | None:
        if out.modality == _AUDIO:
            data = self._resampled(i, out)
            if not data:
                return None
            return {"audio": {"id": self._audio_id, "data": base64.b64encode(data).decode()}}
        if out.modality == _TOOL_CALL and isinstance(out.meta, ToolCallMeta):
            return {"tool_calls": [self._call_delta(out, out.meta)]}
        if out.text and i in self._spoken:
            return {"audio": {"id": self._audio_id, "transcript": out.text}}
        if out.text:
            return {"content": out.text}
        return None

    def _resampled(self, i: int, out: OutputChunk) -> bytes:
        encoder = self._pcm24.get(i)
        if encoder is None and not out.data and not out.finished:
            return b""  # an empty chunk (the stage's ack) states no rate: wait for audio
        if encoder is None:
            meta = out.meta
            rate = meta.sample_rate if isinstance(meta, AudioMeta) else DEFAULT_INPUT_RATE
            encoder = self._pcm24[i] = AudioEncoder("pcm16", rate)
        data = encoder.feed(out.data) if out.data else b""
        if out.finished:
            data += self._pcm24.pop(i).finish()
        return data

    def _call_delta(self, out: OutputChunk, meta: ToolCallMeta) -> dict[str, Any]:
        key = (out.stage_id, meta.index)
        if key in self._started_calls:
            return {"index": key[1], "function": {"arguments": out.text}}
        self._started_calls.add(key)
        call = _tool_call(self._shape.request_id, key[1], meta.name, out.text)
        return {"index": key[1], **call}

    def _stage_finished(self, i: int, out: OutputChunk) -> list[bytes]:
        """The choice's last chunk, with its finish reason, once its stages are done."""
        if out.stage_id in self._text:
            self._finish[i] = out.finish_reason or _STOP
        self._open[i].discard(out.stage_id)
        if self._open[i]:
            return []
        reason = self._finish.get(i, _STOP)
        return [self._shape.chunk([{"index": i, "delta": {}, "finish_reason": reason}])]

    def _role(self, i: int) -> dict[str, Any]:
        if i in self._spoken:
            audio = {
                "id": self._audio_id,
                "transcript": "",
                "expires_at": self._shape.created + AUDIO_TTL_S,
            }
            return {"role": "assistant", "content": None, "audio": audio}
        return {"role": "assistant", "content": ""}
