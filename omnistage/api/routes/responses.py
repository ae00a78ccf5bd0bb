"""POST /v1/responses: OpenAI's Responses API over the pipeline's first text stage.

The request becomes the prompt /v1/chat/completions would build: ``instructions`` as a
system message first, then ``input``, earlier function calls and their outputs as an
assistant turn's ``tool_calls`` and tool messages. Structured output and function tools
reach the text stage in the chat shape, in its stage params (``response_format``,
``tools``, ``tool_choice``). What the stage writes becomes one ``message`` output item;
each call it makes (chunks of modality "tool_call": a piece of the call's JSON
arguments, ``meta.index`` and ``.name``) a ``function_call`` item.

Nothing is stored: ``previous_response_id`` is refused, and ``store`` changes nothing.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from omnistage.api.body import parse_body
from omnistage.api.errors import ApiError, as_api_error
from omnistage.api.ids import next_id
from omnistage.api.routes.common import (
    collect_into,
    json_encoder,
    json_response,
    peeked,
    resolve_stage_params,
    sse_response,
    text_call,
)
from omnistage.api.schemas.responses import ResponsesRequest
from omnistage.api.service import OutputStream
from omnistage.protocol.enums import FinishReason, Modality
from omnistage.protocol.errors import BadRequestError, StageFailedError
from omnistage.protocol.front import PipelineRequest
from omnistage.protocol.messages import ChatMessage, ChunkMeta, OutputChunk, Prompt, ToolCall
from omnistage.protocol.params import NO_PARAMS, ParamKind, decode

# The text stage checks its params under their chat names; a 400 names the field the
# client sent.
_PARAM_NAMES = {"response_format": "text.format", "max_tokens": "max_output_tokens"}
# ResponseError.code by HTTP status, for a failure after the stream started.
_FAILURE_CODES = {400: "invalid_prompt", 429: "rate_limit_exceeded"}


async def responses(request: Request) -> Response:
    body = await parse_body(request, ResponsesRequest)
    omni, text_stages = text_call(request, body, _refuse_unserved)
    sid = text_stages[0]  # the first final text stage answers, as a chat's first choice
    shape = _ResponseShape.of(body, f"resp_{next_id()}", omni.served_model)
    output = _Output(omni.graph.stages[sid].name)
    try:
        stage_params = resolve_stage_params(omni, body.stage_params)
        if extra := body.chat_params():
            answer = decode(ParamKind.TEXT, extra)
            stage_params[sid] = stage_params.get(sid, NO_PARAMS).merged(answer)
        prompt = Prompt(messages=_messages(body))
        params = body.sampling_params()
        stream = await omni.open(PipelineRequest(shape.id, prompt, [sid], params, stage_params))
        if body.stream:
            outputs = await peeked(stream)
            return sse_response(_events(outputs, stream, shape, output), stream)
        if await collect_into(request, stream, output) is None:
            return Response(status_code=499)
        output.finish()
    except BadRequestError as exc:
        raise _in_our_terms(exc) from None
    return json_response(shape.final(output, stream.usage()))


def _refuse_unserved(body: ResponsesRequest) -> None:
    if body.previous_response_id is not None:
        raise ApiError(
            400,
            "previous_response_id is not supported: this server stores no responses; "
            "send the whole conversation in input",
            "invalid_request_error",
            "previous_response_id",
        )
    if body.modalities and "audio" in body.modalities:
        raise ApiError(
            400,
            "audio output is served on /v1/chat/completions (modalities, audio)",
            "invalid_request_error",
            "modalities",
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


def _messages(body: ResponsesRequest) -> list[ChatMessage]:
    """The chat history ``instructions`` and ``input`` describe. The item fields read
    here are those its schema requires of its type."""
    messages = [ChatMessage("system", body.instructions)] if body.instructions else []
    for item in body.input:
        if item.type == "message":
            messages.append(ChatMessage(str(item.role), item.text()))
        elif item.type == "function_call":
            call = ToolCall(str(item.call_id), str(item.name), str(item.arguments))
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant":  # one turn: its text, its calls
                last.tool_calls = [*(last.tool_calls or []), call]
            else:
                messages.append(ChatMessage("assistant", "", tool_calls=[call]))
        else:
            messages.append(ChatMessage("tool", item.text(), tool_call_id=item.call_id))
    return messages


def _in_our_terms(exc: BadRequestError) -> BadRequestError:
    if exc.param in _PARAM_NAMES:
        exc.param = _PARAM_NAMES[exc.param]
    return exc


# -- output ----------------------------------------------------------------------------


class _Item:
    """What the output items share: the events that add one and mark it done, around
    those of its own kind."""

    index: int  # output_index

    def item(self) -> dict[str, Any]:
        raise NotImplementedError

    def _opening(self) -> list[dict[str, Any]]:
        return []

    def _closing(self) -> list[dict[str, Any]]:
        raise NotImplementedError

    def started(self) -> list[dict[str, Any]]:
        added = {"type": "response.output_item.added", "output_index": self.index}
        return [{**added, "item": self.item()}, *self._opening()]

    def ended(self) -> list[dict[str, Any]]:
        closing = self._closing()
        done = {"type": "response.output_item.done", "output_index": self.index}
        return [*closing, {**done, "item": self.item()}]


@dataclass
class _Message(_Item):
    index: int
    id: str = field(default_factory=lambda: f"msg_{next_id()}")
    text: list[str] = field(default_factory=list)
    status: str = "in_progress"

    def part(self) -> dict[str, Any]:
        return {
            "type": "output_text",
            "text": "".join(self.text),
            "annotations": [],
            "logprobs": [],
        }

    def item(self) -> dict[str, Any]:
        content = [self.part()] if self.status != "in_progress" else []
        return {
            "type": "message",
            "id": self.id,
            "status": self.status,
            "role": "assistant",
            "content": content,
        }

    def piece(self, text: str) -> dict[str, Any]:
        self.text.append(text)
        return {
            "type": "response.output_text.delta",
            **self._where(),
            "delta": text,
            "logprobs": [],
        }

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.id, "output_index": self.index, "content_index": 0}

    def _opening(self) -> list[dict[str, Any]]:
        return [{"type": "response.content_part.added", **self._where(), "part": self.part()}]

    def _closing(self) -> list[dict[str, Any]]:
        where, text = self._where(), "".join(self.text)
        return [
            {"type": "response.output_text.done", **where, "text": text, "logprobs": []},
            {"type": "response.content_part.done", **where, "part": self.part()},
        ]


@dataclass
class _Call(_Item):
    index: int
    name: str
    id: str = field(default_factory=lambda: f"fc_{next_id()}")
    call_id: str = field(default_factory=lambda: f"call_{next_id()}")
    arguments: list[str] = field(default_factory=list)
    status: str = "in_progress"

    def item(self) -> dict[str, Any]:
        return {
            "type": "function_call",
            "id": self.id,
            "call_id": self.call_id,
            "name": self.name,
            "arguments": "".join(self.arguments),
            "status": self.status,
        }

    def piece(self, text: str) -> dict[str, Any]:
        self.arguments.append(text)
        where = {"item_id": self.id, "output_index": self.index}
        return {"type": "response.function_call_arguments.delta", **where, "delta": text}

    def _closing(self) -> list[dict[str, Any]]:
        where = {"item_id": self.id, "output_index": self.index}
        arguments = "".join(self.arguments)
        return [{"type": "response.function_call_arguments.done", **where, "arguments": arguments}]


class _Output:
    """The output items as the text stage's chunks build them, and the stream events
    that tell of each step. As OpenAI streams them, one item is open at a time: it is
    added, filled and done before the next is added. The engine writes each call's
    arguments in one run (``meta.index`` never goes back to an ended call)."""

    def __init__(self, stage_name: str) -> None:
        self.stage_name = stage_name
        self.items: list[_Message | _Call] = []
        self.finish_reason = FinishReason.STOP
        self._open: _Message | _Call | None = None
        self._calls: dict[int, _Call] = {}  # by the engine's call index

    def add(self, out: OutputChunk) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if out.modality == Modality.TEXT and out.text:
            if not isinstance(self._open, _Message):
                events += self._start(_Message(len(self.items)))
            assert self._open is not None
            events.append(self._open.piece(out.text))
        elif out.modality == Modality.TOOL_CALL:
            meta = out.meta or ChunkMeta()
            index = meta.index or 0
            call = self._calls.get(index)
            if call is None:
                call = self._calls[index] = _Call(len(self.items), meta.name or "")
                events += self._start(call)
            elif call is not self._open:
                raise StageFailedError(
                    out.stage_id, self.stage_name, f"tool call {index} went on after it ended"
                )
            if out.text:
                events.append(call.piece(out.text))
        if out.finished:
            self.finish_reason = out.finish_reason or FinishReason.STOP
        return events

    def finish(self) -> list[dict[str, Any]]:
        """Events that end the output; an answer with no item gets an empty message."""
        events = [] if self.items else self._start(_Message(0))
        status = "incomplete" if self.finish_reason == FinishReason.LENGTH else "completed"
        return events + self._end(status)

    def abandon(self) -> None:
        """The request failed: the open item stays unfinished (no events)."""
        if self._open is not None:
            self._open.status = "incomplete"
            self._open = None

    def _start(self, item: _Message | _Call) -> list[dict[str, Any]]:
        events = self._end("completed")
        self.items.append(item)
        self._open = item
        return events + item.started()

    def _end(self, status: str) -> list[dict[str, Any]]:
        item, self._open = self._open, None
        if item is None:
            return []
        item.status = status
        return item.ended()


async def _events(
    outputs: AsyncIterator[OutputChunk],
    stream: OutputStream,
    shape: _ResponseShape,
    output: _Output,
) -> AsyncIterator[bytes]:
    """The SSE body: response.created, .in_progress, the output's events, then
    response.completed (or .incomplete), or response.failed if the request fails."""
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
            exc = _in_our_terms(exc)
        output.abandon()
        yield sse({"type": "response.failed", "response": shape.failed(output, exc)})
        return
    finally:
        stream.close()
    final = shape.final(output, stream.usage())
    yield sse({"type": f"response.{final['status']}", "response": final})


@dataclass(frozen=True)
class _ResponseShape:
    """The fields of one response that never change: its id, and the request's
    settings a response repeats."""

    id: str
    created_at: int
    model: str
    settings: dict[str, Any]

    @classmethod
    def of(cls, body: ResponsesRequest, response_id: str, model: str) -> _ResponseShape:
        fmt = body.text_format()
        settings = {
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "metadata": body.metadata or {},
            "parallel_tool_calls": body.parallel_tool_calls,
            "previous_response_id": None,
            "store": False,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True)},
            "tool_choice": body.tool_choice_setting(),
            "tools": [t.model_dump() for t in body.tools or []],
            "truncation": "disabled",
        }
        return cls(response_id, int(time.time()), model, settings)

    def body(
        self,
        status: str,
        output: _Output | None = None,
        usage: dict[str, Any] | None = None,
        **extra: Any,
    ) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": None,
            "incomplete_details": None,
            "model": self.model,
            "output": [item.item() for item in output.items] if output else [],
            "usage": usage,
            **self.settings,
            **extra,
        }

    def final(self, output: _Output, usage: dict[str, int]) -> dict[str, Any]:
        tokens = {
            "input_tokens": usage.get("prompt_tokens", 0),
            "input_tokens_details": {
                "cached_tokens": usage.get("cached_tokens", 0),
                "cache_write_tokens": 0,
            },
            "output_tokens": usage.get("completion_tokens", 0),
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage.get("total_tokens", 0),
        }
        if output.finish_reason == FinishReason.LENGTH:
            reason = {"reason": "max_output_tokens"}
            return self.body("incomplete", output, tokens, incomplete_details=reason)
        return self.body("completed", output, tokens, completed_at=int(time.time()))

    def failed(self, output: _Output, exc: Exception) -> dict[str, Any]:
        e = as_api_error(exc)
        error = {"code": _FAILURE_CODES.get(e.status, "server_error"), "message": e.message}
        return self.body("failed", output, error=error)
