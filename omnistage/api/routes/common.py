"""Pieces shared by the generation routes."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import msgspec
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from omnistage.api.audio_out import require_av
from omnistage.api.schemas.base import SamplingFields
from omnistage.api.schemas.chat import ChatCompletionRequest
from omnistage.api.schemas.completions import CompletionRequest
from omnistage.api.schemas.responses import ResponsesRequest
from omnistage.api.streaming import SSE_DONE, ClientDisconnectedError, sse, unless_disconnected
from omnistage.jobs.state import Persistence
from omnistage.protocol.chunk_meta import AudioMeta, ToolCallMeta
from omnistage.protocol.enums import EngineName, FinishReason, Modality
from omnistage.protocol.errors import ApiError, as_api_error, error_body
from omnistage.protocol.messages import OutputChunk, TokenLogprob, Usage
from omnistage.protocol.params import ParamKind, StageParams, decode, kind_of
from omnistage.service import OutputStream, PipelineService

# Members this hot path compares against, bound once (see protocol/enums.py).
_TEXT = Modality.TEXT
_TOOL_CALL = Modality.TOOL_CALL
_AUDIO = Modality.AUDIO
_STOP = FinishReason.STOP


# OpenAI's chat audio formats, all 24 kHz mono (api/audio_out.py); a stream is pcm16.
AUDIO_FORMATS = ("wav", "mp3", "flac", "opus", "aac", "pcm16")

json_encoder = msgspec.json.Encoder()


def json_response(obj: object, status: int = 200) -> Response:
    return Response(json_encoder.encode(obj), status_code=status, media_type="application/json")


def service(request: Request) -> PipelineService:
    """The head behind this app (see ``api.service``)."""
    return request.app.state.omni  # type: ignore[no-any-return]


def stored(request: Request) -> Persistence | None:
    """The store of jobs and responses the app was made with (None: nothing is kept)."""
    return getattr(request.app.state, "persist", None)  # type: ignore[no-any-return]


def persistence(request: Request) -> Persistence:
    """The store, for routes that serve nothing without one (a 503 if there is none)."""
    persist = stored(request)
    if persist is None:
        raise ApiError(503, "this server keeps no store", "server_error", code="no_store")
    return persist


def check_model(omni: PipelineService, model: str | None) -> None:
    if model is not None and model not in omni.model_names:
        raise ApiError(
            404,
            f"The model `{model}` does not exist; this server serves "
            f"{', '.join(sorted(omni.model_names))}",
            "invalid_request_error",
            "model",
            "model_not_found",
        )


def resolve_stage_params(
    omni: PipelineService, stage_params: dict[str, dict[str, Any]] | None
) -> dict[int, StageParams]:
    """The ``stage_params`` extension: per-stage params keyed by stage id or name, each
    decoded as that stage's engine reads them (a bad value: a 400 naming the field)."""
    if not stage_params:
        return {}
    by_name = {s.name: s.stage_id for s in omni.config.stages}
    out: dict[int, StageParams] = {}
    for key, params in stage_params.items():
        # isascii: str.isdigit() is true of '³', which int() refuses.
        sid = int(key) if key.isascii() and key.isdigit() else by_name.get(key)
        if sid is None or sid not in omni.graph.stages:
            raise ApiError(
                400, f"stage_params: no stage {key!r}", "invalid_request_error", "stage_params"
            )
        out[sid] = decode(kind_of(omni.graph.stages[sid].engine), params)
    return out


def output_stage_params(
    omni: PipelineService, body: SamplingFields, answering: list[int]
) -> dict[int, StageParams]:
    """``stage_params`` over what only the stages writing the answer take (logprobs,
    response_format, tools; see ``output_params`` of the request bodies)."""
    out = resolve_stage_params(omni, body.stage_params)
    if extra := body.output_params():
        answer = decode(ParamKind.TEXT, extra)
        for sid in answering:
            out[sid] = answer.merged(out.get(sid))
    return out


# The bodies of the routes answered by the pipeline's final text stages.
TextBody = TypeVar("TextBody", ChatCompletionRequest, CompletionRequest, ResponsesRequest)


