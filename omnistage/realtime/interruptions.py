"""Speech over an answer: pause it at once, then resume it or cancel it.

``turn_taking.TurnTaking`` hands this class the turns spoken while the conversation's
answer is under way (``turn_detection.interrupt_response``). The answer's audio is held
from the moment the speech starts (``output_hold``); at the user's first pause, and
when the turn ends, its words so far are judged (``backchannel.BackchannelPolicy``): a
backchannel or a noise releases the audio, a request cancels the answer (as far as its
audio went out) and, once the turn is committed, the turn is answered. A user who goes
on after a backchannel is held and judged again. Speech short enough to be a backchannel
resumes the answer if its words are slow to come (``BackchannelPolicy.words_wait_ms``
of silence after its pause, or its end), provisionally: its words, when they come, may
still cancel it.

Where the server plays the answers itself (a WebRTC call: ``SessionHost.playback``), an
answer all made may still be playing; speech over it pauses the playback, and the same
decision resumes it or cuts it (``PlayedAnswer``).

With ``turn_detection.resume_after_backchannel`` false, speech cancels the answer at
once, as plain barge-in.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from omnistage.realtime.answers import Answers
from omnistage.realtime.backchannel import BackchannelPolicy, Decision
from omnistage.realtime.context import Playback, SessionHost
from omnistage.realtime.response_run import ResponseRun, StopReason
from omnistage.realtime.user_turn import UserTurn

# An answer held this long with no decision (the client stopped sending audio
# mid-speech) is cancelled rather than left silent.
MAX_HOLD_S = 5.0


class _PlaybackHold:
    def __init__(self, playback: Playback) -> None:
        self._playback = playback

    def hold(self) -> None:
        self._playback.pause()

    def release(self) -> None:
        self._playback.resume()


class PlayedAnswer:
    """An answer all made, still playing on the server's side: held by pausing its
    playback, cancelled by cutting it there (its item keeps what was played)."""

    def __init__(self, playback: Playback) -> None:
        self._playback = playback
        self.hold = _PlaybackHold(playback)
        self.done = False

    def cancel(self, reason: StopReason) -> None:
        if not self.done:
            self.done = True
            self._playback.cut()


@dataclass
class _Held:
    turn: UserTurn
    run: ResponseRun | PlayedAnswer
    asked: int = 0  # bumped at each question and each resumption: stale answers lose
    resumed: bool = False  # the answer flows again: a backchannel so far
    provisional: bool = False  # resumed before its words were heard: they still decide
    quick: int | None = None  # the question (``asked``) short enough to resume unheard
    committed: bool = False  # the turn has ended
    spoken_end: float | None = None  # when it ended, if it is to be answered
    # The turn before, ended but still being judged when this one started: if it was a
    # request, it still cancels the answer (and is answered with this one).
    prior: _Held | None = None


class Interruptions:
    def __init__(
        self, host: SessionHost, answers: Answers, answer: Callable[[float], None]
    ) -> None:
        self._host = host
        self._answers = answers
        self._answer = answer  # answer the committed turn (spoken end: monotonic s)
        self.policy = BackchannelPolicy()
        self._held: _Held | None = None

    @property
    def held(self) -> ResponseRun | PlayedAnswer | None:
        """The answer held for a decision (None: none)."""
        held = self._held
        return None if held is None or held.resumed else held.run

    def judging(self, turn: UserTurn) -> bool:
        """Whether ``turn`` is speech over an answer, still to be judged or judged a
        backchannel so far (it is not to be answered early)."""
        return self._held is not None and self._held.turn is turn

    def speech_started(self, turn: UserTurn) -> None:
        """``turn`` starts while the conversation's answer may be under way, or still
        playing where the server plays it."""
        answers, td = self._answers, self._host.config.turn_detection
        if td is None or not td.interrupt_response:
            return
        run: ResponseRun | PlayedAnswer
        if answers.answering:
            assert answers.active is not None
            run = answers.active
            if not td.resume_after_backchannel:
                self._cancel(run)
                return
        else:
            playback = self._host.playback
            if playback is None or not playback.sounding or not td.resume_after_backchannel:
                return  # nothing plays, or the call cuts it as plain barge-in
            run = PlayedAnswer(playback)
        run.hold.hold()
        old = self._held
        undecided = old is not None and (not old.resumed or old.provisional)
        prior = old if old is not None and old.committed and undecided else None
        held = self._held = _Held(turn, run, prior=prior)
        asyncio.get_running_loop().call_later(MAX_HOLD_S, self._timed_out, held)

    def audio(self, turn: UserTurn | None, now_ms: float) -> None:
        """More of ``turn`` was heard, up to ``now_ms`` of the session's audio: speech too
        long for a backchannel is a request; a short one's silence may resume unheard."""
        held = self._held
        if held is None or held.turn is not turn or held.resumed:
            return
        if turn.in_phrase:
            if self.policy.speaking(turn.fed_ms - turn.start_ms) == Decision.CANCEL:
                self._settle(held, held.asked, Decision.CANCEL)
        elif now_ms - turn.fed_ms >= self.policy.words_wait_ms:  # fed_ms: the pause's
            self._unheard(held)

    def paused(self, turn: UserTurn) -> None:
        held = self._held
        if held is not None and held.turn is turn and not held.resumed:
            self._ask(held, turn.heard_so_far)

    def resumed(self, turn: UserTurn) -> None:
        """The user went on after a pause: whatever was decided on it is held again."""
        held = self._held
        if held is None or held.turn is not turn:
            return
        held.asked += 1
        if held.resumed:
            held.resumed = held.provisional = False
            held.run.hold.hold()

    def stopped(self, turn: UserTurn, spoken_end: float | None) -> bool:
        """``turn`` is committed; whether it is the one an answer is held for (then it
        is answered, at ``spoken_end``, only if that answer is cancelled)."""
        held = self._held
        if held is None or held.turn is not turn:
            return False
        held.committed, held.spoken_end = True, spoken_end
        if held.resumed and not held.provisional and not held.run.done:
            self._held = None  # a backchannel: it stays in the conversation, unanswered
        else:
            self._ask(held, turn.transcript)
            self._unheard(held)  # the turn is over: short speech waits no longer
        return True

    def dropped(self) -> None:
        """The turn was thrown away (``input_audio_buffer.clear``): as if never said."""
        held, self._held = self._held, None
        if held is not None:
            held.run.hold.release()

    def _ask(self, held: _Held, words: Callable[[], Coroutine[Any, Any, str]]) -> None:
        held.asked += 1
        asked = held.asked
        speech_ms = held.turn.fed_ms - held.turn.start_ms
        if self._host.ctx.listener is None:  # nobody transcribes: judged by its length
            self._settle(held, asked, self.policy.heard(speech_ms, None))
            return

        async def judge() -> None:
            try:
                text = await words()
            except Exception:  # not heard: taken for a request, as barge-in would
                self._settle(held, asked, Decision.CANCEL)
                return
            self._settle(held, asked, self.policy.heard(speech_ms, text))

        self._host.spawn(judge())
        held.quick = asked if self.policy.may_resume_unheard(speech_ms) else None

    def _unheard(self, held: _Held) -> None:
        """Short speech's words are not in yet: the answer resumes meanwhile."""
        quick = held.quick is not None and held.quick == held.asked
        if quick and self._held is held and not held.resumed and not held.run.done:
            held.run.hold.release()
            held.resumed = held.provisional = True

    def _settle(self, held: _Held, asked: int, decision: Decision) -> None:
        if held.asked != asked or decision == Decision.WAIT:
            return  # asked again since
        current, run = self._held, held.run
        if current is not held:  # a newer turn holds the answer now
            request = decision == Decision.CANCEL and not run.done
            if request and current is not None and current.prior is held:
                self._cancel(run)  # the newer turn, once it ends, is answered
            return
        if decision == Decision.RESUME and not run.done:
            run.hold.release()
            held.resumed, held.provisional = True, False
            if held.committed:
                self._held = None
            return
        self._held = None
        if not run.done:
            self._cancel(run)
        if held.committed and held.spoken_end is not None:
            self._answer(held.spoken_end)

    def _cancel(self, run: ResponseRun | PlayedAnswer) -> None:
        run.cancel(StopReason.TURN_DETECTED)  # first: no audio after the speech started
        self._host.ctx.stats.barge_in()

    def _timed_out(self, held: _Held) -> None:
        if self._held is held and not held.resumed:
            self._settle(held, held.asked, Decision.CANCEL)
