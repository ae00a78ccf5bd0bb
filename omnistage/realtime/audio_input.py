"""A session's audio input: appends in the client's format -> 24 kHz pcm16 in the input
buffer -> server VAD -> the user turn being spoken, phrase by phrase.

What the turns mean (barge-in, answering, committing) is the session's; this class
tells it what it hears through ``Listener`` callbacks:
- ``speech_started(turn, start_ms)`` / ``speech_stopped(turn, end_ms, silence_ms)``: the
  VAD's turn events (``silence_ms``: how much of the silence after the turn was heard before
  it ended);
- ``paused(turn)``: the user has been silent for ``turn.PAUSE_MS`` (the turn may be
  over; the phrase so far is being transcribed);
- ``resumed(turn)``: the user spoke again before the turn ended;
- ``unguessed(turn)``: the user spoke again before a guessed phrase's pause ended it
  (``user_turn``: the guess is void).

With ``semantic_vad`` and a ``words`` judge, each silence's words (the guess's, or the
paused phrase's) are judged too, once per silence, when both they and the end-of-turn
model's verdict are in and that verdict leaves the turn unsure
(``SemanticTurnDetector.words_wanted``): the detector weighs the two
(``SemanticTurnDetector.words``). A sure verdict spares the thinker the question, just as
the answer's first token is due there; one that calls the turn unfinished has the words
asked only if the silence lasts (``semantic_vad.WORDS_LATE_MS``): they are held until
then, and dropped if the user goes on.

A ``semantic_vad`` turn may end after the audio that ended it was appended: the end-of-turn
model's verdict is awaited off the event loop (``vad.VadStream.verdicts``), in a task of
the session's, and its events are handled as they come.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Protocol

import numpy as np

from omnistage.audio.formats import AudioFormat, InputStream
from omnistage.audio.semantic_vad import SemanticVadParams
from omnistage.audio.server_vad import ServerVadParams, SpeechStarted, VadEvent
from omnistage.audio.vad import VadParams, VadStream
from omnistage.realtime.config import TurnDetection
from omnistage.realtime.conversation import new_id
from omnistage.realtime.input_buffer import BYTES_PER_MS, RATE, InputBuffer
from omnistage.realtime.options import bad
from omnistage.realtime.user_turn import PAUSE_MS, UserTurn

log = logging.getLogger(__name__)

# Push-to-talk audio held before a commit (OpenAI's buffer holds about this much).
MAX_BUFFER_MS = 15 * 60 * 1000
MIN_COMMIT_MS = 100  # OpenAI refuses to commit less
# Between turns, audio older than the prefix padding plus this is forgotten.
SLACK_MS = 500


class Listener(Protocol):
    def speech_started(self, turn: UserTurn, start_ms: int) -> None: ...
    def speech_stopped(self, turn: UserTurn, end_ms: int, silence_ms: float) -> None: ...
    def paused(self, turn: UserTurn) -> None: ...
    def resumed(self, turn: UserTurn) -> None: ...
    def unguessed(self, turn: UserTurn) -> None: ...


class AudioInput:
    def __init__(
        self,
        listener: Listener,
        new_turn: Callable[[str, float], UserTurn],
        vad: Callable[[VadParams], VadStream],
        spawn: Callable[[Coroutine[Any, Any, None]], Any] | None = None,
        guess: Callable[[], bool] = lambda: False,
        words: Callable[[str], Awaitable[float | None]] | None = None,
    ) -> None:
        self._listener = listener
        self._guess = guess  # whether to transcribe a phrase as its pause begins
        self._words = words  # judges whether a turn's words so far end it
        self._words_for: int | None = None  # the silence whose words were judged
        # A silence's words, heard before the end-of-turn model's verdict on it: judged
        # once that verdict leaves the turn unsure (VadStream.words_wanted).
        self._unjudged: tuple[VadStream, int, str] | None = None
        self._spawn = spawn  # runs the session's background tasks (late VAD verdicts)
        self._new_turn = new_turn
        self._make_vad = vad
        self.buffer = InputBuffer()
        self._decoder: InputStream | None = None
        self._detection: TurnDetection | None = None
        self._vad: VadStream | None = None
        self.turn: UserTurn | None = None

    def configure(self, fmt: AudioFormat, detection: TurnDetection | None) -> None:
        """The session's input format and turn detection (again after an update)."""
        if self._decoder is None or self._decoder.format != fmt:
            self._decoder = InputStream(fmt, RATE)
        if detection != self._detection or (self._vad is None and detection is not None):
            self.drop_turn()
            self._detection = detection
            self._vad = self._make_vad(detection.vad) if detection is not None else None

    def append(self, audio: str) -> None:
        try:
            raw = base64.b64decode(audio, validate=True)
        except (binascii.Error, ValueError):
            raise bad("audio", "expected base64-encoded audio") from None
        assert self._decoder is not None
        if raw[:4] == b"RIFF" and raw[8:12] == b"WAVE":
            # A file where raw samples belong would be heard as a click and then noise.
            fmt = self._decoder.format.type
            raise bad("audio", f"got a WAV file; send raw {fmt} samples, without a header")
        pcm = self._decoder.push(raw).astype("<i2").tobytes()
        if self._vad is None and len(self.buffer) + len(pcm) > MAX_BUFFER_MS * BYTES_PER_MS:
            raise bad(
                "audio",
                f"the input audio buffer is full ({MAX_BUFFER_MS // 60000} min): "
                "commit or clear it",
                "input_audio_buffer_full",
            )
        self.buffer.append(pcm)
        ms = len(pcm) / BYTES_PER_MS
        if self._vad is None:  # push-to-talk: the turn starts with its first audio
            if self.turn is None:
                self.turn = self._new_turn(new_id("item"), self.buffer.end_ms - ms)
            self.turn.feed(pcm, ms)
            return
        if self.turn is not None and self.turn.in_phrase:
            self.turn.feed(pcm, ms)
        self._heard(self._vad.feed(pcm))
        self._judge_held(self._vad)
        for verdict in self._vad.verdicts():
            assert self._spawn is not None, "a VAD with late verdicts needs a spawn"
            self._spawn(self._late(self._vad, verdict))

    async def _late(self, vad: VadStream, verdict: Coroutine[Any, Any, list[VadEvent]]) -> None:
        events = await verdict
        if vad is self._vad:  # not replaced by a session.update meanwhile
            self._heard(events)
            self._judge_held(vad)

    def _judge_held(self, vad: VadStream) -> None:
        """Words held for the end-of-turn model's verdict: judged once it is in."""
        held = self._unjudged
        if held is None or (held[0] is vad and vad.words_wanted(held[1]) is None):
            return
        self._unjudged = None
        if held[0] is vad:  # else the VAD was replaced (session.update): the words are void
            assert self._spawn is not None
            self._spawn(self._judge(*held))

    def _heard(self, events: list[VadEvent]) -> None:
        for event in events:
            if isinstance(event, SpeechStarted):
                self._started(event.audio_start_ms)
            elif self.turn is not None:
                turn, self.turn = self.turn, None
                silence_ms = self.buffer.end_ms - event.audio_end_ms
                self._listener.speech_stopped(turn, event.audio_end_ms, silence_ms)
                self.buffer.drop_before(event.audio_end_ms)  # the turn has its audio
        if self.turn is not None:
            self._watch_pause(self.turn)
        else:
            assert self._detection is not None
            self.buffer.keep_last(self._detection.vad.prefix_padding_ms + SLACK_MS)

    def _started(self, start_ms: int) -> None:
        self.drop_turn()
        turn = self.turn = self._new_turn(new_id("item"), start_ms)
        self._listener.speech_started(turn, start_ms)
        turn.feed(self.buffer.slice(start_ms), self.buffer.end_ms - start_ms)

    def _watch_pause(self, turn: UserTurn) -> None:
        assert self._vad is not None and self._detection is not None
        silence_from = self._vad.detector.silence_from
        vad = self._detection.vad
        # A phrase ends at the shorter of the two: a server VAD set to end turns on a
        # shorter silence than PAUSE_MS must still have its phrase transcribed first.
        pause_ms = (
            min(PAUSE_MS, vad.silence_duration_ms) if isinstance(vad, ServerVadParams) else PAUSE_MS
        )
        if turn.in_phrase:
            if silence_from is None:
                if turn.unguess():  # the user went on
                    self._listener.unguessed(turn)
            elif self.buffer.end_ms - silence_from >= pause_ms:
                turn.end_phrase()
                self._listener.paused(turn)
            elif self._guess():
                turn.guess()
        elif silence_from is None:  # the user went on: the pause is part of the turn
            self._listener.resumed(turn)
            turn.feed(self.buffer.slice(turn.fed_ms), self.buffer.end_ms - turn.fed_ms)
        if silence_from is not None and (turn.guessing or not turn.in_phrase):
            self._judge_words(turn, silence_from)

    def _judge_words(self, turn: UserTurn, silence_from: int) -> None:
        """The words up to this silence are on their way: have them judged (semantic_vad,
        once per silence)."""
        vad = self._detection.vad if self._detection is not None else None
        heeded = isinstance(vad, SemanticVadParams) and vad.eager.words_end is not None
        if self._words is None or not heeded or self._words_for == silence_from:
            return
        assert self._spawn is not None and self._vad is not None
        self._words_for = silence_from
        self._spawn(self._words_verdict(self._vad, turn, silence_from))

    async def _words_verdict(self, vad: VadStream, turn: UserTurn, silence_from: int) -> None:
        try:
            words = await turn.guessed_so_far()
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # the session is closing
            log.debug("words at %d ms: none, the guess was void (the user went on)", silence_from)
            return
        except Exception as exc:  # not heard: the turn waits as it would without words
            log.debug("words at %d ms: none, not heard (%s)", silence_from, exc)
            return
        if vad.words_wanted(silence_from) is None:  # not yet known: held
            self._unjudged = (vad, silence_from, words)
        else:
            await self._judge(vad, silence_from, words)

    async def _judge(self, vad: VadStream, silence_from: int, words: str) -> None:
        """The words' verdict on the silence from ``silence_from``, if it could still change
        when the turn ends."""
        # Each way out says why at DEBUG: a turn that waited its longest silence for words
        # that never came is otherwise hard to tell from one whose words said "go on".
        if self._words is None or not vad.words_wanted(silence_from):
            log.debug("words at %d ms: not asked, the verdict no longer needs them", silence_from)
            return
        probability = await self._words(words)
        if probability is None:
            log.debug("words at %d ms: the thinker gave no verdict on %r", silence_from, words)
        elif vad is not self._vad:
            log.debug("words at %d ms: dropped, the turn detector was replaced", silence_from)
        else:
            self._heard(vad.words(silence_from, probability))

    def take_turn(self) -> UserTurn:
        """For a manual commit: the turn so far (or the buffer as one), its audio taken
        from the buffer; refused when it holds less than ``MIN_COMMIT_MS``."""
        end_ms = self.buffer.end_ms
        start_ms = self.turn.start_ms if self.turn is not None else self.buffer.start_ms
        if end_ms - start_ms < MIN_COMMIT_MS:
            raise bad(
                "",
                f"buffer too small: at least {MIN_COMMIT_MS} ms of audio is needed, "
                f"the buffer holds {self.held_ms():.0f} ms",
                "input_audio_buffer_commit_empty",
            )
        turn, self.turn = self.turn, None
        if turn is None:
            turn = self._new_turn(new_id("item"), start_ms)
            turn.feed(self.buffer.slice(start_ms), end_ms - start_ms)
        if self._vad is not None:
            self._vad.reset()
        self.buffer.drop_before(end_ms)
        return turn

    def held_ms(self) -> float:
        start = self.turn.start_ms if self.turn is not None else self.buffer.start_ms
        return max(0.0, self.buffer.end_ms - start)

    def clear(self) -> None:
        self.drop_turn()
        self.buffer.clear()
        if self._vad is not None:
            self._vad.reset()

    def drop_turn(self) -> None:
        if self.turn is not None:
            self.turn.close()
        self.turn = None


def item_audio(item: dict[str, Any], fmt: AudioFormat) -> bytes | None:
    """The audio of a user message a client created (an ``input_audio`` part's
    ``audio``, base64 in the session's input format) as 24 kHz pcm16, taken out of the
    item (it is not sent back in every event); None if it has none."""
    if item.get("type") != "message" or item.get("role") != "user":
        return None
    for i, part in enumerate(item["content"]):
        audio = part.get("audio") if part.get("type") == "input_audio" else None
        if not isinstance(audio, str):
            continue
        try:
            raw = base64.b64decode(audio, validate=True)
        except (binascii.Error, ValueError):
            raise bad(f"item.content[{i}].audio", "expected base64-encoded audio") from None
        del part["audio"]
        decoder = InputStream(fmt, RATE)
        pcm = np.concatenate((decoder.push(raw), decoder.flush()))
        return pcm.astype("<i2").tobytes()
    return None
