"""Semantic turn detection: the turn ends when an end-of-turn model says the speaker is done.

This is Realtime's ``turn_detection: {"type": "semantic_vad", "eagerness"}`` as a pure state
machine, the counterpart of ``server_vad.TurnDetector``. Silero's window probabilities say
where speech starts and where a silence begins (with the same threshold and hysteresis as
server VAD); what a silence means is the model's call:

- once a silence has lasted ``CHECK_MS``, the detector asks ``judge(turn_start_ms, now_ms)``
  for the probability that the turn's audio so far is a finished turn;
- at or above the eagerness's ``threshold`` the turn ends at once, where the silence began;
- below it but at least ``LIKELY``, the speaker has probably finished: the turn ends if the
  silence lasts ``unsure_wait_ms`` (longer than a pause for breath or thought);
- below ``LIKELY`` the pause is mid-turn: the turn ends only if the silence lasts
  ``max_wait_ms`` (the speaker is gone, or the model was wrong), so a session never hangs
  on an unfinished-sounding turn.

The model is asked once per silence: Smart Turn hears a longer trailing silence as more
"finished", so asking again and again would end every pause that lasts long enough, which is
server VAD again. The thresholds are high because Smart Turn v3's CPU build (int8) is sure of
itself: on the project's Piper voice, finished questions score 0.98 and more, while a
sentence cut at a word boundary by a 700 ms pause still scores >= 0.5 in 60% of takes and
>= 0.97 in 12% (docs/benchmarks.md); a plain 0.5 (pipecat's) would cut most such pauses.

The clock is the audio's (window times), so every timing is exact and testable with a fake
``judge``; ``vad.VadStream`` keeps the audio and runs the real model.
"""

from __future__ import annotations

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

Eagerness = Literal["low", "medium", "high", "auto"]

# Silence before the model is asked. Smart Turn is trained on turns cut about this long after
# the speech (pipecat pairs it with a 0.2 s VAD stop); much less and a finished question
# sounds unfinished to it.
CHECK_MS = 200
# Speech onset, prefix padding and hysteresis, as server VAD's defaults.
SPEECH = ServerVadParams()

# Below this the model hears an unfinished turn.
LIKELY = 0.5


@dataclass(frozen=True, slots=True)
class Eager:
    threshold: float  # the model's probability that ends the turn at once
    unsure_wait_ms: int  # the silence that ends a turn the model calls likely finished
    max_wait_ms: int  # the silence that ends any turn


# "low" lets the user take their time; "high" answers as soon as it can. OpenAI documents
# the longest waits as 8 s, 4 s and 2 s; "auto" is "medium".
EAGERNESS: dict[str, Eager] = {
    "low": Eager(0.985, 2000, 8000),
    "medium": Eager(0.97, 1000, 4000),
    "high": Eager(0.9, 500, 2000),
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
    def max_wait_ms(self) -> int:
        """The longest silence before the turn ends whatever the model says."""
        return self.eager.max_wait_ms

    def wait_ms(self, verdict: float) -> int:
        """The silence that ends the turn, after the model's ``verdict`` on it."""
        if verdict >= self.eager.threshold:
            return CHECK_MS
        return self.eager.unsure_wait_ms if verdict >= LIKELY else self.eager.max_wait_ms

    @property
    def prefix_padding_ms(self) -> int:
        return SPEECH.prefix_padding_ms


# (turn's audio start ms, audio end ms) -> probability that the turn is finished.
Judge = Callable[[int, int], float]


class SemanticTurnDetector:
    """Turns one session's window probabilities and the model's verdicts into turn events.

    Same contract as ``server_vad.TurnDetector``: events alternate, starting with
    ``SpeechStarted``; ``speaking`` is True exactly between the two; windows are pushed in
    order without overlap.
    """

    def __init__(self, params: SemanticVadParams, judge: Judge) -> None:
        self.params = params
        self._judge = judge
        self._speech_threshold = SPEECH.threshold
        self._silence_threshold = SPEECH.threshold - HYSTERESIS
        self.speaking = False
        self._silence_from: int | None = None
        self._wait_ms: int | None = None  # the silence that ends the turn, once judged
        self._turn_start = 0
        self._next_ms = 0
        # The model's last verdict (for stats and tests): (probability, at ms).
        self.last_verdict: tuple[float, int] | None = None

    @property
    def silence_from(self) -> int | None:
        """While a turn is spoken: where its current silence began (None while speech holds)."""
        return self._silence_from if self.speaking else None

    def reset(self) -> None:
        self.speaking = False
        self._silence_from = None
        self._wait_ms = None
        self._next_ms = 0

    def push(self, probability: float, start_ms: int, end_ms: int) -> VadEvent | None:
        """Account one window of audio ``[start_ms, end_ms)``; the event it completes, if any."""
        self._next_ms = next_window(self._next_ms, start_ms, end_ms)
        if not self.speaking:
            if probability >= self._speech_threshold:
                self.speaking = True
                self._silence_from = None
                self._wait_ms = None
                self._turn_start = max(0, start_ms - self.params.prefix_padding_ms)
                return SpeechStarted(self._turn_start)
            return None
        if probability >= self._speech_threshold:
            self._silence_from, self._wait_ms = None, None
        elif probability < self._silence_threshold and self._silence_from is None:
            self._silence_from = start_ms
        if self._silence_from is None:
            return None
        silent = end_ms - self._silence_from
        if silent >= CHECK_MS and self._wait_ms is None:
            verdict = self._judge(self._turn_start, end_ms)
            self.last_verdict = (verdict, end_ms)
            self._wait_ms = self.params.wait_ms(verdict)
        if self._wait_ms is not None and silent >= self._wait_ms:
            return self._stop()
        return None

    def _stop(self) -> SpeechStopped:
        assert self._silence_from is not None
        self.speaking = False
        end, self._silence_from, self._wait_ms = self._silence_from, None, None
        return SpeechStopped(end)
