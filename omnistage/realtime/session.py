"""One Realtime session: client events in, server events out, over the pipeline.

The session owns the conversation and the event plumbing, and hands the rest to one
part each: ``audio_input.AudioInput`` hears (buffer, VAD, the turn being spoken),
``turn_taking.TurnTaking`` decides what the user's turns mean (barge-in, early answers,
commits) and ``answers.Answers`` runs the answers. The parts see the session as a
``context.SessionHost`` (emit, spawn, config, conversation, pipeline) and never import it.

Every client error is an ``error`` event naming the field; the session goes on. The
route (``api.routes.realtime``) owns the socket: it feeds ``handle`` one frame at a time
and sends what ``send`` is given.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine
from typing import Any

from omnistage.protocol.errors import BadRequestError
from omnistage.realtime import events as ev
from omnistage.realtime import saved
from omnistage.realtime.answers import Answers
from omnistage.realtime.audio_input import AudioInput, item_audio
from omnistage.realtime.config import SessionConfig
from omnistage.realtime.context import Playback, SessionContext
from omnistage.realtime.conversation import (
    Conversation,
    Item,
    check_item,
    new_id,
)
from omnistage.realtime.options import bad
from omnistage.realtime.response_run import ResponseRun
from omnistage.realtime.turn_taking import TurnTaking

SESSION_TTL_S = 60 * 60


class RealtimeSession:
    def __init__(
        self,
        ctx: SessionContext,
        config: SessionConfig,
        send: Callable[[ev.ServerEvent], None],
        session_id: str | None = None,
    ) -> None:
        self.id = session_id or new_id("sess")
        self.ctx = ctx
        self.config = config
        self._send = send
        self._ids = ev.EventIds()
        self.conversation = Conversation()
        self.answers = Answers(self)
        self.turns = TurnTaking(self, self.answers)
        self._tasks: set[asyncio.Task[Any]] = set()
        words = self._judge_words if ctx.words is not None else None
        self.audio = AudioInput(
            self.turns, self.turns.new_turn, ctx.vad, self.spawn, ctx.guess, words
        )
        self.audio.configure(config.input_format, config.turn_detection)
        self._created = time.time()
        # Set by a WebRTC call, whose answer audio plays on the server's side of the call.
        self.clear_output: Callable[[], None] | None = None
        # Set by a WebRTC call too: where the answers play on the server's side.
        self.playback: Playback | None = None
        # Set where sessions are saved: told of each change to the config or items.
        self.on_change: Callable[[], None] | None = None

    @property
    def response(self) -> ResponseRun | None:
        """The conversation's answer under way (or the last one)."""
        return self.answers.active

    # --------------------------------------------------------------------- plumbing

    def emit(self, event: ev.ServerEvent) -> None:
        event.event_id = self._ids.next()
        self._send(event)
        if self.on_change is not None and isinstance(event, saved.SAVED_EVENTS):
            self.on_change()

    def error(self, exc: BadRequestError, event_id: str | None = None) -> None:
        self.emit(ev.error_event(exc, event_id))

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """Run ``coro`` as the session's: cancelled when the session closes."""
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def opened(self, resume: dict[str, Any] | None = None) -> None:
        """``session.created``; for a resumed session, then each item it had, in order,
        as ``conversation.item.done`` (``resume``: the extension's field, if saved)."""
        created = ev.SessionCreated(session=self._session_json())
        if resume is not None:
            created.resume = resume
        self.emit(created)
        previous = None
        for item in self.conversation:
            self.emit(ev.ItemDone(previous_item_id=previous, item=item.json))
            previous = item.id

    def restore(self, items: list[dict[str, Any]]) -> None:
        """A resumed session's saved items (before ``opened``)."""
        saved.restore_items(self.conversation, items)

    def saved_state(self) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """The config and items as the store keeps them."""
        return saved.snapshot(self._session_json(), self.config, self.conversation)

    def _session_json(self) -> dict[str, Any]:
        return self.config.to_json(self.id, int(self._created) + SESSION_TTL_S)

    async def close(self) -> None:
        """The client is gone: stop every answer and free every request of the session."""
        self.turns.drop_early()
        self.answers.cancel_all()
        self.audio.clear()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, self.turns.close(), return_exceptions=True)

    async def _judge_words(self, words: str) -> float | None:
        """Whether a turn's words so far end it, given the last answer (``words_turn``)."""
        assert self.ctx.words is not None
        return await self.ctx.words(words, self.conversation.last_said())

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
                self.turns.interruptions.audio(self.audio.turn, self.audio.buffer.end_ms)
            case ev.SessionUpdate():
                self.config.update(event.session)
                self.audio.configure(self.config.input_format, self.config.turn_detection)
                if self.audio.turn is None:  # the turn was dropped: an answer held goes on
                    self.turns.interruptions.dropped()
                self.emit(ev.SessionUpdated(session=self._session_json()))
            case ev.AudioCommit():
                self.turns.commit_manual(self.audio.take_turn())
            case ev.AudioClear():
                self.turns.drop_early()
                self.audio.clear()
                self.turns.interruptions.dropped()
                self.emit(ev.InputCleared())
            case ev.ItemCreate():
                self._create_item(event.item, event.previous_item_id)
            case ev.ItemDelete():
                self.conversation.delete(event.item_id)
                self.emit(ev.ItemDeleted(item_id=event.item_id))
            case ev.ItemRetrieve():
                item = self.conversation.get(event.item_id)
                self.emit(ev.ItemRetrieved(item=item.json))
            case ev.ItemTruncate():
                self.truncate(event.item_id, event.audio_end_ms, event.content_index)
            case ev.ResponseCreate():
                self._create_response(event.response or {})
            case ev.ResponseCancel():
                self.answers.cancel(event.response_id)
            case ev.OutputAudioClear():
                if self.clear_output is None:
                    raise bad("type", "output_audio_buffer.clear is for WebRTC sessions only")
                self.clear_output()

    def _create_response(self, params: dict[str, Any]) -> None:
        asked = self.answers.check(params)
        if asked.settings.in_conversation:
            # The client's answer replaces one held at a pause: two would both be adopted.
            self.turns.drop_early()
        self.answers.start(
            asked.settings, asked.items, asked.instructions, None, self.turns.hearing()
        )

    # --------------------------------------------------------------------- items

    def _create_item(self, value: Any, previous_item_id: str | None) -> None:
        item = check_item(value)
        if self.ctx.hears:  # the thinker hears a created turn's audio as a spoken one's
            item.audio = item_audio(item.json, self.config.input_format)
        previous = self.conversation.add(item, previous_item_id)
        self.emit(ev.ItemAdded(previous_item_id=previous, item=item.json))
        self.emit(ev.ItemDone(previous_item_id=previous, item=item.json))

    def truncate(self, item_id: str, audio_end_ms: int, content_index: int = 0) -> None:
        """Keep the first ``audio_end_ms`` of an answer's audio (the part the user heard)."""
        item = self.conversation.get(item_id)
        content = item.json.get("content") or [{}]
        if item.json.get("role") != "assistant" or content[0].get("type") != "output_audio":
            raise bad("item_id", "only an assistant message with audio can be truncated")
        if content_index != 0:
            raise bad("content_index", "an answer has one content part: use 0")
        if audio_end_ms < 0:
            raise bad("audio_end_ms", "must not be negative")
        end_ms = item.truncate(audio_end_ms)
        self.emit(ev.ItemTruncated(item_id=item.id, content_index=0, audio_end_ms=end_ms))
        run = self.answers.active
        if run is not None and run.message is item:
            run.truncated(end_ms)  # if the answer goes on, it goes on from the cut

    def add_answer_item(self, item: Item) -> None:
        """An answer's output item joins the conversation."""
        previous = self.conversation.add(item)
        self.emit(ev.ItemAdded(previous_item_id=previous, item=item.json))
