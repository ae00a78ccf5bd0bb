"""The output of a Responses API request: the output items as the text stage's chunks
build them (with the stream events that tell of each step), and the response object
around them (``ResponseShape``). Pure shaping, shared by the route (streamed or not)
and the job runner (background responses)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from omnistage.api.ids import next_id
from omnistage.api.response_audio import Spoken
from omnistage.api.schemas.responses import ResponsesRequest
from omnistage.protocol.chunk_meta import ToolCallMeta
from omnistage.protocol.enums import FinishReason, Modality
from omnistage.protocol.errors import StageFailedError, as_api_error
from omnistage.protocol.messages import OutputChunk, Usage
from omnistage.store.records import ResponseStatus

# ResponseError.code by HTTP status, for a failure after the stream started.
_FAILURE_CODES = {400: "invalid_prompt", 429: "rate_limit_exceeded"}
# A TOOL_CALL chunk that does not say which call: the first, unnamed.
_NO_CALL = ToolCallMeta(0, "")


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
    """The answer's words, and (``spoken``) its audio."""

    index: int
    spoken: Spoken | None = None
    id: str = field(default_factory=lambda: f"msg_{next_id()}")
    text: list[str] = field(default_factory=list)
    status: ResponseStatus = ResponseStatus.IN_PROGRESS

    def part(self) -> dict[str, Any]:
        words = "".join(self.text)
        part = {"type": "output_text", "text": words, "annotations": [], "logprobs": []}
        if self.spoken is not None and self.spoken.data:
            part["audio"] = {"data": self.spoken.data, "format": self.spoken.plan.format}
        return part

    def item(self) -> dict[str, Any]:
        content = [self.part()] if self.status != ResponseStatus.IN_PROGRESS else []
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

    def sound(self, data: str) -> dict[str, Any]:
        """A streamed piece of the answer's audio (base64 pcm16)."""
        return {"type": "response.audio.delta", **self._where(), "delta": data}

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.id, "output_index": self.index, "content_index": 0}

    def _opening(self) -> list[dict[str, Any]]:
        return [{"type": "response.content_part.added", **self._where(), "part": self.part()}]

    def _closing(self) -> list[dict[str, Any]]:
        where, text = self._where(), "".join(self.text)
        events = [{"type": "response.output_text.done", **where, "text": text, "logprobs": []}]
        if self.spoken is not None:
            tail = self.spoken.finish()
            events += [self.sound(tail)] if tail else []
            events.append({"type": "response.audio.done", **where})
        done = {"type": "response.content_part.done", **where, "part": self.part()}
        return [*events, done]


@dataclass
class _Call(_Item):
    index: int
    name: str
    id: str = field(default_factory=lambda: f"fc_{next_id()}")
    call_id: str = field(default_factory=lambda: f"call_{next_id()}")
    arguments: list[str] = field(default_factory=list)
    status: ResponseStatus = ResponseStatus.IN_PROGRESS

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


class Output:
    """The output items as the text stage's chunks build them, and the stream events
    that tell of each step. As OpenAI streams them, one item is open at a time: it is
    added, filled and done before the next is added. The engine writes each call's
    arguments in one run (``meta.index`` never goes back to an ended call)."""

    def __init__(self, stage_name: str, spoken: Spoken | None = None) -> None:
        self.stage_name = stage_name
        self.spoken = spoken  # the answer's audio, where it is asked for
        self._message: _Message | None = None  # the one that speaks
        self.items: list[_Message | _Call] = []
        self.finish_reason = FinishReason.STOP
        self._open: _Message | _Call | None = None
        self._calls: dict[int, _Call] = {}  # by the engine's call index

    def add(self, out: OutputChunk) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if out.modality == Modality.AUDIO and self.spoken is not None:
            data = self.spoken.add(out)  # the audio stage's end is not the answer's
            if data and self._message is None:  # no words came first
                events += self._start(self._new_message())
            if data:
                assert self._message is not None
                events.append(self._message.sound(data))
            return events
        if out.modality == Modality.TEXT and out.text:
            if not isinstance(self._open, _Message):
                events += self._start(self._new_message())
            assert self._open is not None
            events.append(self._open.piece(out.text))
        elif out.modality == Modality.TOOL_CALL:
            meta = out.meta if isinstance(out.meta, ToolCallMeta) else _NO_CALL
            index = meta.index
            call = self._calls.get(index)
            if call is None:
                call = self._calls[index] = _Call(len(self.items), meta.name)
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
        events = [] if self.items else self._start(self._new_message())
        length = self.finish_reason == FinishReason.LENGTH
        status = ResponseStatus.INCOMPLETE if length else ResponseStatus.COMPLETED
        return events + self._end(status)

    def abandon(self) -> None:
        """The request failed: the open item stays unfinished (no events)."""
        if self._open is not None:
            self._open.status = ResponseStatus.INCOMPLETE
            self._open = None

    def _new_message(self) -> _Message:
        """A message; the first one speaks (an answer has one voice)."""
        message = _Message(len(self.items), self.spoken if self._message is None else None)
        if self._message is None:
            self._message = message
        return message

    def _start(self, item: _Message | _Call) -> list[dict[str, Any]]:
        events = self._end(ResponseStatus.COMPLETED)
        self.items.append(item)
        self._open = item
        return events + item.started()

    def _end(self, status: ResponseStatus) -> list[dict[str, Any]]:
        item, self._open = self._open, None
        if item is None:
            return []
        item.status = status
        return item.ended()


@dataclass(frozen=True)
class ResponseShape:
    """The fields of one response that never change: its id, and the request's
    settings a response repeats."""

    id: str
    created_at: int
    model: str
    settings: dict[str, Any]

    @classmethod
    def of(
        cls, body: ResponsesRequest, response_id: str, model: str, stored: bool = False
    ) -> ResponseShape:
        fmt = body.text_format()
        settings = {
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "metadata": body.metadata or {},
            "parallel_tool_calls": body.parallel_tool_calls,
            "previous_response_id": body.previous_response_id,
            "store": stored,
            "background": body.background,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True)},
            "tool_choice": body.tool_choice_setting(),
            "tools": [t.model_dump() for t in body.tools or []],
            "truncation": body.truncation,
        }
        return cls(response_id, int(time.time()), model, settings)

    def body(
        self,
        status: ResponseStatus,
        output: Output | None = None,
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

    def final(self, output: Output, usage: Usage) -> dict[str, Any]:
        tokens = {
            "input_tokens": usage.prompt_tokens,
            "input_tokens_details": {
                "cached_tokens": usage.cached_tokens or 0,
                "cache_write_tokens": 0,
            },
            "output_tokens": usage.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage.total_tokens,
        }
        if output.finish_reason == FinishReason.LENGTH:
            reason = {"reason": "max_output_tokens"}
            return self.body(ResponseStatus.INCOMPLETE, output, tokens, incomplete_details=reason)
        return self.body(ResponseStatus.COMPLETED, output, tokens, completed_at=int(time.time()))

    def failed(self, output: Output, exc: Exception) -> dict[str, Any]:
        e = as_api_error(exc)
        error = {"code": _FAILURE_CODES.get(e.status, "server_error"), "message": e.message}
        return self.body(ResponseStatus.FAILED, output, error=error)
