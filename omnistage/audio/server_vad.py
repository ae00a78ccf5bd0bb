"""Server-VAD turn detection: speech probabilities per window in, turn events out.

This is Realtime's ``turn_detection: {"type": "server_vad", threshold, prefix_padding_ms,
silence_duration_ms}`` as a pure state machine. It knows nothing about audio or models: the
caller (``vad.VadStream``) scores each fixed-size window with Silero and pushes the
probability with the window's position in the session's audio, so every timing here is
exact and unit-testable with synthetic probability sequences.

Hysteresis, as Silero's own ``get_speech_timestamps`` does it: a turn starts on a window
scoring >= ``threshold`` but only ends once windows score below ``threshold - 0.15``. Speech
probabilities wobble around the threshold inside words (unvoiced consonants, soft endings);
a single cut-off would open a silence countdown on each dip, and a dip followed by a quiet
stretch would end the turn mid-sentence. Windows in the band between the two thresholds
continue whatever is under way: they neither start a turn nor reset a running silence.
"""

from __future__ import annotations

from dataclasses import dataclass

from omnistage.protocol.errors import BadRequestError

# How far below ``threshold`` a window must score to count as silence (Silero's default).
HYSTERESIS = 0.15
# Lowest silence threshold, so a tiny ``threshold`` still lets a turn end (as Silero).
MIN_SILENCE_THRESHOLD = 0.01


def next_window(pushed_ms: int, start_ms: int, end_ms: int) -> int:
    """Where the audio pushed so far ends once window ``[start_ms, end_ms)`` is taken;
    a ValueError if the window is empty or overlaps what was pushed (up to ``pushed_ms``)."""
    if end_ms <= start_ms or start_ms < pushed_ms:
        raise ValueError(
            f"window [{start_ms}, {end_ms}) is empty or overlaps audio already pushed "
            f"(up to {pushed_ms} ms)"
        )
    return end_ms


@dataclass(frozen=True, slots=True)
class ServerVadParams:
    """Realtime's ``server_vad`` parameters, with OpenAI's defaults; validated on creation."""

    threshold: float = 0.5
    prefix_padding_ms: int = 300
    silence_duration_ms: int = 500

    def __post_init__(self) -> None:
        # bool is an int subclass; True as a duration is a client bug, not 1 ms.
        if isinstance(self.threshold, bool) or not isinstance(self.threshold, int | float):
            raise BadRequestError("threshold must be a number", param="threshold")
        if not 0.0 <= self.threshold <= 1.0:
            raise BadRequestError(
                f"threshold must be between 0 and 1, got {self.threshold}", param="threshold"
            )
        for name in ("prefix_padding_ms", "silence_duration_ms"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise BadRequestError(f"{name} must be an integer >= 0, got {value!r}", param=name)

    @property
    def silence_threshold(self) -> float:
        """Probability below which a window counts as silence (``threshold`` minus hysteresis)."""
        return min(self.threshold, max(self.threshold - HYSTERESIS, MIN_SILENCE_THRESHOLD))


@dataclass(frozen=True, slots=True)
class SpeechStarted:
    """A turn began; ``audio_start_ms`` is already moved back by ``prefix_padding_ms``."""

    audio_start_ms: int


@dataclass(frozen=True, slots=True)
class SpeechStopped:
    """A turn ended; ``audio_end_ms`` is where its trailing silence began."""

    audio_end_ms: int


VadEvent = SpeechStarted | SpeechStopped


class TurnDetector:
    """Turns one session's window probabilities into ``SpeechStarted``/``SpeechStopped``.

    Invariants: events alternate, starting with ``SpeechStarted``; ``speaking`` is True
    exactly between the two. Windows must be pushed in order, without overlap.
    """

    def __init__(self, params: ServerVadParams | None = None) -> None:
        self.params = params or ServerVadParams()
        self._silence_threshold = self.params.silence_threshold
        self.speaking = False
        # Start (ms) of the first silent window of the current run, None while speech holds.
        self._silence_from: int | None = None
        self._next_ms = 0

    @property
    def silence_from(self) -> int | None:
        """While a turn is spoken: where its current run of silence began (None while
        speech holds). The turn ends here if the silence lasts ``silence_duration_ms``."""
        return self._silence_from if self.speaking else None

    def reset(self) -> None:
        """Forget any turn under way (the audio position is the caller's to keep)."""
        self.speaking = False
        self._silence_from = None
        self._next_ms = 0

    def push(self, probability: float, start_ms: int, end_ms: int) -> VadEvent | None:
        """Account one window of audio ``[start_ms, end_ms)``; the event it completes, if any."""
        self._next_ms = next_window(self._next_ms, start_ms, end_ms)
        params = self.params
        if not self.speaking:
            if probability >= params.threshold:
                self.speaking = True
                self._silence_from = None
                return SpeechStarted(max(0, start_ms - params.prefix_padding_ms))
            return None
        if probability >= params.threshold:
            self._silence_from = None
        elif probability < self._silence_threshold and self._silence_from is None:
            self._silence_from = start_ms
        if self._silence_from is not None and end_ms - self._silence_from >= (
            params.silence_duration_ms
        ):
            self.speaking = False
            end, self._silence_from = self._silence_from, None
            return SpeechStopped(end)
        return None
