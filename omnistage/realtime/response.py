"""One Realtime response: a pipeline request for the answer, its outputs as events.

The thinker's words stream as the transcript (or text) deltas; the talker's sentences
stream as audio deltas in the session's output format, and each sentence is kept with
its length so the answer can be truncated to what was sent (barge-in) or heard
(``conversation.item.truncate``). Tool calls become ``function_call`` items.

``cancel`` is synchronous: from the moment it returns no further delta of this response
is emitted (the barge-in promise), and closing the pipeline stream aborts the thinker
and talker where they are.
"""

from __future__ import annotations

import asyncio
import base64
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from omnistage.audio.formats import AudioFormat
from omnistage.audio.formats import OutputStream as AudioOut
from omnistage.protocol.chunk_meta import AudioMeta, ToolCallMeta
from omnistage.protocol.enums import FinishReason, Modality
from omnistage.protocol.errors import BadRequestError
from omnistage.protocol.front import PipelineRequest
from omnistage.protocol.messages import ChatMessage, OutputChunk, Prompt, Usage
from omnistage.protocol.params import GenerationParams, SpeechParams, StageParams
from omnistage.realtime.conversation import (
    Item,
    Spoken,
    function_call_item,
    message_item,
    new_id,
)
from omnistage.service import OutputStream, PipelineService

_AUDIO, _TEXT, _TOOL_CALL = Modality.AUDIO, Modality.TEXT, Modality.TOOL_CALL
DEFAULT_TTS_RATE = 22050

Emit = Callable[[str, dict[str, Any]], None]


@dataclass
class ResponseSettings:
    """What one response is asked for: the session's settings over ``response.create``'s."""

    modalities: tuple[str, ...]
    output_format: AudioFormat
    voice: str
    speed: float
    tools: list[dict[str, Any]]
    tool_choice: str | dict[str, Any]
    max_output_tokens: int | None
    temperature: float | None
    in_conversation: bool = True
    metadata: dict[str, Any] | None = None

    def params(self, thinker: int, talker: int | None) -> dict[int, StageParams]:
        gen: dict[str, Any] = {}
        if self.max_output_tokens is not None:
            gen["max_tokens"] = self.max_output_tokens
        if self.temperature is not None:
            gen["temperature"] = self.temperature
        if self.tools and self.tool_choice != "none":
            gen["tools"] = [_chat_tool(t) for t in self.tools]
            gen["tool_choice"] = _chat_tool_choice(self.tool_choice)
        out = {thinker: StageParams(text=GenerationParams(**gen))}
        if talker is not None:
            out[talker] = StageParams(speech=SpeechParams(self.voice, self.speed))
        return out


def _chat_tool(tool: dict[str, Any]) -> dict[str, Any]:
    fn = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
    return {"type": "function", "function": fn}


def _chat_tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(choice, str):
        return choice
    return {"type": "function", "function": {"name": choice["name"]}}


@dataclass
class _Call:
    item: Item
    output_index: int
    arguments: list[str] = field(default_factory=list)


