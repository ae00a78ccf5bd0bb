"""Which synthesis a talker serving many answers at once runs first, and how hard.

A listener's player starts at an answer's first audio and then plays at real time: the
answer's next chunk is due when the audio sent before it has played out (``Playback``).
Two things are urgent, then: an answer's first chunk (the listener waits for it in
silence) and a later chunk whose answer is about to run dry. A later chunk with seconds
of audio still ahead of the listener can wait, and yield the cores.

``DeadlineOrder`` (the default) orders by that: later chunks with little slack (their
due time, less the synthesis they need, is within ``guard_s``) first, by due time; then
first chunks, in order of asking; then later chunks with slack, by due time. Only those
with much slack (``nice_slack_s``) run niced: a niced synthesis beside busy ones gets
a small share of a core and takes several times as long. An answer about to run dry
with no complete sentence to say is told to ``hurry``: it speaks the words it has up to
a phrase boundary, rather than wait for the sentence's end in silence.

``ChunkOrder`` is the order before it (a first chunk before later ones, otherwise in
order of asking; from the third chunk on niced), kept to measure against.

Pure state: the engine passes a clock and reports each synthesis's time.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

# An answer's chunks from this one on run niced under ``ChunkOrder``: its opening
# phrase and the sentence after it, due almost at once, run at the process's priority.
URGENT_CHUNKS = 2


@dataclass
class Playback:
    """An answer's audio as its listener plays it: from the first chunk's sending on,
    at real time."""

    started_at: float | None = None
    sent_s: float = 0.0

    def sent(self, audio_s: float, now: float) -> None:
        if self.started_at is None:
            self.started_at = now
        self.sent_s += audio_s

    @property
    def due(self) -> float | None:
        """When the audio sent so far has played out (None: nothing sent yet)."""
        return None if self.started_at is None else self.started_at + self.sent_s


_asked = itertools.count()


@dataclass
class Piece:
    """A chunk of an answer waiting to be synthesized."""

    playback: Playback
    index: int  # the answer's chunk number, from 0
    chars: int
    asked: int = field(default_factory=lambda: next(_asked))  # ties go in order of asking


class TalkerOrder(Protocol):
    def key(self, piece: Piece) -> tuple[float, ...]:
        """A free slot goes to the waiting piece with the least key, read at that time."""
        ...

    def niced(self, piece: Piece) -> bool:
        """Whether the piece, starting now, runs at the lower scheduling priority."""
        ...

    def hurry(self, playback: Playback, chars: int) -> bool:
        """Whether an answer with ``chars`` of unfinished sentence should speak them to a
        phrase boundary now rather than wait for the sentence's end."""
        ...

    def observe(self, chars: int, seconds: float) -> None:
        """A synthesis of ``chars`` characters took ``seconds``."""
        ...


class ChunkOrder:
    def key(self, piece: Piece) -> tuple[float, ...]:
        return (min(piece.index, 1), piece.asked)

    def niced(self, piece: Piece) -> bool:
        return piece.index >= URGENT_CHUNKS

    def hurry(self, playback: Playback, chars: int) -> bool:
        return False

    def observe(self, chars: int, seconds: float) -> None:
        pass


class DeadlineOrder:
    def __init__(
        self,
        clock: Callable[[], float],
        guard_s: float = 0.3,
        nice_slack_s: float = 2.0,
        hurry_s: float = 0.5,
        char_s: float = 0.004,
    ) -> None:
        """``char_s``: the first guess of synthesis seconds per character (Piper on one
        thread of a quiet core: ~0.003), then a moving average of what they took."""
        self._clock = clock
        self.guard_s = guard_s
        self.nice_slack_s = nice_slack_s
        self.hurry_s = hurry_s
        self.char_s = char_s

    def slack(self, piece: Piece) -> float | None:
        """Seconds to spare if the piece started now (None: a first chunk, due at once)."""
        due = piece.playback.due
        if due is None:
            return None
        return due - self._clock() - piece.chars * self.char_s

    def key(self, piece: Piece) -> tuple[float, ...]:
        slack = self.slack(piece)
        if slack is None:
            return (1, piece.asked)
        due = piece.playback.due
        assert due is not None
        return (0 if slack < self.guard_s else 2, due, piece.asked)

    def niced(self, piece: Piece) -> bool:
        slack = self.slack(piece)
        return slack is not None and slack >= self.nice_slack_s

    def hurry(self, playback: Playback, chars: int) -> bool:
        due = playback.due
        return due is not None and due - self._clock() < chars * self.char_s + self.hurry_s

    def observe(self, chars: int, seconds: float) -> None:
        if chars > 0:
            self.char_s += 0.2 * (seconds / chars - self.char_s)
