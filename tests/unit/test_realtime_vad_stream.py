"""VadStream's bytes, clock and resampling, with a loudness scorer in place of Silero."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from omnistage.audio.semantic_vad import CHECK_MS, LEAD_MS, SemanticVadParams
from omnistage.audio.server_vad import ServerVadParams, SpeechStarted, SpeechStopped
from omnistage.audio.vad import WINDOW, VadStream
from omnistage.audio.verdicts import VerdictPool


class LoudScorer:
    """1.0 for each full 512-sample window whose mean magnitude exceeds 0.1, else 0.0."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.pending = np.zeros(0, dtype=np.float32)
        self.resets = getattr(self, "resets", -1) + 1

    def score(self, audio: np.ndarray) -> np.ndarray:
        audio = np.concatenate([self.pending, audio])
        count = len(audio) // WINDOW
        self.pending = audio[count * WINDOW :]
        windows = audio[: count * WINDOW].reshape(count, WINDOW)
        return (np.abs(windows).mean(axis=1) > 0.1).astype(np.float32)


def pcm(rate: int, *parts: tuple[float, float]) -> bytes:
    """PCM16 of (seconds, amplitude) parts: amplitude 0 is silence, else a 440 Hz tone."""
    out = []
    for seconds, amplitude in parts:
        t = np.arange(round(seconds * rate)) / rate
        out.append(amplitude * np.sin(2 * np.pi * 440 * t))
    return (np.concatenate(out) * 32767).astype("<i2").tobytes()


def feed_in(stream: VadStream, data: bytes, sizes: list[int]) -> list:
    events, i, k = [], 0, 0
    while i < len(data):
        size = sizes[k % len(sizes)]
        events += stream.feed(data[i : i + size])
        i, k = i + size, k + 1
    return events


# One second of silence, one of tone, one of silence: the tone's first 16 kHz sample is
# 16000, inside window 31 (992..1024 ms, mostly tone); its last window is 62 (1984..2016 ms).
TURN = [SpeechStarted(992 - 300), SpeechStopped(2016)]


@pytest.mark.parametrize("rate", [16_000, 24_000])
def test_a_tone_between_silences_is_one_turn_at_exact_times(rate: int) -> None:
    stream = VadStream(sample_rate=rate, vad=LoudScorer())
    assert stream.feed(pcm(rate, (1, 0), (1, 0.5), (1, 0))) == TURN
    assert stream.audio_ms == 3000


@pytest.mark.parametrize("sizes", [[1, 1001], [7, 960, 3], [961], [4801, 2]])
def test_any_split_of_the_bytes_gives_the_same_events(sizes: list[int]) -> None:
    data = pcm(24_000, (1, 0), (1, 0.5), (1, 0))
    stream = VadStream(vad=LoudScorer())
    assert feed_in(stream, data[: 24_000 * 2 * 2], sizes) == TURN[:1]
    assert feed_in(stream, data[24_000 * 2 * 2 :], sizes) == TURN[1:]


def test_odd_bytes_wait_for_their_pair_and_the_clock_counts_whole_samples() -> None:
    stream = VadStream(vad=LoudScorer())
    assert stream.feed(b"\x01\x00\x02") == []
    assert stream.audio_ms == pytest.approx(1000 / 24_000)
    stream.feed(b"\x00")
    assert stream.audio_ms == pytest.approx(2000 / 24_000)


def test_reset_forgets_the_turn_but_keeps_the_session_clock() -> None:
    scorer = LoudScorer()
    stream = VadStream(ServerVadParams(prefix_padding_ms=0), vad=scorer)
    assert stream.feed(pcm(24_000, (0.512, 0), (0.488, 0.5))) == [SpeechStarted(512)]
    assert stream.speaking
    stream.reset()
    assert not stream.speaking and scorer.resets == 1
    # Windows restart at the reset point (1000 ms): the next turn is timed from there.
    events = stream.feed(pcm(24_000, (0.256, 0), (0.5, 0.5), (1, 0)))
    assert events == [SpeechStarted(1256), SpeechStopped(1768)]


def test_unsupported_rates_are_refused() -> None:
    with pytest.raises(ValueError, match="sample_rate"):
        VadStream(sample_rate=44_100, vad=LoudScorer())


def sure_model(heard: list[np.ndarray]) -> Callable[[np.ndarray], float]:
    """An end-of-turn model always sure the turn is done, keeping what it heard."""

    def model(audio: np.ndarray) -> float:
        heard.append(audio)
        return 1.0

    return model


