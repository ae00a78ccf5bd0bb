"""POST /v1/completions: a plain prompt in, text out (the pipeline's text stages)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Request
from starlette.background import BackgroundTask
from starlette.responses import Response, StreamingResponse

from omnistage.api.errors import ApiError
from omnistage.api.ids import next_id
from omnistage.api.logprobs import completion_logprobs
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
from omnistage.api.schemas import CompletionRequest, body_schema, parse_body
from omnistage.protocol.messages import OutputChunk, Prompt

router = APIRouter()


@router.post("/v1/completions", openapi_extra=body_schema(CompletionRequest))
async def completions(request: Request) -> Response:
    body = await parse_body(request, CompletionRequest)
    omni = service(request)
    check_model(omni, body.model)
    if body.n != 1:
        raise ApiError(400, "n > 1 is not supported by this pipeline", "invalid_request_error", "n")
    finals = omni.graph.finals_with({"text"})
    if not finals:
        raise ApiError(400, "this pipeline produces no text output", "invalid_request_error")
    request_id = f"cmpl-{next_id()}"
    stream = await omni.open(
        request_id,
        Prompt(text=body.prompt),
        finals,
        body.sampling_params(),
        output_stage_params(omni, body, finals),
    )
    created, model = int(time.time()), omni.served_model
    index = {sid: i for i, sid in enumerate(finals)}
    if body.stream:
        outputs = await peeked(stream)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        shape = ChunkShape(request_id, "text_completion", created, model, include_usage)
        render = _render(index, shape, body.logprobs is not None)
        events = sse_events(outputs, stream, shape, render)
        return StreamingResponse(
            events, media_type="text/event-stream", background=BackgroundTask(stream.close)
        )
    got = await collect(request, stream)
    if got is None:
        return Response(status_code=499)
    choices = [
        {
            "index": i,
            "text": got.text_of(sid),
            "finish_reason": got.finish.get(sid, "stop"),
            "logprobs": (
                completion_logprobs(got.logprobs.get(sid, []))
                if body.logprobs is not None
                else None
            ),
        }
        for sid, i in index.items()
    ]
    return json_response(
        {
            "id": request_id,
            "object": "text_completion",
            "created": created,
            "model": model,
            "choices": choices,
            "usage": openai_usage(stream.usage()),
        }
    )


def _render(
    index: dict[int, int], shape: ChunkShape, logprobs: bool
) -> Callable[[OutputChunk], list[bytes]]:
    offsets = dict.fromkeys(index, 0)  # where each choice's next piece starts

    def render(out: OutputChunk) -> list[bytes]:
        reason = (out.finish_reason or "stop") if out.finished else None
        if not (out.text or reason):
            return []
        choice: dict[str, Any] = {
            "index": index[out.stage_id],
            "text": out.text,
            "finish_reason": reason,
            "logprobs": None,
        }
        if logprobs:
            choice["logprobs"] = completion_logprobs(out.logprobs or [], offsets[out.stage_id])
        offsets[out.stage_id] += len(out.text)
        return [shape.chunk([choice])]

    return render