class ResponseRun:
    """One response from ``response.created`` to ``response.done``."""

    def __init__(
        self,
        service: PipelineService,
        stages: tuple[int, int | None],
        settings: ResponseSettings,
        messages: Callable[[], list[ChatMessage]],
        emit: Emit,
        on_item: Callable[[Item], None] | None = None,
        affinity: str = "",
        rate_limits: Callable[[], list[dict[str, Any]]] | None = None,
    ) -> None:
        self.id = new_id("resp")
        self.settings = settings
        self._service = service
        self._thinker, talker = stages
        self._audio = "audio" in settings.modalities and talker is not None
        self._talker = talker if self._audio else None
        self._messages = messages
        self._emit = emit
        self._on_item = on_item  # the session adds output items to its conversation
        self._affinity = affinity
        self._rate_limits = rate_limits  # rate_limits.updated after each response.done
        self._stream: OutputStream | None = None
        self.status = "in_progress"
        self._details: dict[str, Any] | None = None
        self._outputs: list[Item] = []
        self.message: Item | None = None  # the answer's message item, once it has words
        self._words: list[str] = []
        self._encoder: AudioOut | None = None
        self._calls: dict[int, _Call] = {}
        self._usage = Usage()
        self.first_audio_at: float | None = None  # monotonic time of the first audio delta
        self.on_first_audio: Callable[[float], None] | None = None
        self.audio_sent_ms = 0.0

    @property
    def done(self) -> bool:
        return self.status != "in_progress"

    def event(self, kind: str, **fields: Any) -> None:
        self._emit(kind, {"response_id": self.id, **fields})

    def response_json(self) -> dict[str, Any]:
        s = self.settings
        out: dict[str, Any] = {
            "id": self.id,
            "object": "realtime.response",
            "status": self.status,
            "status_details": self._details,
            "output": [item.json for item in self._outputs],
            "conversation_id": "auto" if s.in_conversation else None,
            "output_modalities": list(s.modalities),
            "max_output_tokens": s.max_output_tokens or "inf",
            "audio": {"output": {"format": s.output_format.to_json(), "voice": s.voice}},
            "usage": usage_json(self._usage) if self.done else None,
            "metadata": s.metadata,
        }
        return out

    def created(self) -> None:
        self._emit("response.created", {"response": self.response_json()})

    async def run(self, before: Awaitable[None] | None = None) -> None:
        """Run the response to its end: completed, incomplete, failed or cancelled.
        ``before``: what must finish first (the transcripts of the turns it answers)."""
        if before is not None:
            try:
                await before
            except asyncio.CancelledError:
                self.cancel("client_cancelled")
                raise
            except Exception as exc:  # the turn could not be heard: nothing to answer
                self._fail("server_error", "transcription_failed", str(exc))
                return
        if self.done:  # cancelled while it waited
            return
        finals = [self._thinker] + ([self._talker] if self._talker is not None else [])
        request = PipelineRequest(
            f"realtime-{self.id}",
            Prompt(messages=self._messages()),
            finals,
            stage_params=self.settings.params(self._thinker, self._talker),
            affinity=self._affinity,
        )
        reason: FinishReason | None = None
        try:
            self._stream = await self._service.open(request)
            if self.done:  # cancelled while opening
                self._stream.close()
                return
            async for out in self._stream:
                if self.done:
                    break
                reason = self._output(out) or reason
            self._usage = self._stream.usage()
        except asyncio.CancelledError:
            self.cancel("client_cancelled")
            raise
        except BadRequestError as exc:
            self._fail("invalid_request_error", exc.code or "invalid_value", str(exc))
        except Exception as exc:  # a stage failed for good: the response fails, not the session
            self._fail("server_error", "stage_failed", str(exc) or type(exc).__name__)
        finally:
            if self._stream is not None:
                self._stream.close()
        if not self.done:
            if reason == FinishReason.LENGTH:
                self._finish("incomplete", {"type": "incomplete", "reason": "max_output_tokens"})
            else:
                self._finish("completed", None)

    def cancel(self, reason: str) -> None:
        """Stop at once: nothing more of this response is emitted after its done events."""
        if self.done:
            return
        if self._stream is not None:
            self._stream.close()
        self._finish("cancelled", {"type": "cancelled", "reason": reason})

    # ----------------------------------------------------------------------------------

    def _output(self, out: OutputChunk) -> FinishReason | None:
        if out.modality == _TOOL_CALL and isinstance(out.meta, ToolCallMeta):
            self._call_delta(out.meta.index, out.meta.name, out.text)
        elif out.stage_id == self._talker:
            self._spoken(out)
        elif out.text and out.modality == _TEXT:
            self._word(out.text)
        if out.stage_id == self._thinker and out.finished:
            return out.finish_reason
        return None

    def _open_message(self) -> Item:
        if self.message is None:
            kind = "output_audio" if self._audio else "output_text"
            key = "transcript" if self._audio else "text"
            self.message = message_item("assistant", [{"type": kind, key: ""}], "in_progress")
            self._add_output(self.message)
            part = {"type": "audio" if self._audio else "text", key: ""}
            self._part_event("response.content_part.added", part=part)
        return self.message

    def _add_output(self, item: Item) -> None:
        self._outputs.append(item)
        index = len(self._outputs) - 1
        self.event("response.output_item.added", output_index=index, item=item.json)
        if self.settings.in_conversation and self._on_item is not None:
            self._on_item(item)

    def _part_event(self, kind: str, **fields: Any) -> None:
        item = self._open_message()
        index = self._outputs.index(item)
        self.event(kind, item_id=item.id, output_index=index, content_index=0, **fields)

    def _word(self, text: str) -> None:
        self._open_message()
        self._words.append(text)
        kind = (
            "response.output_audio_transcript.delta"
            if self._audio
            else "response.output_text.delta"
        )
        self._part_event(kind, delta=text)

    def _spoken(self, out: OutputChunk) -> None:
        if not out.data:
            return
        rate = out.meta.sample_rate if isinstance(out.meta, AudioMeta) else DEFAULT_TTS_RATE
        if self._encoder is None:
            self._encoder = AudioOut(self.settings.output_format, rate)
        pcm = np.frombuffer(out.data, dtype="<i2")
        data = self._encoder.push(pcm)
        item = self._open_message()
        ms = len(pcm) * 1000 / rate
        item.spoken.append(Spoken(out.text.strip(), ms))
        self.audio_sent_ms += ms
        if self.first_audio_at is None:
            self.first_audio_at = time.monotonic()
            if self.on_first_audio is not None:
                self.on_first_audio(self.first_audio_at)
        self._part_event("response.output_audio.delta", delta=base64.b64encode(data).decode())

    def _call_delta(self, index: int, name: str, text: str) -> None:
        call = self._calls.get(index)
        if call is None:
            item = function_call_item(name)
            self._add_output(item)
            call = self._calls[index] = _Call(item, len(self._outputs) - 1)
        call.arguments.append(text)
        self.event(
            "response.function_call_arguments.delta",
            item_id=call.item.id,
            output_index=call.output_index,
            call_id=call.item.json["call_id"],
            delta=text,
        )

    def _fail(self, kind: str, code: str, message: str) -> None:
        self._finish(
            "failed", {"type": "failed", "error": {"type": kind, "code": code, "message": message}}
        )

    def _finish(self, status: str, details: dict[str, Any] | None) -> None:
        """Close every open part and item, then ``response.done``."""
        self.status = status
        self._details = details
        item_status = "completed" if status == "completed" else "incomplete"
        if self.message is not None:
            self._close_message(item_status)
        for call in self._calls.values():
            js = call.item.json
            js["arguments"] = "".join(call.arguments)
            js["status"] = item_status
            self.event(
                "response.function_call_arguments.done",
                item_id=call.item.id,
                output_index=call.output_index,
                call_id=js["call_id"],
                name=js["name"],
                arguments=js["arguments"],
            )
            self._item_done(call.output_index, js)
        self._emit("response.done", {"response": self.response_json()})
        if self._rate_limits is not None:
            self._emit("rate_limits.updated", {"rate_limits": self._rate_limits()})

    def _close_message(self, item_status: str) -> None:
        item = self.message
        assert item is not None
        part = item.json["content"][0]
        if self._audio:
            if self._encoder is not None:
                tail = self._encoder.flush()
                if tail and item_status == "completed":
                    delta = base64.b64encode(tail).decode()
                    self._part_event("response.output_audio.delta", delta=delta)
            # What was said: the spoken sentences (all of them unless cut short).
            said = " ".join(s.text for s in item.spoken if s.text)
            part["transcript"] = said if item_status != "completed" else "".join(self._words)
            self._part_event("response.output_audio.done")
            self._part_event("response.output_audio_transcript.done", transcript=part["transcript"])
            done_part = {"type": "audio", "transcript": part["transcript"]}
        else:
            part["text"] = "".join(self._words)
            self._part_event("response.output_text.done", text=part["text"])
            done_part = {"type": "text", "text": part["text"]}
        self._part_event("response.content_part.done", part=done_part)
        item.json["status"] = item_status
        self._item_done(self._outputs.index(item), item.json)

    def _item_done(self, index: int, item: dict[str, Any]) -> None:
        self.event("response.output_item.done", output_index=index, item=item)
        if self.settings.in_conversation:
            self._emit("conversation.item.done", {"previous_item_id": None, "item": item})


def usage_json(usage: Usage) -> dict[str, Any]:
    """A pipeline request's usage as ``response.done`` reports it."""
    prompt, completion = usage.prompt_tokens, usage.completion_tokens
    return {
        "total_tokens": usage.total_tokens,
        "input_tokens": prompt,
        "output_tokens": completion,
        "input_token_details": {
            "text_tokens": prompt,
            "audio_tokens": 0,
            "cached_tokens": usage.cached_tokens or 0,
        },
        "output_token_details": {"text_tokens": completion, "audio_tokens": 0},
    }
