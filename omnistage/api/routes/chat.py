"""POST /v1/chat/completions, streaming and not."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import msgspec
from fastapi import APIRouter, Request
from starlette.background import BackgroundTask
from starlette.responses import Response, StreamingResponse

from omnistage.api.errors import ApiError, as_api_error, error_body
from omnistage.api.ids import next_id
from omnistage.api.schemas import (
    ChatCompletionRequest,
    SamplingFields,
    body_schema,
    parse_body,
)
from omnistage.api.streaming import SSE_DONE, ClientDisconnectedError, sse, unless_disconnected
from omnistage.dataplane.orchestrator import RequestStream, StageOutput
from omnistage.protocol.messages import ChatMessage, Prompt

router = APIRouter()
_json = msgspec.json.Encoder()


@dataclass
class _Collected:
    text: dict[int, list[str]] = field(default_factory=dict)
    finish: dict[int, str] = field(default_factory=dict)


@router.post("/v1/chat/completions", openapi_extra=body_schema(ChatCompletionRequest))
async def chat_completions(request: Request) -> Response:
    body = await parse_body(request, ChatCompletionRequest)
    omni = request.app.state.omni
    check_model(omni, body.model)
    if body.n != 1:
        raise ApiError(400, "n > 1 is not supported by this pipeline", "invalid_request_error", "n")
    modalities = set(body.modalities or ["text"])
    if "audio" in modalities and not omni.graph.finals_with({"audio"}):
        raise ApiError(
            400,
            f"pipeline {omni.config.pipeline!r} has no audio output stage",
            "invalid_request_error",
            "modalities",
        )
    finals = omni.graph.finals_with({"text"})
    if not finals:
        raise ApiError(400, "this pipeline produces no text output", "invalid_request_error")
    prompt = Prompt(messages=[ChatMessage(m.role, m.text()) for m in body.messages])
    request_id = f"chatcmpl-{next_id()}"
    stage_params = resolve_stage_params(omni, body)
    stream = await omni.orchestrator.open(
        request_id, prompt, finals, body.sampling_params(), stage_params
    )
    index = {sid: i for i, sid in enumerate(finals)}
    created = int(time.time())
    model = omni.config.pipeline
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        events = _stream_events(stream, request_id, created, model, index, include_usage)
        # The background close covers a client that leaves before the first byte.
        return StreamingResponse(
            events, media_type="text/event-stream", background=BackgroundTask(stream.close)
        )
    try:
        got = await unless_disconnected(request, _collect(stream))
    except ClientDisconnectedError:
        return Response(status_code=499)
    choices = [
        {
            "index": i,
            "message": {"role": "assistant", "content": "".join(got.text.get(sid, []))},
            "finish_reason": got.finish.get(sid, "stop"),
            "logprobs": None,
        }
        for sid, i in index.items()
    ]
    return Response(
        _json.encode(
            {
                "id": request_id,
                "object": "chat.completion",
                "created": created,
                "model": model,
                "choices": choices,
                "usage": stream.usage(),
            }
        ),
        media_type="application/json",
    )


async def _collect(stream: RequestStream) -> _Collected:
    got = _Collected()
    try:
        async for out in stream:
            _account(got, out)
    finally:
        stream.close()
    return got


def _account(got: _Collected, out: StageOutput) -> None:
    if out.text:
        got.text.setdefault(out.stage_id, []).append(out.text)
    if out.finished:
        got.finish[out.stage_id] = out.finish_reason or "stop"


async def _stream_events(
    stream: RequestStream,
    request_id: str,
    created: int,
    model: str,
    index: dict[int, int],
    include_usage: bool,
) -> AsyncIterator[bytes]:
    def chunk(choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> bytes:
        body: dict[str, Any] = {
            "id": request_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "choices": choices,
        }
        if include_usage:
            body["usage"] = usage
        return sse(body)

    for i in index.values():
        yield chunk(
            [{"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]
        )
    try:
        async for out in stream:
            i = index[out.stage_id]
            if out.text:
                yield chunk([{"index": i, "delta": {"content": out.text}, "finish_reason": None}])
            if out.finished:
                reason = out.finish_reason or "stop"
                yield chunk([{"index": i, "delta": {}, "finish_reason": reason}])
    except Exception as exc:  # the status line is sent: report in-band, as OpenAI does
        e = as_api_error(exc)
        yield sse(error_body(e.message, e.type, e.param, e.code))
        yield SSE_DONE
        return
    finally:
        stream.close()
    if include_usage:
        yield chunk([], stream.usage())
    yield SSE_DONE


def check_model(omni: Any, model: str | None) -> None:
    if model is not None and model not in omni.model_names:
        raise ApiError(
            404,
            f"The model `{model}` does not exist; this server serves "
            f"{', '.join(sorted(omni.model_names))}",
            "invalid_request_error",
            "model",
            "model_not_found",
        )


def resolve_stage_params(omni: Any, body: SamplingFields) -> dict[int, dict[str, Any]]:
    if not body.stage_params:
        return {}
    by_name = {s.name: s.stage_id for s in omni.config.stages}
    out: dict[int, dict[str, Any]] = {}
    for key, params in body.stage_params.items():
        sid = int(key) if key.isdigit() else by_name.get(key)
        if sid is None or sid not in omni.graph.stages:
            raise ApiError(
                400, f"stage_params: no stage {key!r}", "invalid_request_error", "stage_params"
            )
        out[sid] = params
    return out