def text_call(
    request: Request, body: TextBody, refuse: Callable[[TextBody], None] | None = None
) -> tuple[PipelineService, list[int]]:
    """The checks every text route (chat, completions, responses) makes of its parsed
    body: its model; then a 400 for ``n`` other than 1, for what ``refuse`` refuses, and
    for a pipeline with no text output. Returns the head and its final text stages.
    Not async: it runs on every request, where a coroutine costs a microsecond."""
    omni = service(request)
    check_model(omni, body.model)
    if isinstance(body, SamplingFields) and body.n != 1:
        raise ApiError(400, "n > 1 is not supported by this pipeline", "invalid_request_error", "n")
    if refuse is not None:
        refuse(body)
    text = omni.graph.finals_with({Modality.TEXT})
    if not text:
        raise ApiError(400, "this pipeline produces no text output", "invalid_request_error")
    return omni, text


def require_hearing(omni: PipelineService, param: str) -> None:
    """A 400 naming ``param`` (where the spoken input is) unless a stage takes audio."""
    if not omni.graph.stages_reading(Modality.AUDIO):
        raise ApiError(
            400,
            f"pipeline {omni.config.pipeline!r} has no stage that takes audio input",
            "invalid_request_error",
            param,
        )


def audio_finals(
    omni: PipelineService, modalities: list[str] | None, fmt: str, stream: bool
) -> list[int]:
    """The final audio stages that speak an answer asked for with ``modalities`` (none
    without "audio"), checking the format it can be sent in: a stream is pcm16."""
    if "audio" not in (modalities or ["text"]):
        return []
    audio = omni.graph.finals_with({Modality.AUDIO})
    if not audio:
        raise ApiError(
            400,
            f"pipeline {omni.config.pipeline!r} has no audio output stage",
            "invalid_request_error",
            "modalities",
        )
    if fmt not in AUDIO_FORMATS:
        raise ApiError(
            400,
            f"audio.format {fmt!r} is not supported; use one of {', '.join(AUDIO_FORMATS)}",
            "invalid_request_error",
            "audio.format",
        )
    if stream and fmt != "pcm16":
        raise ApiError(
            400,
            "streamed audio is sent as pcm16 chunks: set audio.format to 'pcm16'",
            "invalid_request_error",
            "audio.format",
        )
    require_av()
    return audio


def engine_stages(omni: PipelineService, engine: EngineName, missing: str, code: str) -> list[Any]:
    """The pipeline's stages running ``engine``; none is a 404 saying ``missing``."""
    stages = [s for s in omni.config.stages if s.engine == engine]
    if not stages:
        raise ApiError(
            404,
            f"pipeline {omni.config.pipeline!r} has no {missing}",
            "invalid_request_error",
            None,
            code,
        )
    return stages


def pick_stage(
    omni: PipelineService, stages: list[Any], wanted: str | None, noun: str, code: str
) -> Any:
    """The stage a request's ``stage`` field names (id or name) among ``stages``, else
    the first; naming none of them is a 400."""
    if wanted is None:
        return stages[0]
    for s in stages:
        if wanted in (str(s.stage_id), s.name):
            return s
    raise ApiError(
        400,
        f"pipeline {omni.config.pipeline!r} has no {noun} {wanted!r}",
        "invalid_request_error",
        "stage",
        code,
    )


@dataclass
class Collected:
    """A whole request's final outputs, per stage."""

    text: dict[int, list[str]] = field(default_factory=dict)
    audio: dict[int, list[bytes]] = field(default_factory=dict)
    sample_rate: dict[int, int] = field(default_factory=dict)
    finish: dict[int, FinishReason] = field(default_factory=dict)
    logprobs: dict[int, list[TokenLogprob]] = field(default_factory=dict)
    # stage -> call index -> (function name, argument pieces)
    calls: dict[int, dict[int, tuple[str, list[str]]]] = field(default_factory=dict)

    def add(self, out: OutputChunk) -> None:
        if out.text and out.modality == _TEXT:
            self.text.setdefault(out.stage_id, []).append(out.text)
        if out.modality == _TOOL_CALL and isinstance(out.meta, ToolCallMeta):
            calls = self.calls.setdefault(out.stage_id, {})
            _, pieces = calls.setdefault(out.meta.index, (out.meta.name, []))
            pieces.append(out.text)
        if out.logprobs:
            self.logprobs.setdefault(out.stage_id, []).extend(out.logprobs)
        if out.data and out.modality == _AUDIO:
            self.audio.setdefault(out.stage_id, []).append(out.data)
        if isinstance(out.meta, AudioMeta):
            self.sample_rate[out.stage_id] = out.meta.sample_rate
        if out.finished:
            self.finish[out.stage_id] = out.finish_reason or _STOP

    def text_of(self, sid: int) -> str:
        return "".join(self.text.get(sid, []))

    def calls_of(self, sid: int) -> list[tuple[str, str]]:
        """The stage's function calls: (name, JSON arguments), in order."""
        calls = self.calls.get(sid, {})
        return [(calls[i][0], "".join(calls[i][1])) for i in sorted(calls)]