def test_semantic_vad_hears_the_turns_own_audio_and_ends_it_on_the_models_word() -> None:
    heard: list[np.ndarray] = []
    model = sure_model(heard)
    stream = VadStream(SemanticVadParams(), 24_000, vad=LoudScorer(), judge=model)
    data = pcm(24_000, (1, 0), (1, 0.5), (1, 0))
    assert feed_in(stream, data, [961]) == TURN
    # The model heard the turn from its prefix padding to CHECK_MS into the silence (at
    # 16 kHz): from 692 ms, 308 ms of quiet, the tone's second, then the quiet it judges.
    (audio,) = heard
    assert len(audio) == pytest.approx((2016 + CHECK_MS - 692) * 16, abs=WINDOW)
    loud = np.nonzero(np.abs(audio) > 0.1)[0]
    assert loud[0] == pytest.approx(308 * 16, abs=32) and loud[-1] == pytest.approx(
        1308 * 16, abs=32
    )
    # After a reset the kept audio starts again from the reset's clock.
    stream.reset()
    assert feed_in(stream, data, [4801]) == [SpeechStarted(3992 - 300), SpeechStopped(5016)]
    assert np.nonzero(np.abs(heard[1]) > 0.1)[0][0] == pytest.approx(308 * 16, abs=32)


async def test_with_a_pool_the_verdict_runs_off_the_loop_and_ends_the_turn_when_it_comes() -> None:
    started, release = threading.Event(), threading.Event()
    heard: list[int] = []

    def model(audio: np.ndarray) -> float:  # a slow model: blocks until the test says
        heard.append(len(audio))
        started.set()
        release.wait(30)
        return 1.0

    stream = VadStream(
        SemanticVadParams(), 24_000, vad=LoudScorer(), judge=model, verdicts=VerdictPool()
    )
    assert feed_in(stream, pcm(24_000, (1, 0), (1, 0.5), (1, 0)), [961]) == TURN[:1]
    (verdict,) = stream.verdicts()
    assert stream.verdicts() == []
    task = asyncio.ensure_future(verdict)
    await asyncio.to_thread(started.wait, 30)
    # The model is running and the loop is free: the session's other work goes on.
    assert not task.done()
    await asyncio.sleep(0)
    release.set()
    assert await task == TURN[1:]  # where the silence began, as without a pool
    assert stream.verdicts() == [] and not stream.speaking
    assert heard == [pytest.approx((2016 + CHECK_MS - 692) * 16, abs=WINDOW)]


async def test_a_question_whose_silence_is_over_is_never_run() -> None:
    runs: list[int] = []

    def model(audio: np.ndarray) -> float:
        runs.append(len(audio))
        return 1.0

    # A pool whose worker is busy until the test lets it go.
    gate = threading.Event()
    executor = ThreadPoolExecutor(1)
    executor.submit(gate.wait, 30)
    stream = VadStream(
        SemanticVadParams(), 24_000, vad=LoudScorer(), judge=model, verdicts=VerdictPool(executor)
    )
    feed_in(stream, pcm(24_000, (1, 0), (1, 0.5), (0.3, 0)), [961])
    (first,) = stream.verdicts()
    task = asyncio.ensure_future(first)
    feed_in(stream, pcm(24_000, (0.5, 0.5)), [961])  # the user went on
    gate.set()
    assert await task == []
    assert runs == [] and stream.speaking
    executor.shutdown()


def test_a_question_asked_ahead_hears_the_silence_so_far_repeated_to_its_length() -> None:
    heard: list[np.ndarray] = []
    model = sure_model(heard)
    # At 16 kHz, as the model hears it (no resampler holding samples back).
    stream = VadStream(SemanticVadParams(), 16_000, vad=LoudScorer(), judge=model)
    # A tone, then a low hum (silence to the scorer, from the window at 2016 ms), fed until
    # the window that is LEAD_MS short of CHECK_MS into it is complete (2080 ms): the model
    # is asked then, about audio up to 2016 + CHECK_MS, of which 2080 ms is here.
    hum = 0.01
    stream.feed(pcm(16_000, (1, 0), (1, 0.5), (0.08, hum)))
    assert 2016 + CHECK_MS - LEAD_MS == 2080
    (audio,) = heard
    # Its length is the question's...
    assert len(audio) == (2016 + CHECK_MS - 692) * 16
    # ... and what was not heard yet is the silence heard so far (64 ms of hum), again and
    # again: not zeros, and not the tone before it, however far ahead it was asked.
    silence = audio[(2016 - 692) * 16 : (2080 - 692) * 16]
    ahead = audio[(2080 - 692) * 16 :]
    assert len(ahead) == (CHECK_MS - 64) * 16 == 2 * len(silence)
    assert np.array_equal(ahead, np.tile(silence, 2))
    assert hum / 2 < np.abs(ahead).max() <= hum * 1.01
