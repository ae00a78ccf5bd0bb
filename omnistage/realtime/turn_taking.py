"""What the user's turns mean: the session's side of ``audio_input.AudioInput``.

- Speech while an answer is under way cancels it (barge-in).
- A pause starts an answer early: the phrase so far is being transcribed and the thinker
  and talker start on it, with everything they say held back (``gate``); if the VAD
  then ends the turn there, it all goes out at once; if the user goes on, it is dropped.
- A committed turn becomes a user item, is transcribed, and is answered.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from omnistage.protocol.params import TranscriptionParams
from omnistage.realtime.audio_input import MIN_COMMIT_MS
from omnistage.realtime.config import TRANSCRIPTION, bad
from omnistage.realtime.conversation import Item, message_item
from omnistage.realtime.gate import Gate
from omnistage.realtime.listening import TurnListener
from omnistage.realtime.replies import reply_settings
from omnistage.realtime.response import ResponseRun
from omnistage.realtime.turn import UserTurn

if TYPE_CHECKING:
    from omnistage.realtime.session import RealtimeSession


@dataclass
class _Early:
    """An answer started at a pause, held back until its turn is committed."""

    turn: UserTurn
    phrases: int  # the turn's phrases when it started: more means the user went on
    run: ResponseRun
    gate: Gate
    item: Item


class TurnTaking:
    def __init__(self, session: RealtimeSession) -> None:
        self._session = session
        self._hearing: list[asyncio.Task[str]] = []  # transcriptions of committed turns
        self._early: _Early | None = None
        # Transcript pieces of a turn not yet committed, sent once it is.
        self._unsent: dict[str, list[str]] = {}

    @property
    def _answers(self) -> bool:
        td = self._session.config.turn_detection
        return td is not None and td.create_response and self._session.config.kind != TRANSCRIPTION

    def hearing(self) -> Awaitable[None] | None:
        """What an answer must wait for: the transcripts of the turns committed so far."""
        pending = list(self._hearing)
        return asyncio.gather(*pending) if pending else None  # type: ignore[return-value]

    def new_turn(self, item_id: str, start_ms: float) -> UserTurn:
        return UserTurn(item_id, start_ms, self._phrase_listener, self._heard(item_id))

    def _phrase_listener(self) -> TurnListener | None:
        ctx, config = self._session.ctx, self._session.config
        if ctx.listener is None:
            return None
        t = config.transcription or {}
        params = TranscriptionParams(language=t.get("language"), prompt=t.get("prompt"))
        return TurnListener(ctx.service, ctx.listener, params)

    def _heard(self, item_id: str) -> Callable[[str], None]:
        def heard(text: str) -> None:
            pending = self._unsent.get(item_id)
            if pending is not None:
                pending.append(text)  # not committed yet: sent after the commit
            else:
                self._transcript_delta(item_id, text)

        self._unsent[item_id] = []
        return heard

    # ------------------------------------------------------------- AudioInput's Listener

    def speech_started(self, turn: UserTurn, start_ms: int) -> None:
        s = self._session
        td = s.config.turn_detection
        self.drop_early()
        if td is not None and td.interrupt_response and s.responses.interrupt():
            s.ctx.stats.barge_in()  # cancelled first: no audio after the event
        # Transcript pieces of dropped turns are of no use any more.
        self._unsent = {turn.item_id: self._unsent.get(turn.item_id, [])}
        s.emit(
            "input_audio_buffer.speech_started",
            {"audio_start_ms": start_ms, "item_id": turn.item_id},
        )

    def paused(self, turn: UserTurn) -> None:
        s = self._session
        if not self._answers or s.responses.answering:
            return
        self.drop_early()
        item = self._user_item(turn)
        gate = Gate(s.emit, s.add_answer_item)

        async def hear() -> None:
            item.json["content"][0]["transcript"] = await turn.heard_so_far()

        items = [*s.conversation, item]
        run = s.responses.new_run(reply_settings(s.config, {}), items, None, gate)
        run.created()
        self._early = _Early(turn, turn.phrases, run, gate, item)
        s.responses.run(run, hear())

    def resumed(self, turn: UserTurn) -> None:
        self.drop_early()

    def drop_early(self) -> None:
        early, self._early = self._early, None
        if early is not None:
            early.gate.drop()
            early.run.cancel("turn_detected")

    def speech_stopped(self, turn: UserTurn, end_ms: int) -> None:
        s = self._session
        s.emit(
            "input_audio_buffer.speech_stopped", {"audio_end_ms": end_ms, "item_id": turn.item_id}
        )
        # The user stopped talking when the silence began, silence_duration_ms ago.
        td = s.config.turn_detection
        spoken_end = time.monotonic() - (td.vad.silence_duration_ms / 1000 if td else 0.0)
        early, self._early = self._early, None
        adopt = early is not None and early.turn is turn and early.phrases == turn.phrases
        item = early.item if adopt and early is not None else self._user_item(turn)
        self._commit(turn, item, end_ms)
        if adopt and early is not None:
            s.responses.adopt(early.run)
            early.gate.open()
            s.responses.time_first_audio(early.run, spoken_end, early.gate.opened_at)
            return
        if early is not None:
            early.gate.drop()
            early.run.cancel("turn_detected")
        if self._answers and not s.responses.answering:
            s.responses.start(reply_settings(s.config, {}), None, None, spoken_end, self.hearing())

    # ------------------------------------------------------------- commits

    def commit_manual(self) -> None:
        """``input_audio_buffer.commit``."""
        s = self._session
        taken = s.audio.take_turn()
        if taken is None:
            raise bad(
                "",
                f"buffer too small: at least {MIN_COMMIT_MS} ms of audio is needed, "
                f"the buffer holds {s.audio.held_ms():.0f} ms",
                "input_audio_buffer_commit_empty",
            )
        self.drop_early()
        turn, end_ms = taken
        self._commit(turn, self._user_item(turn), end_ms)

    def _user_item(self, turn: UserTurn) -> Item:
        item = message_item("user", [{"type": "input_audio", "transcript": None}])
        item.json["id"] = turn.item_id
        return item

    def _commit(self, turn: UserTurn, item: Item, end_ms: float) -> None:
        """The turn's audio is a user item now; its transcript follows."""
        s = self._session
        s.audio.committed(end_ms)
        previous = s.conversation.add(item)
        s.emit("input_audio_buffer.committed", {"previous_item_id": previous, "item_id": item.id})
        s.emit("conversation.item.added", {"previous_item_id": previous, "item": item.json})
        for text in self._unsent.pop(turn.item_id, []):
            self._transcript_delta(turn.item_id, text)
        s.ctx.stats.turn()
        task = asyncio.ensure_future(self._transcribe(turn, item))
        self._hearing.append(task)
        task.add_done_callback(self._hearing.remove)
        # A failure is reported as an event; whoever awaits it also sees it.
        task.add_done_callback(lambda t: t.cancelled() or t.exception())

    async def _transcribe(self, turn: UserTurn, item: Item) -> str:
        s = self._session
        part = item.json["content"][0]
        try:
            transcript = await turn.transcript()
        except Exception as exc:
            self._transcription_failed(item, exc)
            raise
        part["transcript"] = transcript
        if self._transcribes:
            s.emit(
                "conversation.item.input_audio_transcription.completed",
                {"item_id": item.id, "content_index": 0, "transcript": transcript},
            )
        s.emit("conversation.item.done", {"previous_item_id": None, "item": item.json})
        return transcript

    @property
    def _transcribes(self) -> bool:
        config = self._session.config
        return config.transcription is not None or config.kind == TRANSCRIPTION

    def _transcript_delta(self, item_id: str, text: str) -> None:
        if self._transcribes:
            self._session.emit(
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
        self._session.emit(
            "conversation.item.input_audio_transcription.failed",
            {"item_id": item.id, "content_index": 0, "error": error},
        )
        self._session.emit("conversation.item.done", {"previous_item_id": None, "item": item.json})

    async def close(self) -> None:
        self.drop_early()
        for task in list(self._hearing):
            task.cancel()
        await asyncio.gather(*self._hearing, return_exceptions=True)
