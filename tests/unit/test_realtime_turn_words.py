"""A session's audio input asks whether each silence's words end the turn (semantic_vad):
the real ``AudioInput``, ``UserTurn``, ``VadStream`` and detector, with a loudness scorer
for Silero, a fixed Smart Turn verdict, a listener that hears fixed words, and a scripted
words judge."""

from __future__ import annotations

import asyncio
import base64
from typing import Any

import numpy as np

from omnistage.audio.formats import PCM
from omnistage.audio.semantic_vad import EAGERNESS, WORDS_LATE_MS, SemanticVadParams
from omnistage.audio.vad import VadParams, VadStream
from omnistage.audio.verdicts import VerdictPool
from omnistage.realtime.audio_input import AudioInput
from omnistage.realtime.config import TurnDetection
from omnistage.realtime.user_turn import UserTurn
from tests.unit.test_realtime_vad_stream import LoudScorer, pcm

RATE = 24_000
FRAME = RATE // 50  # 20 ms
WORDS = "What is the capital of France?"


class Phrase:
    """A ``TurnListener`` that hears ``WORDS`` in whatever it is fed."""

    def feed(self, pcm: bytes) -> None:
        pass

    async def finish(self) -> str:
        return WORDS

    def close(self) -> None:
        pass


class Heard:
    """The session's side: the turns' ends, as (audio end ms, silence heard ms)."""

    def __init__(self) -> None:
        self.stopped: list[tuple[int, float]] = []

    def speech_started(self, turn: UserTurn, start_ms: int) -> None: ...
    def paused(self, turn: UserTurn) -> None: ...
    def resumed(self, turn: UserTurn) -> None: ...
    def unguessed(self, turn: UserTurn) -> None: ...

    def speech_stopped(self, turn: UserTurn, end_ms: int, silence_ms: float) -> None:
        self.stopped.append((end_ms, silence_ms))


async def _silence_heard(
    words_verdict: float | None,
    smart_turn: float,
    guess: bool,
    eagerness: str = "auto",
    pool: VerdictPool | None = None,
    pause_s: float | None = None,
) -> tuple[float, list[str]]:
    """A second of tone then silence, fed at 20 ms a chunk: the silence heard when the
    turn ended, and the words the judge was asked (Smart Turn's verdict given at once,
    or with a ``pool``, as the session has it, on a worker thread, late). With
    ``pause_s``, the tone goes on after that much silence, and the silence is 0 where the
    turn did not end in the pause."""
    asked: list[str] = []

    async def judge(words: str) -> float | None:
        asked.append(words)
        return words_verdict

    def vad(params: VadParams) -> VadStream:
        return VadStream(params, vad=LoudScorer(), judge=lambda audio: smart_turn, verdicts=pool)

    def new_turn(item_id: str, start_ms: float) -> UserTurn:
        return UserTurn(item_id, start_ms, lambda: Phrase())  # type: ignore[arg-type,return-value]

    heard = Heard()
    tasks: list[asyncio.Task[Any]] = []
    audio = AudioInput(
        heard,
        new_turn,
        vad,
        lambda coro: tasks.append(asyncio.ensure_future(coro)),
        guess=lambda: guess,
        words=judge,
    )
    audio.configure(PCM, TurnDetection(SemanticVadParams(eagerness)))  # type: ignore[arg-type]
    pause = () if pause_s is None else ((pause_s, 0), (0.5, 0.5))
    data = pcm(RATE, (0.5, 0), (1, 0.5), *pause, (5, 0))
    step = FRAME * 2
    for i in range(0, len(data), step):
        audio.append(base64.b64encode(data[i : i + step]).decode())
        for _ in range(5):  # the words come back within a frame, as a quick thinker's
            await asyncio.sleep(0)
        if pool is not None:  # the verdict's thread, within the frame too
            await asyncio.sleep(0.01)
        if heard.stopped or (pause_s is not None and i >= (1.75 + pause_s) * RATE * 2):
            break
    for task in tasks:
        task.cancel()
    if pause_s is not None and not heard.stopped:
        return 0.0, asked
    assert heard.stopped, "the turn never ended"
    end_ms, silence_ms = heard.stopped[0]
    assert np.isclose(end_ms, 1504, atol=32)  # where the tone stopped
    return silence_ms, asked


async def test_words_that_end_a_sentence_end_a_likely_finished_turn_at_the_check() -> None:
    wait = EAGERNESS["medium"].unsure_wait_ms
    for guess in (True, False):  # the guess's words, or the paused phrase's
        silence_ms, asked = await _silence_heard(0.6, 0.7, guess)
        assert asked == [WORDS]  # once for the one silence
        assert silence_ms < 300, guess  # at the deciding check (192 ms), not after 1 s
    silence_ms, asked = await _silence_heard(0.05, 0.7, True)
    assert asked == [WORDS] and silence_ms >= wait  # words of a fragment: the wait stands


async def test_without_words_that_end_a_sentence_the_wait_stands() -> None:
    medium = EAGERNESS["medium"]
    for words_verdict, smart_turn, wait in ((None, 0.7, 1000), (0.05, 0.3, 4000)):
        silence_ms, _ = await _silence_heard(words_verdict, smart_turn, True)
        assert silence_ms >= wait, (words_verdict, smart_turn)
    silence_ms, asked = await _silence_heard(0.9, 0.7, True, eagerness="low")
    assert silence_ms >= EAGERNESS["low"].unsure_wait_ms and asked == []  # not heard
    assert medium.unsure_wait_ms == 1000 and medium.max_wait_ms == 4000


async def test_words_that_end_a_sentence_end_an_unfinished_sounding_turn_after_a_second() -> None:
    # A sentence said with a pause in it, at its end: Smart Turn hears it unfinished (0.3),
    # its words end a sentence. The thinker is asked once the pause has lasted, and the
    # turn ends after the unsure second, not the longest silence (4 s).
    wait = EAGERNESS["medium"].unsure_wait_ms
    for guess in (True, False):
        silence_ms, asked = await _silence_heard(0.9, 0.3, guess)
        assert asked == [WORDS], guess
        assert wait <= silence_ms < wait + 100, guess


async def test_a_short_unfinished_sounding_pause_costs_the_thinker_nothing() -> None:
    # A 300 ms pause mid-sentence, heard as unfinished: the words are held for the
    # pause to last WORDS_LATE_MS, it does not, and they are dropped unasked.
    assert WORDS_LATE_MS > 300
    silence_ms, asked = await _silence_heard(0.9, 0.3, True, pause_s=0.3)
    assert silence_ms == 0 and asked == []  # not cut off, not asked
    # A 700 ms pause for thought: asked, and still not cut off (the wait is a second).
    silence_ms, asked = await _silence_heard(0.9, 0.3, True, pause_s=0.7)
    assert silence_ms == 0 and asked == [WORDS]


async def test_a_sure_verdict_spares_the_thinker_the_words() -> None:
    # The guess's words are in (first silent window) before Smart Turn is asked (64 ms):
    # they wait for its verdict, which is sure: the turn ends at the check, unasked.
    for guess in (True, False):
        silence_ms, asked = await _silence_heard(0.9, 0.99, guess)
        assert asked == [] and silence_ms < 300, guess


async def test_words_in_before_a_late_verdict_are_judged_once_it_leaves_the_turn_unsure() -> None:
    pool = VerdictPool()
    silence_ms, asked = await _silence_heard(0.6, 0.7, True, pool=pool)
    assert asked == [WORDS] and silence_ms < 300
    silence_ms, asked = await _silence_heard(0.6, 0.99, True, pool=pool)
    assert asked == [] and silence_ms < 300
