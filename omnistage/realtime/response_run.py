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
import enum
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from omnistage.audio.formats import OutputStream as AudioOut
from omnistage.protocol.chunk_meta import AudioMeta, ToolCallMeta
from omnistage.protocol.enums import FinishReason, Modality
from omnistage.protocol.errors import BadRequestError
from omnistage.protocol.front import PipelineRequest
from omnistage.protocol.messages import OutputChunk, Prompt, Usage
from omnistage.realtime import events as ev
from omnistage.realtime.conversation import (
    Item,
    ItemStatus,
    Spoken,
    function_call_item,
    message_item,
    new_id,
)
from omnistage.realtime.output_hold import AudioHold
from omnistage.realtime.replies import ResponseSettings
from omnistage.service import OutputStream, PipelineService

_AUDIO, _TEXT, _TOOL_CALL = Modality.AUDIO, Modality.TEXT, Modality.TOOL_CALL
DEFAULT_TTS_RATE = 22050

Emit = Callable[[ev.ServerEvent], None]


class ResponseStatus(enum.StrEnum):
    IN_PROGRESS = "in_progress"
    COMPLETED = "completed"
    INCOMPLETE = "incomplete"
    CANCELLED = "cancelled"
    FAILED = "failed"


class StopReason(enum.StrEnum):
    """Why a response ended early (``status_details.reason``)."""

    TURN_DETECTED = "turn_detected"  # the user spoke (barge-in, or went on after a pause)
    CLIENT_CANCELLED = "client_cancelled"
    MAX_OUTPUT_TOKENS = "max_output_tokens"


@dataclass
class _Call:
    item: Item
    output_index: int
    arguments: list[str] = field(default_factory=list)


class _Calls:
    """An answer's function calls, each an output item whose arguments stream in."""

    def __init__(self, response_id: str, emit: Emit, add_output: Callable[[Item], int]) -> None:
        self._response_id = response_id
        self._emit = emit
        self._add_output = add_output
        self._calls: dict[int, _Call] = {}

    def delta(self, index: int, name: str, text: str) -> None:
        """More of call ``index``'s arguments (its first piece opens its item)."""
        call = self._calls.get(index)
        if call is None:
            item = function_call_item(name)
            call = self._calls[index] = _Call(item, self._add_output(item))
        call.arguments.append(text)
        self._emit(
            ev.CallArgumentsDelta(
                response_id=self._response_id,
                item_id=call.item.id,
                output_index=call.output_index,
                call_id=call.item.json["call_id"],
                delta=text,
            )
        )

    def close(self, item_status: ItemStatus) -> list[tuple[int, dict[str, Any]]]:
        """Each call's arguments are all there: its done event; the items, to close."""
        closed = []
        for call in self._calls.values():
            js = call.item.json
            js["arguments"] = "".join(call.arguments)
            js["status"] = item_status
            self._emit(
                ev.CallArgumentsDone(
                    response_id=self._response_id,
                    item_id=call.item.id,
                    output_index=call.output_index,
                    call_id=js["call_id"],
                    name=js["name"],
                    arguments=js["arguments"],
                )
            )
            closed.append((call.output_index, js))
        return closed


