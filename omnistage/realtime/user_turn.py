"""A user turn as it is spoken, transcribed phrase by phrase.

A turn's audio goes to the listener in phrases: a phrase ends where the user pauses
(the session decides: a silence of ``PAUSE_MS``, shorter than the VAD's turn-ending
silence), and its transcription starts at once while the session waits to see whether
the turn has ended. If the user goes on, the next phrase starts with the audio after
the pause. So when the turn does end, its words are already transcribed, or nearly:
each phrase is transcribed once, and only the last one after the user's last pause.

Where the session has cores to spare (``guess``), the phrase is transcribed sooner still:
as the user goes quiet, before the pause is long enough to end it, in a request of its
own (a *guess*). If the pause lasts, the phrase takes the guess's words (its own request
is dropped), which come up to ``PAUSE_MS`` sooner; if the user goes on, the guess is
dropped and the phrase goes on as before. The guess hears the same words (only the
pause's silence is missing), and a dip between words costs one transcription. When the
guess's words are in while the silence still holds, ``on_guess`` is told: the session
may start answering on them (``guessed_so_far``) before the pause ends the phrase.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from omnistage.realtime.listening import TurnListener

# A pause this long ends a phrase (and lets the session start answering early). Shorter
# pauses split words: at 60 ms a plosive's closure in telephone audio cut "capital" in
# two ("What is the cap? France."). With the guess below, the phrase is already being
# transcribed when its pause reaches this, and the answer may already have started on
# the guess's words (20-40 ms sooner: a guess takes ~65 ms of a quiet core and starts
# with the first silent 32 ms VAD window).
PAUSE_MS = 120
# Guesses are made while a process serves at most this many sessions: each dip between
# words costs a transcription, which many sessions at once cannot spare.
GUESS_MAX_SESSIONS = 4


class UserTurn:
    def __init__(
        self,
        item_id: str,
        start_ms: float,
        listener: Callable[[], TurnListener | None],
        on_text: Callable[[str], None] | None = None,
        keep_audio: bool = False,
        on_guess: Callable[[UserTurn], None] | None = None,
    ) -> None:
        self.item_id = item_id
        self.start_ms = start_ms
        self._listener = listener
        self._on_text = on_text
        self._on_guess = on_guess  # a guess's words are in and its silence holds
        self._phrase: TurnListener | None = None
        self._phrase_pcm: list[bytes] = []  # the open phrase's audio, for a guess
        self._guess: tuple[TurnListener, asyncio.Task[str]] | None = None
        self._speaking = False  # audio fed since the last pause
        self._phrases: list[asyncio.Task[str]] = []
        self._heard: list[str] = []  # the transcripts of finished phrases, in order
        self.fed_ms = start_ms  # session audio time up to which the turn has audio
        # The turn's audio, for a thinker that hears it itself (None: not kept).
        self._audio: list[bytes] | None = [] if keep_audio else None

    @property
    def in_phrase(self) -> bool:
        """A phrase is being spoken to someone who hears it (a listener, or the thinker
        that keeps the audio); a turn nobody hears has no phrases."""
        return self._speaking and (self._phrase is not None or self._audio is not None)

    @property
    def phrases(self) -> int:
        return len(self._phrases)

    def feed(self, pcm: bytes, ms: float) -> None:
        """More of the turn's audio (``ms`` of it), into the phrase being spoken."""
        if not self._speaking:
            self._speaking = True
            self._phrase = self._listener()
            self._phrase_pcm = []
        if self._phrase is not None:
            self._phrase.feed(pcm)
            self._phrase_pcm.append(pcm)
        if self._audio is not None:
            self._audio.append(pcm)
        self.fed_ms += ms

    def audio(self) -> bytes | None:
        """The turn's audio so far (24 kHz pcm16), where it is kept."""
        return None if self._audio is None else b"".join(self._audio)

    def guess(self) -> None:
        """The user has just gone quiet: transcribe the phrase so far now, in case the
        pause ends it (once per silence; see the module's docstring)."""
        if self._guess is not None or self._phrase is None or not self._speaking:
            return
        listener = self._listener()
        if listener is None:
            return
        listener.feed(b"".join(self._phrase_pcm))
        guess = self._guess = (listener, asyncio.ensure_future(listener.finish()))
        guess[1].add_done_callback(lambda _: self._guessed(guess))

    def _guessed(self, guess: tuple[TurnListener, asyncio.Task[str]]) -> None:
        # Still standing: neither ended into its phrase nor void (the silence holds).
        words = guess[1]
        standing = guess is self._guess and self._on_guess is not None
        if standing and not words.cancelled() and words.exception() is None and words.result():
            assert self._on_guess is not None
            self._on_guess(self)

    @property
    def guessing(self) -> bool:
        """A guess stands for the open phrase (its pause has not ended it yet)."""
        return self._guess is not None

    def unguess(self) -> bool:
        """The user went on: the guess is void (True if there was one)."""
        guess, self._guess = self._guess, None
        if guess is not None:
            guess[0].close()
            guess[1].cancel()
        return guess is not None

    def end_phrase(self) -> None:
        """The user paused: transcribe the phrase so far (or take its guess's words)."""
        self._speaking = False
        phrase, self._phrase = self._phrase, None
        guess, self._guess = self._guess, None
        if phrase is None:
            return
        if guess is not None:
            phrase.close()
        index = len(self._phrases)
        self._heard.append("")
        words = guess[1] if guess is not None else None
        task = asyncio.ensure_future(self._hear(phrase, index, words))
        self._phrases.append(task)

    async def _hear(
        self, phrase: TurnListener, index: int, guessed: asyncio.Task[str] | None
    ) -> str:
        # Earlier phrases first, so the text arrives in the order it was said.
        if index:
            await asyncio.gather(self._phrases[index - 1], return_exceptions=True)
        text = await (guessed if guessed is not None else phrase.finish())
        self._heard[index] = text
        if text and self._on_text is not None:
            self._on_text(text if index == 0 or not any(self._heard[:index]) else " " + text)
        return text

    async def heard_so_far(self) -> str:
        """The words of the phrases ended so far, once they are transcribed."""
        results = await asyncio.gather(*self._phrases, return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result
        return " ".join(t for t in self._heard if t).strip()

    async def guessed_so_far(self) -> str:
        """``heard_so_far`` and the standing guess's words after them (the phrase the
        guess stands for counts as ended: ``phrases`` + 1)."""
        guess = self._guess
        heard = await self.heard_so_far()
        if guess is None:
            return heard
        return f"{heard} {await guess[1]}".strip()

    async def transcript(self) -> str:
        """Every phrase's words, once all are transcribed (ends the open phrase)."""
        self.end_phrase()
        return await self.heard_so_far()

    def close(self) -> None:
        """The turn was dropped: free what the listener holds for it."""
        self._speaking = False
        self.unguess()
        if self._phrase is not None:
            self._phrase.close()
            self._phrase = None
        for task in self._phrases:
            task.cancel()
