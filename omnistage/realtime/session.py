"""One Realtime session: client events in, server events out, over the pipeline.

The session owns the conversation and decides what the user's turns mean
(``audio_input.AudioInput`` hears them):
- speech while an answer is under way cancels it (barge-in); the answer's item keeps
  only what was sent;
- a pause starts an answer early (``gate``): the phrase so far is being transcribed and
  the thinker and talker start on it, with everything they say held back; if the VAD
  then ends the turn, it all goes out at once; if the user goes on, it is dropped;
- a committed turn becomes a user item, transcribed, and answered.

Every client error is an ``error`` event naming the field; the session goes on. The
route (``api.routes.realtime``) owns the socket: it feeds ``handle`` one frame at a time
and sends what ``send`` is given.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from omnistage.api.service import PipelineService
from omnistage.protocol.errors import BadRequestError
from omnistage.protocol.params import TranscriptionParams
from omnistage.realtime import events as ev
from omnistage.realtime.audio_input import MIN_COMMIT_MS, AudioInput
from omnistage.realtime.config import TRANSCRIPTION, SessionConfig, bad
from omnistage.realtime.conversation import (
    Conversation,
    Item,
    chat_messages,
    check_item,
    message_item,
    new_id,
)
from omnistage.realtime.gate import Gate
from omnistage.realtime.input_buffer import RATE
from omnistage.realtime.listening import TurnListener
from omnistage.realtime.replies import reply_settings
from omnistage.realtime.response import ResponseRun, ResponseSettings
from omnistage.realtime.turn import UserTurn
from omnistage.realtime.turns import ServerVadParams
from omnistage.realtime.vad import VadStream

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
class _Early:
    """An answer started at a pause, held back until its turn is committed."""

    turn: UserTurn
    phrases: int  # the turn's phrases when it started: more means the user went on
    run: ResponseRun
    gate: Gate
    item: Item


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
        self._hearing: list[asyncio.Task[str]] = []  # transcriptions of committed turns
        self._early: _Early | None = None
        # Transcript pieces of a turn not yet committed, sent once it is.
        self._unsent: dict[str, list[str]] = {}
        self.audio = AudioInput(self, self._new_turn, ctx.vad)
        self.audio.configure(config.input_format, config.turn_detection)
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
        self._drop_early()
        for run in list(self._runs.values()):
            run.cancel("client_cancelled")
        self.audio.clear()
        for task in list(self._tasks) + self._hearing:
            task.cancel()
        await asyncio.gather(*self._tasks, *self._hearing, return_exceptions=True)

    @property
    def _answers(self) -> bool:
        return self.config.kind != TRANSCRIPTION

    @property
    def _answering(self) -> bool:
        return self.response is not None and not self.response.done

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
                self.audio.append(event.audio)
            case ev.SessionUpdate():
                self.config.update(event.session)
                self.audio.configure(self.config.input_format, self.config.turn_detection)
                self.emit("session.updated", {"session": self._session_json()})
            case ev.AudioCommit():
                self._commit_manual()
            case ev.AudioClear():
                self._drop_early()
                self.audio.clear()
                self.emit("input_audio_buffer.cleared")
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

    # --------------------------------------------------------------------- turns

    def _new_turn(self, item_id: str, start_ms: float) -> UserTurn:
        return UserTurn(item_id, start_ms, self._phrase_listener, self._heard(item_id))

    def _phrase_listener(self) -> TurnListener | None:
        if self.ctx.listener is None:
            return None
        t = self.config.transcription or {}
        params = TranscriptionParams(language=t.get("language"), prompt=t.get("prompt"))
        return TurnListener(self.ctx.service, self.ctx.listener, params)

    def _heard(self, item_id: str) -> Callable[[str], None]:
        def heard(text: str) -> None:
            pending = self._unsent.get(item_id)
            if pending is not None:
                pending.append(text)  # not committed yet: sent after the commit
            else:
                self._transcript_delta(item_id, text)

        self._unsent[item_id] = []
        return heard

    def speech_started(self, turn: UserTurn, start_ms: int) -> None:
        td = self.config.turn_detection
        self._drop_early()
        if td is not None and td.interrupt_response and self._answering:
            assert self.response is not None
            self.response.cancel("turn_detected")  # first: no audio after the event
            self.ctx.stats.barge_in()
        # Transcript pieces of dropped turns are of no use any more.
        self._unsent = {turn.item_id: self._unsent.get(turn.item_id, [])}
        self.emit(
            "input_audio_buffer.speech_started",
            {"audio_start_ms": start_ms, "item_id": turn.item_id},
        )

    def paused(self, turn: UserTurn) -> None:
        td = self.config.turn_detection
        if td is None or not td.create_response or not self._answers or self._answering:
            return
        self._drop_early()
        item = self._user_item(turn)
        gate = Gate(self.emit, self._answer_item)

        async def hear() -> None:
            item.json["content"][0]["transcript"] = await turn.heard_so_far()

        items = [*self.conversation, item]
        run = self._new_run(reply_settings(self.config, {}), items, None, gate)
        run.created()
        self._early = _Early(turn, turn.phrases, run, gate, item)
        self._spawn(self._run(run, hear(), None))

    def resumed(self, turn: UserTurn) -> None:
        self._drop_early()

    def _drop_early(self) -> None:
        early, self._early = self._early, None
        if early is not None:
            early.gate.drop()
            early.run.cancel("turn_detected")

    def speech_stopped(self, turn: UserTurn, end_ms: int) -> None:
        self.emit(
            "input_audio_buffer.speech_stopped", {"audio_end_ms": end_ms, "item_id": turn.item_id}
        )
        # The user stopped talking when the silence began, silence_duration_ms ago.
        td = self.config.turn_detection
        spoken_end = time.monotonic() - (td.vad.silence_duration_ms / 1000 if td else 0.0)
        early, self._early = self._early, None
        adopt = early is not None and early.turn is turn and early.phrases == turn.phrases
        item = early.item if adopt and early is not None else self._user_item(turn)
        self._commit(turn, item, end_ms)
        if adopt and early is not None:
            self.response = early.run
            early.gate.open()
            self._time_first_audio(early.run, spoken_end, early.gate.opened_at)
            return
        if early is not None:
            early.gate.drop()
            early.run.cancel("turn_detected")
        if td is not None and td.create_response and self._answers and not self._answering:
            self._start(reply_settings(self.config, {}), None, None, spoken_end)

    def _commit_manual(self) -> None:
        taken = self.audio.take_turn()
        if taken is None:
            raise bad(
                "",
                f"buffer too small: at least {MIN_COMMIT_MS} ms of audio is needed, "
                f"the buffer holds {self.audio.held_ms():.0f} ms",
                "input_audio_buffer_commit_empty",
            )
        self._drop_early()
        turn, end_ms = taken
        self._commit(turn, self._user_item(turn), end_ms)

    def _user_item(self, turn: UserTurn) -> Item:
        item = message_item("user", [{"type": "input_audio", "transcript": None}])
        item.json["id"] = turn.item_id
        return item

    def _commit(self, turn: UserTurn, item: Item, end_ms: float) -> None:
        """The turn's audio is a user item now; its transcript follows."""
        self.audio.committed(end_ms)
        previous = self.conversation.add(item)
        self.emit(
            "input_audio_buffer.committed", {"previous_item_id": previous, "item_id": item.id}
        )
        self.emit("conversation.item.added", {"previous_item_id": previous, "item": item.json})
        for text in self._unsent.pop(turn.item_id, []):
            self._transcript_delta(turn.item_id, text)
        self.ctx.stats.turn()
        task = asyncio.ensure_future(self._transcribe(turn, item))
        self._hearing.append(task)
        task.add_done_callback(self._hearing.remove)
        # A failure is reported as an event; whoever awaits it also sees it.
        task.add_done_callback(lambda t: t.cancelled() or t.exception())

    async def _transcribe(self, turn: UserTurn, item: Item) -> str:
        part = item.json["content"][0]
        try:
            transcript = await turn.transcript()
        except Exception as exc:
            self._transcription_failed(item, exc)
            raise
        part["transcript"] = transcript
        if self._transcribes:
            self.emit(
                "conversation.item.input_audio_transcription.completed",
                {"item_id": item.id, "content_index": 0, "transcript": transcript},
            )
        self.emit("conversation.item.done", {"previous_item_id": None, "item": item.json})
        return transcript

    @property
    def _transcribes(self) -> bool:
        return self.config.transcription is not None or self.config.kind == TRANSCRIPTION

    def _transcript_delta(self, item_id: str, text: str) -> None:
        if self._transcribes:
            self.emit(
                "conversation.item.input_audio_transcription.delta",
                {"item_id": item_id, "content_index": 0, "delta": text},
            )

    def _transcription_failed(self, item: Item, exc: Exception) -> None:
        error = {
            "type": "transcription_error",
            "code": getattr(exc, "code", None) or "transcription_failed",
            "message": str(exc) or type(exc).__name__,
            "param": None,
        }
        self.emit(
            "conversation.item.input_audio_transcription.failed",
            {"item_id": item.id, "content_index": 0, "error": error},
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

    def _answer_item(self, item: Item) -> None:
        previous = self.conversation.add(item)
        self.emit("conversation.item.added", {"previous_item_id": previous, "item": item.json})

    # --------------------------------------------------------------------- responses

    def _create_response(self, params: dict[str, Any]) -> None:
        if not self._answers:
            raise bad("type", "a transcription session does not create responses")
        settings = reply_settings(self.config, params)
        if settings.in_conversation and self._answering:
            assert self.response is not None
            raise bad(
                "",
                f"Conversation already has an active response in progress: {self.response.id}",
                "conversation_already_has_active_response",
            )
        inputs = params.get("input")
        items = self._input_items(inputs) if inputs is not None else None
        if settings.in_conversation:
            # The client's answer replaces one held at a pause: two would both be adopted.
            self._drop_early()
        self._start(settings, items, params.get("instructions"), None)

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

    def _new_run(
        self,
        settings: ResponseSettings,
        items: list[Item] | None,
        instructions: str | None,
        gate: Gate | None = None,
    ) -> ResponseRun:
        text = instructions if instructions is not None else self.config.instructions

        def messages() -> list[Any]:
            return chat_messages(text, items if items is not None else list(self.conversation))

        return ResponseRun(
            self.ctx.service,
            (self.ctx.thinker, self.ctx.talker),
            settings,
            messages,
            gate.emit if gate is not None else self.emit,
            on_item=gate.add_item if gate is not None else self._answer_item,
            affinity=self.id,
        )

    def _start(
        self,
        settings: ResponseSettings,
        items: list[Item] | None,
        instructions: str | None,
        spoken_end: float | None,
    ) -> None:
        run = self._new_run(settings, items, instructions)
        if settings.in_conversation:
            self.response = run
        if spoken_end is not None:
            self._time_first_audio(run, spoken_end)
        run.created()
        hearing = list(self._hearing)

        async def heard() -> None:
            await asyncio.gather(*hearing)

        self._spawn(self._run(run, heard() if hearing else None, spoken_end))

    async def _run(self, run: ResponseRun, before: Any, spoken_end: float | None) -> None:
        self._runs[run.id] = run
        try:
            await run.run(before)
        finally:
            self._runs.pop(run.id, None)

    def _time_first_audio(
        self, run: ResponseRun, spoken_end: float, released: float | None = None
    ) -> None:
        """Record end of speech -> first answer audio sent. An early answer's audio went
        out when its gate opened (``released``), if it was made before."""

        def record(made: float) -> None:
            self.ctx.stats.first_audio(max(made, released or made) - spoken_end)

        if run.first_audio_at is not None:
            record(run.first_audio_at)
        else:
            run.on_first_audio = record

    def _cancel(self, response_id: str | None) -> None:
        run = self._runs.get(response_id) if response_id else self.response
        if run is None or run.done:
            raise bad(
                "response_id" if response_id else "",
                "Cancellation failed: no active response found",
                "response_cancel_not_active",
            )
        run.cancel("client_cancelled")