class ResponseRun:
    """One response from ``response.created`` to ``response.done``."""

    def __init__(
        self,
        service: PipelineService,
        stages: tuple[int, int | None],
        settings: ResponseSettings,
        prompt: Callable[[], Prompt],
        emit: Emit,
        on_item: Callable[[Item], None] | None = None,
        affinity: str = "",
        rate_limits: Callable[[], list[dict[str, Any]]] | None = None,
        speakers: tuple[int, ...] = (),
    ) -> None:
        self.id = new_id("resp")
        self.settings = settings
        self._service = service
        self._thinker, talker = stages
        self._audio = _AUDIO in settings.modalities and talker is not None
        self._talker = talker if self._audio else None
        self._prompt = prompt  # built when the answer starts: its turns are heard by then
        self._speakers = speakers
        self._emit = emit
        self._on_item = on_item  # the session adds output items to its conversation
        self._affinity = affinity
        self._rate_limits = rate_limits  # rate_limits.updated after each response.done
        self._stream: OutputStream | None = None
        self.status = ResponseStatus.IN_PROGRESS
        self._details: dict[str, Any] | None = None
        self._outputs: list[Item] = []
        self.message: Item | None = None  # the answer's message item, once it has words
        self._made: list[Spoken] = []  # every sentence of its audio, sent or held
        self._words: list[str] = []
        self._encoder: AudioOut | None = None
        self._calls = _Calls(self.id, emit, self._add_output)
        self._usage = Usage()
        self.first_audio_at: float | None = None  # monotonic time of the first audio delta
        self.on_first_audio: Callable[[float], None] | None = None
        self.hold = AudioHold(emit)  # the user may be interrupting: audio waits there

    @property
    def done(self) -> bool:
        return self.status != ResponseStatus.IN_PROGRESS

    @property
    def audio_sent_ms(self) -> float:
        return self.hold.sent_ms

    def created(self) -> None:
        self._emit(ev.ResponseCreated(response=response_json(self)))

    async def run(self, before: Awaitable[None] | None = None) -> None:
        """Run the response to its end: completed, incomplete, failed or cancelled.
        ``before``: what must finish first (the transcripts of the turns it answers)."""
        if before is not None:
            try:
                await before
            except asyncio.CancelledError:
                self.cancel(StopReason.CLIENT_CANCELLED)
                raise
            except Exception as exc:  # the turn could not be heard: nothing to answer
                self._fail("server_error", "transcription_failed", str(exc))
                return
        if self.done:  # cancelled while it waited
            return
        finals = [self._thinker] + ([self._talker] if self._talker is not None else [])
        request = PipelineRequest(
            f"realtime-{self.id}",
            self._prompt(),
            finals,
            stage_params=self.settings.params(self._thinker, self._talker, self._speakers),
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
            self.cancel(StopReason.CLIENT_CANCELLED)
            raise
        except BadRequestError as exc:
            self._fail("invalid_request_error", exc.code or "invalid_value", str(exc))
        except Exception as exc:  # a stage failed for good: the response fails, not the session
            self._fail("server_error", "stage_failed", str(exc) or type(exc).__name__)
        finally:
            if self._stream is not None:
                self._stream.close()
        await self.hold.released()  # done events after the audio held, or a cancel
        if not self.done:
            if reason == FinishReason.LENGTH:
                self._stop(ResponseStatus.INCOMPLETE, StopReason.MAX_OUTPUT_TOKENS)
            else:
                self._finish(ResponseStatus.COMPLETED, None)

    def cancel(self, reason: StopReason) -> None:
        """Stop at once: nothing more of this response is emitted after its done events."""
        if self.done:
            return
        if self._stream is not None:
            self._stream.close()
        if self.hold.holding:  # the user heard it up to where it paused, not further
            self.hold.drop()
            if self.message is not None:
                self.message.truncate(int(self.hold.sent_ms), cut=True)
        self._stop(ResponseStatus.CANCELLED, reason)

    # ----------------------------------------------------------------------------------

    def _output(self, out: OutputChunk) -> FinishReason | None:
        if out.modality == _TOOL_CALL and isinstance(out.meta, ToolCallMeta):
            self._calls.delta(out.meta.index, out.meta.name, out.text)
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
            parts = [{"type": kind, key: ""}]
            self.message = message_item("assistant", parts, ItemStatus.IN_PROGRESS)
            self._add_output(self.message)
            part = {"type": "audio" if self._audio else "text", key: ""}
            self._part_event(ev.ContentPartAdded, part=part)
        return self.message

    def _add_output(self, item: Item) -> int:
        self._outputs.append(item)
        index = len(self._outputs) - 1
        self._emit(ev.OutputItemAdded(response_id=self.id, output_index=index, item=item.json))
        if self.settings.in_conversation and self._on_item is not None:
            self._on_item(item)
        return index

    def _part_event(self, kind: type[ev.PartEvent], **fields: Any) -> None:
        """An event of the answer message's content part (``kind``: which)."""
        item = self._open_message()
        index = self._outputs.index(item)
        self._emit(kind(response_id=self.id, item_id=item.id, output_index=index, **fields))

    def _word(self, text: str) -> None:
        self._open_message()
        self._words.append(text)
        self._part_event(ev.TranscriptDelta if self._audio else ev.OutputTextDelta, delta=text)

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
        spoken = Spoken(out.text.strip(), ms)
        item.spoken.append(spoken)
        self._made.append(spoken)
        if self.first_audio_at is None:
            self.first_audio_at = time.monotonic()
            if self.on_first_audio is not None:
                self.on_first_audio(self.first_audio_at)
        self.hold.audio(self._delta(data), ms, data)

    def _delta(self, data: bytes) -> ev.OutputAudioDelta:
        item = self._open_message()
        index = self._outputs.index(item)
        delta = base64.b64encode(data).decode()
        return ev.OutputAudioDelta(
            response_id=self.id, item_id=item.id, output_index=index, delta=delta
        )

    def truncated(self, end_ms: int) -> None:
        """A client truncated this answer, still being made, at ``end_ms``, dropping the
        audio it had past that: if the answer goes on (a backchannel resumes it), it goes
        on from the cut (``AudioHold.rewind``); a cancel keeps it where the client cut it."""
        if not self.done and self.message is not None:
            fmt = self.settings.output_format
            self.hold.rewind(int(end_ms * fmt.rate / 1000) * fmt.bytes_per_sample, self._delta)
            self.message.regrow(self._made)

    def _fail(self, kind: str, code: str, message: str) -> None:
        error = {"type": kind, "code": code, "message": message}
        self._finish(ResponseStatus.FAILED, {"type": ResponseStatus.FAILED, "error": error})

    def _stop(self, status: ResponseStatus, reason: StopReason) -> None:
        self._finish(status, {"type": status, "reason": reason})

    def _finish(self, status: ResponseStatus, details: dict[str, Any] | None) -> None:
        """Close every open part and item, then ``response.done``."""
        self.hold.release()  # a failure: the audio made so far goes out before its end
        self.status = status
        self._details = details
        completed = status == ResponseStatus.COMPLETED
        item_status = ItemStatus.COMPLETED if completed else ItemStatus.INCOMPLETE
        if self.message is not None:
            self._close_message(item_status)
        for index, js in self._calls.close(item_status):
            self._item_done(index, js)
        self._emit(ev.ResponseDone(response=response_json(self)))
        if self._rate_limits is not None:
            self._emit(ev.RateLimitsUpdated(rate_limits=self._rate_limits()))

    def _close_message(self, item_status: ItemStatus) -> None:
        item = self.message
        assert item is not None
        part = item.json["content"][0]
        if self._audio:
            # An answer that ran to its end or out of tokens was said whole; one cut
            # short (cancelled, failed) only as far as its sentences went out.
            out_of_tokens = (self._details or {}).get("reason") == StopReason.MAX_OUTPUT_TOKENS
            whole = item_status == ItemStatus.COMPLETED or out_of_tokens
            if self._encoder is not None:
                tail = self._encoder.flush()
                if tail and whole:
                    delta = base64.b64encode(tail).decode()
                    self._part_event(ev.OutputAudioDelta, delta=delta)
            said = " ".join(s.text for s in item.spoken if s.text)
            part["transcript"] = "".join(self._words) if whole else said
            self._part_event(ev.OutputAudioDone)
            self._part_event(ev.TranscriptDone, transcript=part["transcript"])
            done_part = {"type": "audio", "transcript": part["transcript"]}
        else:
            part["text"] = "".join(self._words)
            self._part_event(ev.OutputTextDone, text=part["text"])
            done_part = {"type": "text", "text": part["text"]}
        self._part_event(ev.ContentPartDone, part=done_part)
        item.json["status"] = item_status
        self._item_done(self._outputs.index(item), item.json)

    def _item_done(self, index: int, item: dict[str, Any]) -> None:
        self._emit(ev.OutputItemDone(response_id=self.id, output_index=index, item=item))
        if self.settings.in_conversation:
            self._emit(ev.ItemDone(previous_item_id=None, item=item))


def response_json(run: ResponseRun) -> dict[str, Any]:
    """A response as its events carry it"""
    s = run.settings
    out: dict[str, Any] = {
        "id": run.id,
        "object": "realtime.response",
        "status": run.status,
        "status_details": run._details,
        "output": [item.json for item in run._outputs],
        "conversation_id": "auto" if s.in_conversation else None,
        "output_modalities": list(s.modalities),
        "max_output_tokens": s.max_output_tokens or "inf",
        "audio": {"output": {"format": s.output_format.to_json(), "voice": s.voice}},
        "usage": usage_json(run._usage) if run.done else None,
        "metadata": s.metadata,
    }
    return out


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
