"""One Realtime session: client events in, server events out, over the pipeline.

The session owns the conversation, the input audio buffer (24 kHz pcm16, whatever the
client's format) and its server VAD. A user turn is listened to while it is spoken
(``listening.TurnListener``), committed when the VAD hears it end (or on
``input_audio_buffer.commit``), and answered by a ``response.ResponseRun`` once its
transcript is in. Speech while an answer plays cancels the answer (barge-in): the
answer's item keeps only what was sent, and the new turn is answered.

Every client error is an ``error`` event naming the field; the session goes on. The
route (``api.routes.realtime``) owns the socket: it feeds ``handle`` one frame at a time
and sends what ``send`` is given.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from omnistage.api.service import PipelineService
from omnistage.protocol.errors import BadRequestError
from omnistage.protocol.params import TranscriptionParams
from omnistage.realtime import events as ev
from omnistage.realtime.audio_formats import InputStream
from omnistage.realtime.config import (
    TRANSCRIPTION,
    SessionConfig,
    bad,
)
from omnistage.realtime.conversation import (
    Conversation,
    Item,
    chat_messages,
    check_item,
    message_item,
    new_id,
)
from omnistage.realtime.listening import RATE, TurnListener
from omnistage.realtime.replies import reply_settings
from omnistage.realtime.response import ResponseRun
from omnistage.realtime.turns import ServerVadParams, SpeechStarted
from omnistage.realtime.vad import VadStream

BYTES_PER_MS = RATE * 2 // 1000
# Push-to-talk audio held before a commit (OpenAI's buffer holds about this much).
MAX_BUFFER_MS = 15 * 60 * 1000
MIN_COMMIT_MS = 100  # OpenAI refuses to commit less
SESSION_TTL_S = 60 * 60


class Stats(Protocol):
    def turn(self) -> None: ...
    def barge_in(self) -> None: ...
    def first_audio(self, seconds: float) -> None: ...


class _NoStats:
    def turn(self) -> None: ...
    def barge_in(self) -> None: ...
    def first_audio(self, seconds: float) -> None: ...


@dataclass
class SessionContext:
    """What a session runs on: the pipeline and which stage does what."""

    service: PipelineService
    thinker: int
    talker: int | None
    listener: int | None
    stats: Stats = field(default_factory=_NoStats)
    vad: Callable[[ServerVadParams], VadStream] = lambda p: VadStream(p, RATE)


@dataclass
class _Turn:
    """A user turn being spoken: its item id, listener, and where it starts."""

    item_id: str
    listener: TurnListener | None
    start_ms: float


class RealtimeSession:
    def __init__(
        self,
        ctx: SessionContext,
        config: SessionConfig,
        send: Callable[[dict[str, Any]], None],
    ) -> None:
        self.id = new_id("sess")
        self.ctx = ctx
        self.config = config
        self._send = send
        self._ids = ev.EventIds()
        self.conversation = Conversation()
        self.response: ResponseRun | None = None  # the conversation's answer under way
        self._runs: dict[str, ResponseRun] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._transcribing: list[asyncio.Task[str]] = []
        self._input = InputStream(config.input_format, RATE)
        self._vad = self._new_vad()
        self._buffer = bytearray()  # input audio since _buffer_ms, 24 kHz pcm16
        self._buffer_ms = 0.0  # session audio time of _buffer[0]
        self._turn: _Turn | None = None
        self._created = time.time()

    # --------------------------------------------------------------------- plumbing

    def emit(self, kind: str, fields: dict[str, Any] | None = None) -> None:
        self._send(self._ids.event(kind, **(fields or {})))

    def error(self, exc: BadRequestError, event_id: str | None = None) -> None:
        self.emit("error", {"error": ev.error_fields(exc, event_id)})

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def opened(self) -> None:
        self.emit("session.created", {"session": self._session_json()})

    def _session_json(self) -> dict[str, Any]:
        return self.config.to_json(self.id, int(self._created) + SESSION_TTL_S)

    async def close(self) -> None:
        """The client is gone: stop every answer and free every request of the session."""
        for run in list(self._runs.values()):
            run.cancel("client_cancelled")
        if self._turn is not None and self._turn.listener is not None:
            self._turn.listener.close()
        self._turn = None
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        self._buffer.clear()

    # --------------------------------------------------------------------- events in

    async def handle(self, frame: str | bytes) -> None:
        """One client frame: its event applied, or an ``error`` event."""
        event: Any = None
        try:
            event = ev.decode_client_event(frame)
            self._dispatch(event)
        except BadRequestError as exc:
            self.error(exc, event.event_id if event is not None else None)

    def _dispatch(self, event: ev.AnyClientEvent) -> None:
        match event:
            case ev.AudioAppend():
                self._append(event.audio)
            case ev.SessionUpdate():
                self._update(event.session)
            case ev.AudioCommit():
                self._commit_manual()
            case ev.AudioClear():
                self._clear()
            case ev.ItemCreate():
                self._create_item(event.item, event.previous_item_id)
            case ev.ItemDelete():
                self.conversation.delete(event.item_id)
                self.emit("conversation.item.deleted", {"item_id": event.item_id})
            case ev.ItemRetrieve():
                item = self.conversation.get(event.item_id)
                self.emit("conversation.item.retrieved", {"item": item.json})
            case ev.ItemTruncate():
                self._truncate(event)
            case ev.ResponseCreate():
                self._create_response(event.response or {})
            case ev.ResponseCancel():
                self._cancel(event.response_id)
            case ev.OutputAudioClear():
                raise bad("type", "output_audio_buffer.clear is for WebRTC sessions only")

    def _update(self, patch: dict[str, Any]) -> None:
        before = (self.config.input_format, self.config.turn_detection)
        self.config.update(patch)
        if self.config.input_format != before[0]:
            self._input = InputStream(self.config.input_format, RATE)
        if self.config.turn_detection != before[1]:
            self._drop_turn()
            self._vad = self._new_vad()
        self.emit("session.updated", {"session": self._session_json()})

    def _new_vad(self) -> VadStream | None:
        td = self.config.turn_detection
        return self.ctx.vad(td.vad) if td is not None else None

    # --------------------------------------------------------------------- audio in

    def _append(self, audio: str) -> None:
        try:
            raw = base64.b64decode(audio, validate=True)
        except (binascii.Error, ValueError):
            raise bad("audio", "expected base64-encoded audio") from None
        pcm = self._input.push(raw).astype("<i2").tobytes()
        if self._vad is None and len(self._buffer) + len(pcm) > MAX_BUFFER_MS * BYTES_PER_MS:
            raise bad(
                "audio",
                f"the input audio buffer is full ({MAX_BUFFER_MS // 60000} min): "
                "commit or clear it",
                "input_audio_buffer_full",
            )
        self._buffer += pcm
        if self._vad is None:
            if self._turn is None:  # push-to-talk: the turn starts with its first audio
                self._turn = self._start_turn(self._buffer_ms)
            self._feed_turn(pcm)
            return
        self._feed_turn(pcm)
        for vad_event in self._vad.feed(pcm):
            if isinstance(vad_event, SpeechStarted):
                self._speech_started(vad_event.audio_start_ms)
            else:
                self._speech_stopped(vad_event.audio_end_ms)
        if self._turn is None:
            self._trim()

    def _feed_turn(self, pcm: bytes) -> None:
        if self._turn is not None and self._turn.listener is not None:
            self._turn.listener.feed(pcm)

    def _trim(self) -> None:
        """Between turns keep only what a turn's prefix padding may reach back to."""
        td = self.config.turn_detection
        keep_ms = (td.vad.prefix_padding_ms if td else 0) + 500
        excess = len(self._buffer) - int(keep_ms * BYTES_PER_MS)
        if excess > 0:
            excess -= excess % 2
            del self._buffer[:excess]
            self._buffer_ms += excess / BYTES_PER_MS

    def _slice(self, start_ms: float, end_ms: float | None = None) -> bytes:
        a = max(0, int((start_ms - self._buffer_ms) * BYTES_PER_MS)) & ~1
        if end_ms is None:
            return bytes(self._buffer[a:])
        b = max(a, int((end_ms - self._buffer_ms) * BYTES_PER_MS)) & ~1
        return bytes(self._buffer[a:b])

    def _start_turn(self, start_ms: float) -> _Turn:
        listener = None
        if self.ctx.listener is not None:
            item_id = new_id("item")
            listener = TurnListener(
                self.ctx.service,
                self.ctx.listener,
                self._transcription_params(),
                on_delta=lambda text: self._transcript_delta(item_id, text),
            )
            return _Turn(item_id, listener, start_ms)
        return _Turn(new_id("item"), None, start_ms)

    def _transcription_params(self) -> TranscriptionParams:
        t = self.config.transcription or {}
        return TranscriptionParams(language=t.get("language"), prompt=t.get("prompt"))

    def _speech_started(self, start_ms: int) -> None:
        td = self.config.turn_detection
        run = self.response
        if td is not None and td.interrupt_response and run is not None and not run.done:
            run.cancel("turn_detected")  # first: no audio after the event
            self.ctx.stats.barge_in()
        self._drop_turn()
        self._turn = self._start_turn(start_ms)
        if self._turn.listener is not None:
            self._turn.listener.feed(self._slice(start_ms))
        self.emit(
            "input_audio_buffer.speech_started",
            {"audio_start_ms": start_ms, "item_id": self._turn.item_id},
        )

    def _speech_stopped(self, end_ms: int) -> None:
        turn = self._turn
        if turn is None:
            return
        self.emit(
            "input_audio_buffer.speech_stopped", {"audio_end_ms": end_ms, "item_id": turn.item_id}
        )
        # The user stopped talking when the silence began, silence_duration_ms ago.
        td = self.config.turn_detection
        wait_s = td.vad.silence_duration_ms / 1000 if td else 0.0
        self._commit(turn, end_ms, time.monotonic() - wait_s, auto=True)

    def _commit_manual(self) -> None:
        turn = self._turn
        end_ms = self._buffer_ms + len(self._buffer) / BYTES_PER_MS
        start_ms = turn.start_ms if turn is not None else self._buffer_ms
        if end_ms - start_ms < MIN_COMMIT_MS:
            raise bad(
                "",
                f"buffer too small: at least {MIN_COMMIT_MS} ms of audio is needed, "
                f"the buffer holds {max(0.0, end_ms - start_ms):.0f} ms",
                "input_audio_buffer_commit_empty",
            )
        if turn is None:
            turn = self._start_turn(start_ms)
            if turn.listener is not None:
                turn.listener.feed(self._slice(start_ms))
        if self._vad is not None:
            self._vad.reset()
        self._commit(turn, end_ms, time.monotonic(), auto=False)

    def _clear(self) -> None:
        self._drop_turn()
        self._buffer_ms += len(self._buffer) / BYTES_PER_MS
        self._buffer.clear()
        if self._vad is not None:
            self._vad.reset()
        self.emit("input_audio_buffer.cleared")

    def _drop_turn(self) -> None:
        if self._turn is not None and self._turn.listener is not None:
            self._turn.listener.close()
        self._turn = None

    # --------------------------------------------------------------------- turns

    def _commit(self, turn: _Turn, end_ms: float, spoken_end: float, auto: bool) -> None:
        """Make the turn's audio a user item; transcribe it; answer it if asked to."""
        self._turn = None
        cut = max(0, int((end_ms - self._buffer_ms) * BYTES_PER_MS)) & ~1
        del self._buffer[:cut]
        self._buffer_ms = max(self._buffer_ms, end_ms)
        item = message_item("user", [{"type": "input_audio", "transcript": None}])
        item.json["id"] = turn.item_id
        previous = self.conversation.add(item)
        self.emit(
            "input_audio_buffer.committed", {"previous_item_id": previous, "item_id": item.id}
        )
        self.emit("conversation.item.added", {"previous_item_id": previous, "item": item.json})
        self.ctx.stats.turn()
        task = self._spawn(self._transcribe(turn, item))
        self._transcribing.append(task)
        task.add_done_callback(self._transcribing.remove)
        td = self.config.turn_detection
        idle = self.response is None or self.response.done
        answers = td is not None and td.create_response and self.config.kind != TRANSCRIPTION
        if auto and answers and idle:
            self._start(reply_settings(self.config, {}), spoken_end)

    async def _transcribe(self, turn: _Turn, item: Item) -> str:
        part = item.json["content"][0]
        listener = turn.listener
        if listener is None:
            return ""
        try:
            transcript = await listener.finish()
        except Exception as exc:
            self._transcription_failed(item, exc)
            return ""
        part["transcript"] = transcript
        if self.config.transcription is not None or self.config.kind == TRANSCRIPTION:
            self.emit(
                "conversation.item.input_audio_transcription.completed",
                {
                    "item_id": item.id,
                    "content_index": 0,
                    "transcript": transcript,
                    "usage": {"type": "duration", "seconds": 0},
                },
            )
        self.emit("conversation.item.done", {"previous_item_id": None, "item": item.json})
        return transcript

    def _transcript_delta(self, item_id: str, text: str) -> None:
        if self.config.transcription is not None or self.config.kind == TRANSCRIPTION:
            self.emit(
                "conversation.item.input_audio_transcription.delta",
                {"item_id": item_id, "content_index": 0, "delta": text},
            )

    def _transcription_failed(self, item: Item, exc: Exception) -> None:
        self.emit(
            "conversation.item.input_audio_transcription.failed",
            {
                "item_id": item.id,
                "content_index": 0,
                "error": {
                    "type": "transcription_error",
                    "code": getattr(exc, "code", None) or "transcription_failed",
                    "message": str(exc) or type(exc).__name__,
                    "param": None,
                },
            },
        )
        self.emit("conversation.item.done", {"previous_item_id": None, "item": item.json})

    # --------------------------------------------------------------------- items

    def _create_item(self, value: Any, previous_item_id: str | None) -> None:
        item = check_item(value)
        previous = self.conversation.add(item, previous_item_id)
        fields = {"previous_item_id": previous, "item": item.json}
        self.emit("conversation.item.added", fields)
        self.emit("conversation.item.done", fields)

    def _truncate(self, event: ev.ItemTruncate) -> None:
        item = self.conversation.get(event.item_id)
        content = item.json.get("content") or [{}]
        if item.json.get("role") != "assistant" or content[0].get("type") != "output_audio":
            raise bad("item_id", "only an assistant message with audio can be truncated")
        if event.content_index != 0:
            raise bad("content_index", "an answer has one content part: use 0")
        if event.audio_end_ms < 0:
            raise bad("audio_end_ms", "must not be negative")
        item.truncate(event.audio_end_ms)
        self.emit(
            "conversation.item.truncated",
            {"item_id": item.id, "content_index": 0, "audio_end_ms": event.audio_end_ms},
        )

    # --------------------------------------------------------------------- responses

    def _create_response(self, params: dict[str, Any]) -> None:
        if self.config.kind == TRANSCRIPTION:
            raise bad("type", "a transcription session does not create responses")
        settings, inputs = reply_settings(self.config, params), params.get("input")
        if settings.in_conversation and self.response is not None and not self.response.done:
            raise bad(
                "",
                f"Conversation already has an active response in progress: {self.response.id}",
                "conversation_already_has_active_response",
            )
        items = None
        if inputs is not None:
            items = self._input_items(inputs)
        instructions = params.get("instructions")
        self._start(settings, None, items, instructions)

    def _input_items(self, inputs: Any) -> list[Item]:
        if not isinstance(inputs, list):
            raise bad("response.input", "expected a list of items")
        out = []
        for i, value in enumerate(inputs):
            if isinstance(value, dict) and value.get("type") == "item_reference":
                out.append(self.conversation.get(str(value.get("id")), f"response.input[{i}].id"))
            else:
                out.append(check_item(value, f"response.input[{i}]"))
        return out

    def _start(
        self,
        settings: Any,
        spoken_end: float | None,
        items: list[Item] | None = None,
        instructions: Any = None,
    ) -> None:
        text = instructions if isinstance(instructions, str) else self.config.instructions

        def messages() -> list[Any]:
            return chat_messages(text, items if items is not None else list(self.conversation))

        run = ResponseRun(
            self.ctx.service,
            (self.ctx.thinker, self.ctx.talker),
            settings,
            messages,
            self.emit,
            on_item=self._answer_item,
            affinity=self.id,
        )
        if settings.in_conversation:
            self.response = run
        self._runs[run.id] = run
        run.created()
        self._spawn(self._run(run, spoken_end))

    async def _run(self, run: ResponseRun, spoken_end: float | None) -> None:
        try:
            await run.run(list(self._transcribing))
        finally:
            self._runs.pop(run.id, None)
        if spoken_end is not None and run.first_audio_at is not None:
            self.ctx.stats.first_audio(run.first_audio_at - spoken_end)

    def _answer_item(self, item: Item) -> None:
        previous = self.conversation.add(item)
        self.emit("conversation.item.added", {"previous_item_id": previous, "item": item.json})

    def _cancel(self, response_id: str | None) -> None:
        run = self._runs.get(response_id) if response_id else self.response
        if run is None or run.done:
            raise bad(
                "response_id" if response_id else "",
                "Cancellation failed: no active response found",
                "response_cancel_not_active",
            )
        run.cancel("client_cancelled")
