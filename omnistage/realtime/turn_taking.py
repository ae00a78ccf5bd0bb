"""What the user's turns mean: the session's side of ``audio_input.AudioInput``.

- Speech while an answer is under way pauses it, and then resumes it (a backchannel)
  or cancels it (a request: barge-in); ``interruptions`` decides.
- A pause starts an answer early: the phrase so far is being transcribed and the thinker
  and talker start on it, with everything they say held back (``gate``); if the VAD
  then ends the turn there, it all goes out at once; if the user goes on, it is dropped.
  Where the phrase was guessed (``user_turn``), the answer starts as soon as the guess's
  words are in, and the pause that ends the phrase keeps it.
- A committed turn becomes a user item, is transcribed, and is answered.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from omnistage.protocol.params import TranscriptionParams
from omnistage.realtime import events as ev
from omnistage.realtime.answers import Answers
from omnistage.realtime.context import SessionHost
from omnistage.realtime.conversation import Item, message_item
from omnistage.realtime.gate import Gate
from omnistage.realtime.interruptions import Interruptions
from omnistage.realtime.listening import TurnListener
from omnistage.realtime.options import SessionKind
from omnistage.realtime.replies import reply_settings
from omnistage.realtime.response_run import ResponseRun, StopReason
from omnistage.realtime.user_turn import UserTurn


@dataclass
class _Early:
    """An answer started at a pause, held back until its turn is committed."""

    turn: UserTurn
    phrases: int  # the turn's phrases when it started: more means the user went on
    run: ResponseRun
    gate: Gate
    item: Item


class TurnTaking:
    def __init__(self, host: SessionHost, answers: Answers) -> None:
        self._host = host
        self._answers = answers
        self._hearing: list[asyncio.Task[str]] = []  # transcriptions of committed turns
        self._early: _Early | None = None
        # Transcript pieces of a turn not yet committed, sent once it is.
        self._unsent: dict[str, list[str]] = {}
        self.interruptions = Interruptions(host, answers, self._answer)

    @property
    def _auto_answer(self) -> bool:
        """Whether a committed turn is answered without the client's ``response.create``."""
        config = self._host.config
        td = config.turn_detection
        return td is not None and td.create_response and config.kind != SessionKind.TRANSCRIPTION

    def hearing(self) -> Awaitable[None] | None:
        """What an answer must wait for: the transcripts of the turns committed so far."""
        pending = list(self._hearing)
        return asyncio.gather(*pending) if pending else None  # type: ignore[return-value]

    def new_turn(self, item_id: str, start_ms: float) -> UserTurn:
        keep = self._host.ctx.hears
        heard = self._heard(item_id)
        return UserTurn(
            item_id, start_ms, self._phrase_listener, heard, keep_audio=keep, on_guess=self.guessed
        )

    def _phrase_listener(self) -> TurnListener | None:
        ctx, config = self._host.ctx, self._host.config
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
        host = self._host
        self.drop_early()
        self.interruptions.speech_started(turn)  # first: no audio after the event
        # Transcript pieces of dropped turns are of no use any more.
        self._unsent = {turn.item_id: self._unsent.get(turn.item_id, [])}
        host.emit(ev.InputSpeechStarted(audio_start_ms=start_ms, item_id=turn.item_id))

    def paused(self, turn: UserTurn) -> None:
        self.interruptions.paused(turn)
        early = self._early
        if early is not None and early.turn is turn and early.phrases == turn.phrases:
            return  # started on this phrase's guess, whose words the phrase took
        self._start_early(turn, turn.phrases, turn.heard_so_far)

    def guessed(self, turn: UserTurn) -> None:
        """``turn``'s open phrase has its guess's words, and its silence holds."""
        self._start_early(turn, turn.phrases + 1, turn.guessed_so_far)

    def _start_early(
        self, turn: UserTurn, phrases: int, words: Callable[[], Awaitable[str]]
    ) -> None:
        """Start answering ``turn`` as ``phrases`` phrases would have it (``words``: their
        transcript), held back until the turn is committed with as many."""
        host, answers = self._host, self._answers
        if not self._auto_answer or answers.answering or self.interruptions.judging(turn):
            return
        self.drop_early()
        item = self._user_item(turn)
        gate = Gate(host.emit, host.add_answer_item)

        async def hear() -> None:
            item.audio = turn.audio()  # what a thinker that hears is given: the turn so far
            item.json["content"][0]["transcript"] = await words()

        items = [*host.conversation, item]
        run = answers.new_run(reply_settings(host.config, {}), items, None, gate)
        run.created()
        self._early = _Early(turn, phrases, run, gate, item)
        answers.run(run, hear())

    def resumed(self, turn: UserTurn) -> None:
        self.drop_early()
        self.interruptions.resumed(turn)

    def unguessed(self, turn: UserTurn) -> None:
        """The user went on before the pause ended the guessed phrase: an answer started
        on the guess is void."""
        early = self._early
        if early is not None and early.turn is turn and early.phrases > turn.phrases:
            self.drop_early()

    def drop_early(self) -> None:
        early, self._early = self._early, None
        if early is not None:
            early.gate.drop()
            early.run.cancel(StopReason.TURN_DETECTED)

    def speech_stopped(self, turn: UserTurn, end_ms: int, silence_ms: float) -> None:
        host, answers = self._host, self._answers
        host.emit(ev.InputSpeechStopped(audio_end_ms=end_ms, item_id=turn.item_id))
        # The user stopped talking when the silence began, silence_ms of audio ago.
        spoken_end = time.monotonic() - silence_ms / 1000
        early, self._early = self._early, None
        # An answer started on a guess counts the phrase the guess stands for.
        phrases = turn.phrases + turn.guessing
        adopt = early is not None and early.turn is turn and early.phrases == phrases
        item = early.item if adopt and early is not None else self._user_item(turn)
        self._commit(turn, item)
        if adopt and early is not None:
            answers.adopt(early.run)
            early.gate.open()
            answers.time_first_audio(early.run, spoken_end, early.gate.opened_at)
            return
        if early is not None:
            early.gate.drop()
            early.run.cancel(StopReason.TURN_DETECTED)
        if not self.interruptions.stopped(turn, spoken_end):
            self._answer(spoken_end)

    def _answer(self, spoken_end: float) -> None:
        """Answer the turns committed so far, unless an answer is under way."""
        answers = self._answers
        if self._auto_answer and not answers.answering:
            settings = reply_settings(self._host.config, {})
            answers.start(settings, None, None, spoken_end, self.hearing())

    # ------------------------------------------------------------- commits

    def commit_manual(self, turn: UserTurn) -> None:
        """``input_audio_buffer.commit`` of ``turn`` (``AudioInput.take_turn``'s)."""
        self.drop_early()
        self._commit(turn, self._user_item(turn))
        self.interruptions.stopped(turn, None)  # the client asks for its answer itself

    def _user_item(self, turn: UserTurn) -> Item:
        item = message_item("user", [{"type": "input_audio", "transcript": None}])
        item.json["id"] = turn.item_id
        return item

    def _commit(self, turn: UserTurn, item: Item) -> None:
        """The turn's audio is a user item now; its transcript follows."""
        host = self._host
        if item.audio is None:  # an early answer's item keeps the audio it answered
            item.audio = turn.audio()
        previous = host.conversation.add(item)
        host.emit(ev.InputCommitted(previous_item_id=previous, item_id=item.id))
        host.emit(ev.ItemAdded(previous_item_id=previous, item=item.json))
        for text in self._unsent.pop(turn.item_id, []):
            self._transcript_delta(turn.item_id, text)
        host.ctx.stats.turn()
        task = asyncio.ensure_future(self._transcribe(turn, item))
        self._hearing.append(task)
        task.add_done_callback(self._hearing.remove)
        # A failure is reported as an event; whoever awaits it also sees it.
        task.add_done_callback(lambda t: t.cancelled() or t.exception())

    async def _transcribe(self, turn: UserTurn, item: Item) -> str:
        host = self._host
        part = item.json["content"][0]
        try:
            transcript = await turn.transcript()
        except Exception as exc:
            self._transcription_failed(item, exc)
            raise
        part["transcript"] = transcript
        if self._transcribes:
            host.emit(ev.TranscriptionCompleted(item_id=item.id, transcript=transcript))
        host.emit(ev.ItemDone(previous_item_id=None, item=item.json))
        return transcript

    @property
    def _transcribes(self) -> bool:
        config = self._host.config
        return config.transcription is not None or config.kind == SessionKind.TRANSCRIPTION

    def _transcript_delta(self, item_id: str, text: str) -> None:
        if self._transcribes:
            self._host.emit(ev.TranscriptionDelta(item_id=item_id, delta=text))

    def _transcription_failed(self, item: Item, exc: Exception) -> None:
        error = ev.Failure(
            type="transcription_error",
            code=getattr(exc, "code", None) or "transcription_failed",
            message=str(exc) or type(exc).__name__,
        )
        self._host.emit(ev.TranscriptionFailed(item_id=item.id, error=error))
        self._host.emit(ev.ItemDone(previous_item_id=None, item=item.json))

    async def close(self) -> None:
        self.drop_early()
        for task in list(self._hearing):
            task.cancel()
        await asyncio.gather(*self._hearing, return_exceptions=True)
