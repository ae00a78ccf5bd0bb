"""POST /v1/completions: a plain prompt in, text out (the pipeline's text stages)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from omnistage.api.body import parse_body
from omnistage.api.ids import next_id
from omnistage.api.logprobs import completion_logprobs
from omnistage.api.routes.common import (
    ChunkShape,
    collect,
    json_response,
    openai_usage,
    output_stage_params,
    peeked,
    sse_events,
    sse_response,
    text_call,
)
from omnistage.api.schemas.completions import CompletionRequest
from omnistage.protocol.enums import FinishReason
from omnistage.protocol.front import PipelineRequest
from omnistage.protocol.messages import OutputChunk, Prompt

# Members this hot path compares against, bound once (see protocol/enums.py).
_STOP = FinishReason.STOP


async def completions(request: Request) -> Response:
    body = await parse_body(request, CompletionRequest)
    omni, finals = text_call(request, body)
    request_id = f"cmpl-{next_id()}"
    stage_params = output_stage_params(omni, body, finals)
    prompt = Prompt(text=body.prompt)
    stream = await omni.open(
        PipelineRequest(request_id, prompt, finals, body.sampling_params(), stage_params)
    )
    created, model = int(time.time()), omni.served_model
    index = {sid: i for i, sid in enumerate(finals)}
    if body.stream:
        outputs = await peeked(stream)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        shape = ChunkShape(request_id, "text_completion", created, model, include_usage)
        render = _render(index, shape, body.logprobs is not None)
        return sse_response(sse_events(outputs, stream, shape, render), stream)
    got = await collect(request, stream)
    if got is None:
        return Response(status_code=499)
    choices = [
        {
            "index": i,
            "text": got.text_of(sid),
            "finish_reason": got.finish.get(sid, _STOP),
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
        reason = (out.finish_reason or _STOP) if out.finished else None
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
