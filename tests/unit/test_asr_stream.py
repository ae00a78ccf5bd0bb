"""Cutting streamed audio at its pauses (engines.asr_stream), with speech probabilities
given per 32 ms window: the finder's decisions, not Silero's (the model tests run it on
real speech)."""

from __future__ import annotations

import numpy as np

from omnistage.audio.vad import WINDOW
from omnistage.engines.speech.asr_stream import RATE, PauseFinder, Pcm16Feed, shifted
from omnistage.protocol.chunk_meta import Segment


class Scripted:
    """A ``WindowScorer`` that reads its probability off the audio itself: every window's
    first sample is the speech probability the test wants for it."""

    def __init__(self) -> None:
        self.pending = np.zeros(0, np.float32)

    def reset(self) -> None:
        self.pending = np.zeros(0, np.float32)

    def score(self, audio: np.ndarray) -> np.ndarray:
        audio = np.concatenate([self.pending, audio])
        count = len(audio) // WINDOW
        self.pending = audio[count * WINDOW :]
        return audio[: count * WINDOW : WINDOW].copy()


def windows(*probabilities: float) -> np.ndarray:
    """Audio whose windows score ``probabilities`` (see Scripted)."""
    return np.repeat(np.asarray(probabilities, np.float32), WINDOW)


def finder(**kw: float) -> PauseFinder:
    return PauseFinder(Scripted(), **kw)


def test_speech_then_a_pause_is_cut_at_the_end_of_the_pause_with_a_lead_in() -> None:
    f = finder(pause_ms=280, lead_ms=64)  # 9 windows of pause, 2 of lead-in
    assert f.push(windows(*[0.0] * 20)) == []  # silence: nothing to transcribe
    assert f.push(windows(*[0.9] * 10, *[0.1] * 8)) == []  # not paused long enough yet
    (cut,) = f.push(windows(0.1, 0.0, 0.0))
    # From two windows before the speech to the end of the ninth quiet window.
    assert cut.start == 18 * WINDOW
    assert len(cut.samples) == (2 + 10 + 9) * WINDOW
    assert cut.start_s == 18 * WINDOW / RATE
    # After the cut nothing is left to transcribe: the end of the input finds no speech.
    assert f.finish() is None


def test_uncertain_windows_neither_start_speech_nor_count_as_pause() -> None:
    f = finder(pause_ms=96)  # 3 windows
    assert f.push(windows(0.4, 0.4, 0.4, 0.4)) == []  # between the thresholds: not speech
    assert f.push(windows(0.9, 0.4, 0.2, 0.4, 0.2)) == []  # two quiet windows only
    assert len(f.push(windows(0.2))) == 1


def test_long_speech_is_cut_after_max_speech_s() -> None:
    f = finder(max_speech_s=1.0, lead_ms=0)
    per_second = RATE // WINDOW + 1  # 1 s of speech ends in the 32nd window
    cuts = f.push(windows(*[0.9] * (3 * per_second - 1)))
    assert [c.start for c in cuts] == [0, per_second * WINDOW]
    assert all(len(c.samples) == per_second * WINDOW for c in cuts)
    tail = f.finish()  # what was said since
    assert tail is not None and len(tail.samples) == (per_second - 1) * WINDOW


def test_the_end_of_the_input_leaves_the_speech_since_the_last_pause() -> None:
    f = finder(pause_ms=96, lead_ms=0)
    assert len(f.push(windows(0.9, 0.9, 0.0, 0.0, 0.0))) == 1
    f.push(windows(0.0, 0.9, 0.9))
    f.push(np.full(100, 0.5, np.float32))  # short of a window: unscored, still kept
    tail = f.finish()
    assert tail is not None
    assert tail.start == 6 * WINDOW and len(tail.samples) == 2 * WINDOW + 100


def test_pcm16_at_any_rate_becomes_16khz_in_any_split() -> None:
    rng = np.random.default_rng(0)
    pcm = (rng.standard_normal(22050) * 3000).astype("<i2").tobytes()  # 1 s at 22.05 kHz
    whole = Pcm16Feed(22050)
    at_once = np.concatenate([whole.push(pcm), whole.flush()])
    split = Pcm16Feed(22050)
    parts = [split.push(pcm[i : i + 441]) for i in range(0, len(pcm), 441)]  # odd byte counts
    pieces = np.concatenate([*parts, split.flush()])
    assert len(at_once) == RATE and np.array_equal(at_once, pieces)
    assert split.duration_s == 1.0
    same = Pcm16Feed(RATE)
    assert np.array_equal(same.push(b"\x00\x40\xff\xff"), np.array([0.5, -1 / 32768], np.float32))


def _segment(text: str, start: float, end: float) -> Segment:
    return Segment(0, 0, start, end, text, [1], 0.0, -0.1, 1.0, 0.01)


def test_segments_of_a_stretch_count_time_from_the_input_start_and_read_as_one() -> None:
    seg = shifted(_segment(" Hello there.", 0.2, 1.5), 3.0, after_text=False)
    assert (seg.text, seg.start, seg.end, seg.seek) == (" Hello there.", 3.2, 4.5, 300)
    assert shifted(_segment("Again.", 0.0, 1.0), 5.0, after_text=True).text == " Again."
    assert shifted(_segment(" Again.", 0.0, 1.0), 5.0, after_text=True).text == " Again."
