"""VadStream's bytes, clock and resampling, with a loudness scorer in place of Silero."""

from __future__ import annotations

import numpy as np
import pytest

from omnistage.audio.semantic_vad import CHECK_MS, SemanticVadParams
from omnistage.audio.server_vad import ServerVadParams, SpeechStarted, SpeechStopped
from omnistage.audio.vad import WINDOW, VadStream


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


def test_semantic_vad_hears_the_turns_own_audio_and_ends_it_on_the_models_word() -> None:
    heard: list[np.ndarray] = []

    def model(audio: np.ndarray) -> float:
        heard.append(audio)
        return 1.0

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
