"""POST /v1/responses: OpenAI's Responses API over the pipeline's first text stage.

The request becomes a chat prompt (see ``api.response_runs``); the videos of its last
user message (chat's ``video_url`` parts) go with it (see ``api.media_parts``).
Structured output and function tools reach the text stage in the chat shape, in its
stage params (``response_format``, ``tools``, ``tool_choice``). What the stage writes becomes one
``message`` output item (spoken, where ``modalities`` asks for audio: see
``api.response_audio``); each call it makes (chunks of modality "tool_call": a piece of
the call's JSON arguments, its ``ToolCallMeta`` naming the call) a ``function_call`` item.

Responses are stored (``store``, default true, as OpenAI): ``previous_response_id``
continues a stored conversation, and /v1/responses/{id} reads it back (see
``stored_responses``). ``background: true`` runs the response as a job: the answer is
the queued response at once, to poll and cancel.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from omnistage.api.body import parse_body
from omnistage.api.media_parts import media_file, response_videos
from omnistage.api.owner import owner_of
from omnistage.api.response_audio import Spoken, audio_plan
from omnistage.api.response_items import Output, ResponseShape
from omnistage.api.response_runs import in_our_terms, pipeline_request
from omnistage.api.response_store import Turn
from omnistage.api.routes.common import (
    collect_into,
    json_encoder,
    json_response,
    peeked,
    sse_response,
    stored,
    text_call,
)
from omnistage.api.schemas.responses import ResponsesRequest
from omnistage.jobs.state import Persistence
from omnistage.protocol.errors import ApiError, BadRequestError
from omnistage.protocol.messages import OutputChunk
from omnistage.service import OutputStream
from omnistage.store.records import Job, JobKind, ResponseStatus

Keep = Callable[[dict[str, Any]], Awaitable[None]]


async def responses(request: Request) -> Response:
    body = await parse_body(request, ResponsesRequest)
    omni, text_stages = text_call(request, body, _refuse_unserved)
    sid = text_stages[0]  # the first final text stage answers, as a chat's first choice
    shown = response_videos(body, omni.graph, omni.config.pipeline)
    if shown and body.background:  # the job runner fetches nothing
        message = "background responses do not take videos yet"
        raise ApiError(400, message, "invalid_request_error", shown[0][0])
    persist = stored(request)
    turn, asked = await Turn.of(persist, body, owner_of(request))
    shape = ResponseShape.of(body, turn.id, omni.served_model, turn.stored)
    if body.background:
        assert persist is not None
        return await _queue(persist, turn, shape, asked, sid)
    audio = audio_plan(omni, body)
    output = Output(omni.graph.stages[sid].name, Spoken(audio) if audio is not None else None)

    async def keep(final: dict[str, Any]) -> None:
        await turn.keep(final, body.previous_response_id)

    fetch = request.app.state.media_fetch  # once every check of the body has passed
    sound = body.audio_in_video()
    videos = [await media_file(where, "video_url", url, fetch, sound) for where, url in shown]
    pipeline = pipeline_request(omni, asked, sid, turn.id, turn.conversation, audio, videos)
    try:
        stream = await omni.open(pipeline)
        if body.stream:
            outputs = await peeked(stream, frozenset([audio.stage] if audio else ()))
            return sse_response(_events(outputs, stream, shape, output, keep), stream)
        if await collect_into(request, stream, output) is None:
            return Response(status_code=499)
        if audio is None:
            output.finish()
        else:  # a whole answer's audio is encoded as it ends: off the event loop
            await asyncio.to_thread(output.finish)
    except BadRequestError as exc:
        raise in_our_terms(exc) from None
    final = shape.final(output, stream.usage())
    await keep(final)
    return json_response(final)


async def _queue(
    persist: Persistence, turn: Turn, shape: ResponseShape, asked: ResponsesRequest, sid: int
) -> Response:
    """A background response: stored queued, and a job the runner will run."""
    queued = shape.body(ResponseStatus.QUEUED)
    spec = {
        "body": asked.model_dump(mode="json", exclude_none=True, by_alias=True),
        "previous_response_id": asked.previous_response_id,
        "conversation": turn.conversation,
        "shape": {"created_at": shape.created_at, "model": shape.model, **shape.settings},
        "stage": sid,
    }
    await persist.store.put_response(turn.record(queued, asked.previous_response_id))
    job = Job(
        id=turn.id,
        kind=JobKind.RESPONSE,
        owner=turn.owner,
        request=spec,
        created_at=time.time(),  # to the microsecond: jobs are claimed oldest first
    )
    await persist.store.create_job(job)
    persist.wake()
    return json_response(queued)


def _refuse_unserved(body: ResponsesRequest) -> None:
    if body.background and not body.store:
        raise ApiError(
            400,
            "background responses must be stored (store: true)",
            "invalid_request_error",
            "store",
        )
    if body.background and body.stream:
        raise ApiError(
            400,
            "background responses are not streamed here: poll GET /v1/responses/{id}",
            "invalid_request_error",
            "stream",
        )
    names = {t.name for t in body.tools or []}
    choice = body.tool_choice
    if choice is not None and choice.type in ("required", "function") and not names:
        raise ApiError(
            400, f"tool_choice {choice.type!r} needs tools", "invalid_request_error", "tool_choice"
        )
    if choice is not None and choice.type == "function" and choice.name not in names:
        raise ApiError(
            400,
            f"tool_choice names {choice.name!r}, which is not one of tools",
            "invalid_request_error",
            "tool_choice.name",
        )


async def _events(
    outputs: AsyncIterator[OutputChunk],
    stream: OutputStream,
    shape: ResponseShape,
    output: Output,
    keep: Keep,
) -> AsyncIterator[bytes]:
    """The SSE body: response.created, .in_progress, the output's events, then
    response.completed (or .incomplete), or response.failed if the request fails. The
    final response is stored before its event is sent."""
    numbers = itertools.count()

    def sse(event: dict[str, Any]) -> bytes:
        event["sequence_number"] = next(numbers)
        kind = event["type"].encode()
        return b"event: " + kind + b"\ndata: " + json_encoder.encode(event) + b"\n\n"

    for kind in ("response.created", "response.in_progress"):
        yield sse({"type": kind, "response": shape.body("in_progress")})
    try:
        async for out in outputs:
            for event in output.add(out):
                yield sse(event)
        for event in output.finish():
            yield sse(event)
    except Exception as exc:
        if isinstance(exc, BadRequestError):
            exc = in_our_terms(exc)
        output.abandon()
        failed = shape.failed(output, exc)
        await keep(failed)
        yield sse({"type": "response.failed", "response": failed})
        return
    finally:
        stream.close()
    final = shape.final(output, stream.usage())
    await keep(final)
    yield sse({"type": f"response.{final['status']}", "response": final})
