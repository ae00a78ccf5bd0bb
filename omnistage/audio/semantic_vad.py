"""Semantic turn detection: the turn ends when an end-of-turn model says the speaker is done.

This is Realtime's ``turn_detection: {"type": "semantic_vad", "eagerness"}`` as a pure state
machine, the counterpart of ``server_vad.TurnDetector``. Silero's window probabilities say
where speech starts and where a silence begins (with the same threshold and hysteresis as
server VAD); what a silence means is the model's call:

- once a silence has lasted ``CHECK_MS`` (``FIRST_CHECK_MS`` for "high" eagerness), the
  detector asks ``judge(turn_start_ms, end_ms)`` for the probability that the turn's audio
  up to ``end_ms`` is a finished turn; it asks ``LEAD_MS`` ahead, so that the verdict is in
  when the silence gets there (the audio it is asked about then ends ``LEAD_MS`` in the
  future: ``vad.VadStream`` repeats the silence heard so far to fill it);
- at or above the eagerness's ``threshold`` the turn ends, where the silence began, once
  the silence lasts as long as the model was asked about;
- below it, if asked early, the model is asked once more when the silence has lasted
  ``CHECK_MS``, and that verdict decides: at or above the threshold the turn ends; below
  it but at least ``LIKELY``, the speaker has probably finished: the turn ends if the
  silence lasts ``unsure_wait_ms`` (longer than a pause for breath or thought);
- below ``LIKELY`` the pause is mid-turn: the turn ends only if the silence lasts
  ``max_wait_ms`` (the speaker is gone, or the model was wrong), so a session never hangs
  on an unfinished-sounding turn;
- the turn's words, where a session has them (``words``: the thinker's verdict on the
  words said so far, ``realtime.words_turn``), move each band down one step when they
  end a sentence: a likely-finished turn ends at once (words >= ``Eager.words_end``),
  whichever of the two verdicts comes last, and an unfinished-sounding one after
  ``unsure_wait_ms`` instead of ``max_wait_ms`` (words >= ``WORDS_END_LATE``, or the
  eagerness's own if lower). Words below leave the wait as it is.
  The second step is for the end of a sentence said with a pause in it, which Smart Turn
  mostly hears as unfinished (0.01-0.44 on the Piper voice): it waited the longest
  silence, 4 s, in 10 of 24 such sentences (docs/benchmarks.md, "Why each turn ended").
  It cannot cut a pause for thought shorter than ``unsure_wait_ms`` (1 s for "medium"),
  and the words of such a silence are asked only once it has lasted ``WORDS_LATE_MS``,
  so a pause for breath costs the thinker nothing.

The model is asked at most twice per silence: Smart Turn hears a longer trailing silence as
more "finished", so asking again and again would end every pause that lasts long enough,
which is server VAD again. The thresholds are high because Smart Turn v3's CPU build (int8)
is sure of itself: on the project's Piper voice, finished questions score 0.98 and more,
while a sentence cut at a word boundary by a 700 ms pause still scores >= 0.5 in 60% of
takes and >= 0.97 in 12% (docs/benchmarks.md); a plain 0.5 (pipecat's) would cut most such
pauses.

The clock is the audio's (window times), so every timing is exact and testable with a fake
``judge``; ``vad.VadStream`` keeps the audio and runs the real model.

The model may answer late. Without a ``judge`` the detector only asks (``take_question``),
and the verdict is given back with ``verdict`` when it comes (``vad.VadStream`` runs the
model on a worker thread, off the session's event loop): it acts as it would have at the
question, judged on the silence heard by the time it arrives, so a turn still ends where
its silence began. A verdict on a silence that is over (the user spoke again, the turn
ended, the detector was reset) is stale and dropped; a silence that lasts ``max_wait_ms``
ends the turn whether or not its verdict has come.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from omnistage.audio.server_vad import (
    HYSTERESIS,
    ServerVadParams,
    SpeechStarted,
    SpeechStopped,
    VadEvent,
    next_window,
)
from omnistage.protocol.errors import BadRequestError

log = logging.getLogger(__name__)

Eagerness = Literal["low", "medium", "high", "auto"]

# Silence before the model's deciding verdict. Smart Turn is trained on turns cut about this
# long after the speech: pipecat pairs it with a 0.2 s VAD stop, which its VAD counts in
# whole 32 ms Silero windows (round(0.2 / 0.032) = 6 windows: 192 ms). Ours did too, upward
# (7 windows, 224 ms), until 2026-12-06.
CHECK_MS = 192
# Silence at which "high" eagerness first asks, when only a sure verdict counts (4 windows).
# Offline, on four Piper takes of bench_turns.py's 8 questions and 12 paused sentences
# (bench_turn_checks.py), asking first at 100 ms ended the finished questions 185 ms after
# their last voiced frame (p50) against 278 ms, with the same 3 of 48 paused sentences cut
# off; live (bench_turns.py, 2026-12-06) it cut off 10 of 48 against 2 of 24 asked at
# 200 ms alone. So only "high", which trades cut-offs for speed, asks early.
FIRST_CHECK_MS = 128
# A question is asked this much before its silence is due: the model hears the silence so
# far repeated to the length it is asked about (``vad.VadStream``), and its verdict (30-60 ms
# of CPU) is in long before the real silence has that length. The turn still ends only once
# the real silence lasts as long (speech in the meantime makes the verdict stale), so no
# turn ends sooner for the lead; only the copied silence differs from the real one (under
# noise it tips a few more paused sentences over, below). It takes the model's time out of
# every turn's end, and moves the model off the moment the answer starts. Asked at 128 ms
# of silence (64 ms ahead, until 2026-12-06), the verdict ran just as the guess's words
# reached the thinker, and on two cores the thinker's first token took 64 ms instead of
# 11-16 (docs/benchmarks.md, "a traced turn"); asked at 64 ms of silence it runs beside
# the guess's transcription (one thread) on the other core, and is mostly in before the
# words are (which wait for it: see ``words_wanted``). Offline (bench_turn_checks.py
# --leads 64,128,160 --noise 0,30,100, 5 takes of 12 paused sentences, 2026-12-06): the
# finished questions ended as soon at every lead (p50 244-248 ms); paused sentences cut
# off, leads 64/128/160 ms, on digital silence 1/1/1 of 60, under white noise of sigma 30
# (about -60 dBFS) 6/5/6, of sigma 100 (-50 dBFS, a noisy room) 8/11/8; an earlier run of
# the same, 5/4/5 and 6/8/9. A noisy room costs a few more cut-offs at any lead; live
# (bench_turns.py) this lead cut off 0, 1 and 2 of 24.
LEAD_MS = 128
# Speech onset, prefix padding and hysteresis, as server VAD's defaults.
SPEECH = ServerVadParams()

# Below this the model hears an unfinished turn.
LIKELY = 0.5
# The words' verdict (``realtime.words_turn``: the thinker's probability that the words
# so far end a sentence) at which a turn Smart Turn calls likely finished ends at once.
# Offline on 4 Piper takes (bench_turn_words.py, 2026-12-06), Smart Turn alone ended 19
# of 32 finished questions at the deciding check and cut off 2 of 48 paused sentences;
# with words >= 0.4, 29 of 32 and the same 2; >= 0.3, 29 and 5; >= 0.1, 31 and 6. The
# paused sentence that scores highest is one whose words are a sentence as Whisper
# hears them ("Tell me a joke about it.", 0.29-0.37: the "it" is Whisper's): no
# threshold on words tells it from a finished one. "high" eagerness takes it.
WORDS_END = 0.4
WORDS_END_EAGER = 0.1
# The silence after which the words are asked about a turn Smart Turn calls unfinished
# (they can only move its end from ``max_wait_ms`` to ``unsure_wait_ms``): pauses for breath
# and between clauses (100-300 ms) are left alone, and the thinker's one-token verdict
# (tens of ms) is still in long before the unsure wait ends.
WORDS_LATE_MS = 400
# The words' verdict at which such a turn ends after the unsure wait: lower than
# ``WORDS_END``, because that wait is already a long silence. In a traced run
# (bench_turns.py, 2026-12-07), the paused sentences' ends that still waited the longest
# silence were statements and requests ("... on the weekend is a long walk.") whose words
# scored 0.06-0.20 on the default thinker; offline (bench_turn_words.py), the first halves
# of those sentences scored 0.000-0.03 but for two that are sentences themselves ("I need
# to buy some milk", 0.24-0.29). No 600-800 ms pause can be cut at this step whatever the
# words say, since the wait is longer.
WORDS_END_LATE = 0.1


@dataclass(frozen=True, slots=True)
class Eager:
    threshold: float  # the model's probability that ends the turn at once
    unsure_wait_ms: int  # the silence that ends a turn the model calls likely finished
    max_wait_ms: int  # the silence that ends any turn
    first_check_ms: int = CHECK_MS  # the silence at which the model is first asked
    # The words' verdict that ends a likely-finished turn at once (None: words are not
    # heard; "low" lets the user take their time whatever they said).
    words_end: float | None = WORDS_END


# "low" lets the user take their time; "high" answers as soon as it can. OpenAI documents
# the longest waits as 8 s, 4 s and 2 s; "auto" is "medium". Medium's threshold, offline
# on 5 Piper takes (bench_turn_checks.py, checked at 192 ms, 2026-12-06): at 0.97 5 of 60
# paused sentences cut off, at 0.975 2, at 0.98 1; finished questions' turns ended 246,
# 247 and 250 ms after their last voiced frame (p50), within 300 ms 32, 31 and 26 of 40.
EAGERNESS: dict[str, Eager] = {
    "low": Eager(0.985, 2000, 8000, words_end=None),
    "medium": Eager(0.975, 1000, 4000),
    "high": Eager(0.9, 500, 2000, FIRST_CHECK_MS, WORDS_END_EAGER),
}


@dataclass(frozen=True, slots=True)
class SemanticVadParams:
    """Realtime's ``semantic_vad`` parameters; validated on creation."""

    eagerness: Eagerness = "auto"

    def __post_init__(self) -> None:
        if self.eagerness != "auto" and self.eagerness not in EAGERNESS:
            raise BadRequestError(
                f"eagerness must be low, medium, high or auto, got {self.eagerness!r}",
                param="eagerness",
            )

    @property
    def eager(self) -> Eager:
        return EAGERNESS["medium" if self.eagerness == "auto" else self.eagerness]

    @property
    def threshold(self) -> float:
        """The end-of-turn probability at which a pause ends the turn at once."""
        return self.eager.threshold

    @property
    def first_check_ms(self) -> int:
        """The silence at which the model is first asked (a sure verdict ends the turn
        there; below ``CHECK_MS`` an unsure one waits for the deciding question)."""
        return self.eager.first_check_ms

    @property
    def max_wait_ms(self) -> int:
        """The longest silence before the turn ends whatever the model says."""
        return self.eager.max_wait_ms

    def wait_ms(self, verdict: float, words: float | None = None) -> int:
        """The silence that ends the turn, after the model's deciding ``verdict`` on it
        and the ``words``' verdict, if any (0: the silence so far)."""
        if verdict >= self.eager.threshold:
            return 0
        end = self.eager.words_end
        if end is None or words is None:
            return self.eager.max_wait_ms if verdict < LIKELY else self.eager.unsure_wait_ms
        if verdict < LIKELY:
            # Unfinished-sounding words that may end a sentence: probably a sentence said
            # with a pause in it, whose end Smart Turn does not hear as one.
            late = words >= min(end, WORDS_END_LATE)
            return self.eager.unsure_wait_ms if late else self.eager.max_wait_ms
        return 0 if words >= end else self.eager.unsure_wait_ms  # likely finished is finished

    @property
    def prefix_padding_ms(self) -> int:
        return SPEECH.prefix_padding_ms


