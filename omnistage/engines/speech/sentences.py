"""What the TTS engine speaks at a time: a prompt, or text streaming in, cut into the
pieces it synthesizes one by one (pure: no audio).

With sentence streaming on, each complete sentence goes as soon as it is written, and
before the first one an opening clause (or phrase) that is complete: the listener hears
the start while the rest is still being written. Later, a sentence may be cut at a
phrase boundary too (``phrase``) when the talker says the listener is about to run dry.
Off, the text is spoken whole.
"""

from __future__ import annotations

from omnistage.audio.wav import split_first_clause, split_first_phrase, split_sentences


def prompt_pieces(text: str, sentence_streaming: bool) -> list[str]:
    """A whole text's pieces, in order (none for blank text)."""
    if not sentence_streaming:
        return [text.strip()] if text.strip() else []
    sentences, rest = split_sentences(text)
    if rest.strip():
        sentences.append(rest.strip())
    return sentences


class StreamedPieces:
    """Text deltas in, the pieces ready to speak out; ``rest`` is what is left at the end."""

    def __init__(self, sentence_streaming: bool, first_phrase: bool) -> None:
        self._streaming = sentence_streaming
        self._opening = split_first_phrase if first_phrase else split_first_clause
        self._buffer = ""
        self._spoken_any = False
        self.opening: str | None = None  # the opening clause or phrase, spoken alone

    def add(self, text: str) -> list[str]:
        self._buffer += text
        if not self._streaming:
            return []
        sentences, self._buffer = split_sentences(self._buffer)
        if not self._spoken_any and not sentences:
            # Nothing said yet: an opening clause (or phrase) is worth speaking alone.
            clause, self._buffer = self._opening(self._buffer)
            sentences = [clause] if clause else []
            self.opening = clause
        self._spoken_any = self._spoken_any or bool(sentences)
        return sentences

    @property
    def pending(self) -> int:
        """Characters written but not spoken yet (an unfinished sentence)."""
        return len(self._buffer.strip())

    def phrase(self) -> list[str]:
        """The unfinished sentence's words up to a phrase boundary, to speak now (an
        answer about to run dry): none if there is no boundary yet."""
        phrase, self._buffer = split_first_phrase(self._buffer)
        return [phrase] if phrase else []

    def rest(self) -> str:
        return self._buffer.strip()


class SpokenBefore:
    """On a retry, the pieces a failed replica already spoke (``EngineRequest.resume_text``
    is their text, joined): skipped without synthesis, so the answer's audio goes on after
    one piece's synthesis, not after all of them again.

    Pieces are cut the same way on every try (the same text deltas arrive in the same
    order: the head replays them), so what was spoken is a prefix of whole pieces. Should
    a piece still straddle it, its audio is spoken whole and only its text is cut."""

    def __init__(self, spoken: str) -> None:
        self._left = spoken

    def skip(self, piece: str) -> bool:
        """Whether ``piece`` was spoken whole already."""
        if self._left and piece and self._left.startswith(piece):
            self._left = self._left[len(piece) :]
            return True
        return False

    def new_text(self, piece: str) -> str:
        """The part of a piece not skipped whose text the client has not seen."""
        cut = min(len(self._left), len(piece))
        self._left = self._left[cut:]
        return piece[cut:]


class SynthesisPace:
    """How fast this replica synthesizes now (seconds of synthesis, wall clock, per
    second of audio: a moving average), and whether an answer's opening phrase may go out
    alone. Alone, the opening (~1 s of audio) leaves the next piece ~1 s to be written
    and synthesized; on busy cores (synthesis at 1/4 of its idle speed and worse) it
    came late, and the player ran dry: in a chaos run at load 8-11, 54 of 57 stalls over
    1 s sat right after the opening. Slower than ``limit``, the opening is held and goes
    out with the next piece, as if it had not been cut (the pieces stay the same, so a
    retry skips the same ones).

    "Busy" is measured against this machine's own idle speed (the fastest synthesis seen,
    ``best``), not a fixed one: ``slowdown`` times it, within ``floor`` and ``ceiling``.
    Piper's joe voice runs ~40x real time on an AVX-512 VM (0.025: the limit is the floor,
    0.1, as before) but ~8x on an AVX2-only Zen 3 (0.11-0.13 idle), where a fixed 0.1 held
    the opening of most answers on an idle machine, ~0.3-0.5 s of first audio each
    (docs/benchmarks.md). There the limit is twice its idle pace, at most 0.2 (5x real
    time): with 4x and 0.25, eight sessions at once (an overload there) kept sending
    openings alone, each starting a playback clock the talker then served first, and
    the other answers' first audio came twice as late (p90 7-8 s against 4-5 s)."""

    def __init__(
        self,
        floor: float = 0.1,
        weight: float = 0.2,
        slowdown: float = 2.0,
        ceiling: float = 0.2,
    ) -> None:
        self.floor, self.slowdown, self.ceiling = floor, slowdown, ceiling
        self._weight = weight
        self.ratio = 0.0  # nothing measured yet: taken for idle
        self.best: float | None = None  # the fastest synthesis seen: the idle speed

    @property
    def limit(self) -> float:
        if self.best is None:
            return self.floor
        return min(self.ceiling, max(self.floor, self.slowdown * self.best))

    def record(self, wall_s: float, audio_s: float) -> None:
        if audio_s > 0:
            ratio = wall_s / audio_s
            self.best = ratio if self.best is None else min(self.best, ratio)
            self.ratio += self._weight * (ratio - self.ratio)

    def opening_alone(self) -> bool:
        return self.ratio <= self.limit