async def collect(request: Request, stream: OutputStream) -> Collected | None:
    """Gather every output; None if the client went away (the request is aborted)."""
    return await collect_into(request, stream, Collected())


class Sink(Protocol):
    def add(self, out: OutputChunk) -> None: ...


S = TypeVar("S", bound=Sink)


async def collect_into(request: Request, stream: OutputStream, got: S) -> S | None:
    """Every output into ``got``; None if the client went away (the request is aborted)."""

    async def gather() -> S:
        try:
            async for out in stream:
                got.add(out)
        finally:
            stream.close()
        return got

    try:
        return await unless_disconnected(request, gather())
    except ClientDisconnectedError:
        return None


async def peeked(
    stream: OutputStream, stages: set[int] = frozenset()
) -> AsyncIterator[OutputChunk]:
    """Wait for the first output (and one from each of ``stages``, opened with ``ack``)
    before answering, so errors a stage reports straight away (bad voice, prompt too
    long) become a proper 4xx instead of an in-band event. Returns an iterator over
    every output, those read here included."""
    it = aiter(stream)
    early: list[OutputChunk] = []
    waiting = set(stages)
    try:
        while not early or waiting:
            out = await anext(it)
            early.append(out)
            waiting.discard(out.stage_id)
    except StopAsyncIteration:
        pass
    except BaseException:
        stream.close()
        raise

    async def rest() -> AsyncIterator[OutputChunk]:
        for out in early:
            yield out
        if early:
            async for out in it:
                yield out

    return rest()


@dataclass(frozen=True)
class ChunkShape:
    """The fixed fields of every streamed chunk of one response."""

    request_id: str
    object: str
    created: int
    model: str
    include_usage: bool

    def chunk(self, choices: list[dict[str, Any]], usage: Usage | None = None) -> bytes:
        body: dict[str, Any] = {
            "id": self.request_id,
            "object": self.object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if self.include_usage:
            body["usage"] = None if usage is None else openai_usage(usage)
        return sse(body)


def openai_usage(usage: Usage) -> dict[str, Any]:
    """A request's token counts as chat and completions report them: a prefix cache's
    share of the prompt as ``prompt_tokens_details.cached_tokens``, where an engine
    keeps one (OpenAI's field; clients and aiperf read it)."""
    body: dict[str, Any] = {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
    }
    if usage.cached_tokens is not None:
        body["prompt_tokens_details"] = {"cached_tokens": usage.cached_tokens}
    return body


def sse_response(events: AsyncIterator[bytes], stream: OutputStream) -> StreamingResponse:
    """A server-sent events answer over ``stream``. The background close covers a
    client that leaves before the first byte."""
    return streaming_response(events, stream, "text/event-stream")


def streaming_response(
    body: AsyncIterator[bytes], stream: OutputStream, media_type: str
) -> StreamingResponse:
    """A streamed answer over ``stream``, closed however it ends (see ``sse_response``)."""
    return StreamingResponse(body, media_type=media_type, background=BackgroundTask(_close, stream))


async def _close(stream: OutputStream) -> None:
    # A coroutine, so Starlette runs it on the loop: a plain function it would hand to
    # its thread pool, a round trip through another thread for every streamed answer.
    stream.close()


async def sse_events(
    outputs: AsyncIterator[OutputChunk],
    stream: OutputStream,
    shape: ChunkShape,
    render: Callable[[OutputChunk], list[bytes]],
    opening: list[bytes] | None = None,
) -> AsyncIterator[bytes]:
    """An SSE response body: ``opening``, each output rendered, then usage and [DONE].

    Once the status line is sent, a failure is reported in-band as OpenAI does: an
    error event, then [DONE]. However it ends, the request is closed (aborted if
    unfinished).
    """
    for event in opening or []:
        yield event
    try:
        async for out in outputs:
            for event in render(out):
                yield event
    except Exception as exc:
        e = as_api_error(exc)
        yield sse(error_body(e.message, e.type, e.param, e.code))
        yield SSE_DONE
        return
    finally:
        stream.close()
    if shape.include_usage:
        yield shape.chunk([], stream.usage())
    yield SSE_DONE