@dataclass(frozen=True, slots=True)
class Question:
    """What the model is to hear: the turn's audio ``[start_ms, end_ms)``; ``token`` names
    the silence it is asked about (its verdict is ``verdict(token, ...)``)."""

    token: int
    start_ms: int
    end_ms: int
    silence_ms: int  # where the silence it asks about began (what the model hears of it)
    final: bool = True  # its verdict decides; else only a sure one counts


# A question -> the probability that the turn it asks about is finished.
Judge = Callable[[Question], float]


class SemanticTurnDetector:
    """Turns one session's window probabilities and the model's verdicts into turn events.

    Same contract as ``server_vad.TurnDetector``: events alternate, starting with
    ``SpeechStarted``; ``speaking`` is True exactly between the two; windows are pushed in
    order without overlap.
    """

    def __init__(self, params: SemanticVadParams, judge: Judge | None = None) -> None:
        self.params = params
        self._judge = judge  # None: questions wait for ``take_question``
        self._speech_threshold = SPEECH.threshold
        self._silence_threshold = SPEECH.threshold - HYSTERESIS
        self.speaking = False
        self._silence_from: int | None = None
        self._wait_ms: int | None = None  # the silence that ends the turn, once judged
        self._turn_start = 0
        self._next_ms = 0
        self._tokens = 0  # questions asked so far: each one's token
        self._question: Question | None = None  # this silence's latest, once asked
        self._judged = False  # whether the latest question has its verdict
        self._next_check: int | None = params.first_check_ms  # silence at which to ask next
        self._untaken: Question | None = None  # asked, not yet taken to the model
        self._words: float | None = None  # the words' verdict on this silence
        self._deciding: float | None = None  # the model's deciding verdict on it
        # The model's last verdict (for stats and tests): (probability, at ms).
        self.last_verdict: tuple[float, int] | None = None

    @property
    def silence_from(self) -> int | None:
        """While a turn is spoken: where its current silence began (None while speech holds)."""
        return self._silence_from if self.speaking else None

    def reset(self) -> None:
        self.speaking = False
        self._end_silence(None)
        self._next_ms = 0

    def _end_silence(self, silence_from: int | None) -> None:
        """A silence begins (or none holds): its question and verdict, if any, are void."""
        self._silence_from, self._wait_ms = silence_from, None
        self._question = self._untaken = None
        self._words = self._deciding = None
        self._judged, self._next_check = False, self.params.first_check_ms

    def take_question(self) -> Question | None:
        """The question asked since the last call, for the model (without a ``judge``)."""
        question, self._untaken = self._untaken, None
        return question

    def wants(self, token: int) -> bool:
        """Whether the verdict on question ``token`` still matters (its silence holds)."""
        return self._question is not None and self._question.token == token and not self._judged

    def push(self, probability: float, start_ms: int, end_ms: int) -> VadEvent | None:
        """Account one window of audio ``[start_ms, end_ms)``; the event it completes, if any."""
        self._next_ms = next_window(self._next_ms, start_ms, end_ms)
        if not self.speaking:
            if probability >= self._speech_threshold:
                self.speaking = True
                self._end_silence(None)
                self._turn_start = max(0, start_ms - self.params.prefix_padding_ms)
                return SpeechStarted(self._turn_start)
            return None
        if probability >= self._speech_threshold:
            self._end_silence(None)
        elif probability < self._silence_threshold and self._silence_from is None:
            self._end_silence(start_ms)
        if self._silence_from is None:
            return None
        due = self._next_check
        if due is not None and end_ms - self._silence_from >= due - LEAD_MS:
            self._ask(max(end_ms, self._silence_from + due), final=due >= CHECK_MS)
        return self._ended()

    def _ask(self, end_ms: int, final: bool) -> None:
        self._tokens += 1
        assert self._silence_from is not None
        question = Question(self._tokens, self._turn_start, end_ms, self._silence_from, final)
        self._question, self._judged, self._next_check = question, False, None
        if self._judge is None:
            self._untaken = question
        else:
            self._judge_now(question, self._judge(question))

    def verdict(self, token: int, probability: float) -> VadEvent | None:
        """The model's verdict on question ``token``; the event it completes, if any (none
        when the question's silence is over: the verdict is stale)."""
        if not self.wants(token):
            return None
        assert self._question is not None
        self._judge_now(self._question, probability)
        return self._ended()

    def words_wanted(self, silence_from: int) -> bool | None:
        """Whether the words' verdict on the silence from ``silence_from`` could still change
        when the turn ends: only while the model's deciding verdict leaves it not surely
        finished (None: not yet known; ask again as the silence goes on). A sure verdict
        ends the turn, so their verdict (a request to the thinker, just as the answer
        starts there) is not worth asking; under ``LIKELY`` they are wanted only once the
        silence has lasted ``WORDS_LATE_MS``."""
        if not self.speaking or self._silence_from != silence_from:
            return False  # that silence is over
        if self.params.eager.words_end is None:
            return False
        if self._deciding is None:
            return None  # the model's verdict is not in yet
        if self._deciding >= self.params.threshold:
            return False
        if self._deciding < LIKELY and self._next_ms - silence_from < WORDS_LATE_MS:
            return None  # maybe a pause for breath: asked if it lasts
        return True

    def words(self, silence_from: int, probability: float) -> VadEvent | None:
        """The words' verdict (``realtime.words_turn``) on the turn as it was when the
        silence from ``silence_from`` began; the event it completes, if any (none when
        that silence is over: the verdict is stale)."""
        if not self.speaking or self._silence_from != silence_from:
            return None
        self._words = probability
        if self._deciding is not None:
            self._decide()
        return self._ended()

    def _judge_now(self, question: Question, probability: float) -> None:
        self.last_verdict = (probability, question.end_ms)
        self._judged = True
        if question.final or probability >= self.params.threshold:
            self._deciding = probability
            self._decide()
        else:  # not sure yet: asked again where the model is trained to decide
            self._next_check = CHECK_MS

    def _decide(self) -> None:
        assert self._silence_from is not None
        assert self._question is not None and self._deciding is not None
        # Never sooner than the silence the model heard (asked ahead: LEAD_MS).
        heard_ms = self._question.end_ms - self._silence_from
        self._wait_ms = max(heard_ms, self.params.wait_ms(self._deciding, self._words))

    def _ended(self) -> SpeechStopped | None:
        """The turn's end, if its silence so far ends it."""
        assert self._silence_from is not None
        silent = self._next_ms - self._silence_from
        wait_ms = self.params.max_wait_ms if self._wait_ms is None else self._wait_ms
        if silent < wait_ms:
            return None
        # Why a turn ended, for whoever tunes these rules on their own users' speech.
        log.debug(
            "turn ended after %d ms of silence: end-of-turn %s, words %s",
            silent,
            "none" if self._deciding is None else f"{self._deciding:.3f}",
            "none" if self._words is None else f"{self._words:.3f}",
        )
        self.speaking = False
        end = self._silence_from
        self._end_silence(None)
        return SpeechStopped(end)
