"""Listening while the audio arrives: a streamed input (``EngineRequest.prompt_chunks``) of
raw pcm16 cut at its pauses into stretches the ASR engine transcribes one by one, so when
the input ends only the audio since the last pause is left to transcribe.

``Pcm16Feed`` turns pieces of little-endian int16 mono at any rate into 16 kHz float
samples (the project's polyphase resampler). ``PauseFinder`` scores them with a
speech-probability model (Silero VAD, as ``realtime.vad.SileroVad``: 32 ms windows) and
cuts a stretch when speech is followed by ``pause_ms`` of silence, or has gone on for
``max_speech_s`` (Whisper reads at most 30 s at once, and a long stretch delays its
text). Audio without speech is never transcribed; each stretch keeps ``lead_ms`` of the
quiet before its speech, which Whisper needs to hear a first word whole.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import msgspec
import numpy as np

from omnistage.audio.resample import StreamResampler
from omnistage.audio.vad import WINDOW, SileroVad, WindowScorer
from omnistage.protocol.chunk_meta import Segment

RATE = 16_000  # what Whisper and the VAD read
# Realtime's pcm rate: what raw pcm16 without a stated rate is taken to be.
DEFAULT_PCM_RATE = 24_000
# Silero's usual thresholds: speech from 0.5 up, silence below 0.35, between keeps the state
# (faster-whisper's VadOptions: threshold and threshold - 0.15).
SPEECH_THRESHOLD = 0.5
SILENCE_THRESHOLD = 0.35


@dataclass(frozen=True)
class Stretch:
    """Audio to transcribe: 16 kHz float samples from ``start`` (samples since the input
    began)."""

    start: int
    samples: np.ndarray

    @property
    def start_s(self) -> float:
        return self.start / RATE


class Pcm16Feed:
    """Pieces of pcm16 at ``rate`` in, 16 kHz float32 samples out, in any split."""

    def __init__(self, rate: int) -> None:
        self._resample = StreamResampler(rate, RATE) if rate != RATE else None
        self._odd = b""  # half a sample left over from the last piece
        self.samples_in = 0
        self.rate = rate

    def push(self, data: bytes) -> np.ndarray:
        data = self._odd + data
        whole = len(data) & ~1
        self._odd = data[whole:]
        pcm = np.frombuffer(data[:whole], dtype="<i2").astype(np.int16)
        self.samples_in += len(pcm)
        if self._resample is not None:
            pcm = self._resample.push(pcm)
        return pcm.astype(np.float32) / 32768.0

    def flush(self) -> np.ndarray:
        """The samples the resampler held back for look-ahead, at the end of the input."""
        if self._resample is None:
            return np.zeros(0, np.float32)
        return self._resample.flush().astype(np.float32) / 32768.0

    @property
    def duration_s(self) -> float:
        return self.samples_in / self.rate


class PauseFinder:
    """Cuts one stream of 16 kHz audio into stretches of speech, each ending in a pause."""

    def __init__(
        self,
        scorer: WindowScorer,
        pause_ms: float = 280.0,
        max_speech_s: float = 10.0,
        lead_ms: float = 250.0,
    ) -> None:
        self._scorer = scorer
        self._pause_windows = max(1, round(pause_ms * RATE / 1000 / WINDOW))
        self._max_speech = round(max_speech_s * RATE)
        self._lead = round(lead_ms * RATE / 1000)
        self._buf = np.zeros(0, np.float32)  # audio since the last cut
        self._base = 0  # the sample index of _buf[0]
        self._windows = 0  # windows scored since the start
        self._speech_from: int | None = None  # where the speech under way began
        self._quiet = 0  # silent windows since the last speech window

    def push(self, samples: np.ndarray) -> list[Stretch]:
        """Add audio; the stretches it completes."""
        self._buf = np.concatenate((self._buf, samples))
        cuts: list[Stretch] = []
        for p in self._scorer.score(samples):
            start = self._windows * WINDOW
            self._windows += 1
            end = start + WINDOW
            if p >= SPEECH_THRESHOLD:
                self._quiet = 0
                if self._speech_from is None:
                    self._speech_from = start
            elif p < SILENCE_THRESHOLD and self._speech_from is not None:
                self._quiet += 1
            if self._speech_from is None:
                self._drop_before(end - self._lead)  # silence: keep only the lead-in
            elif self._quiet >= self._pause_windows or end - self._speech_from >= self._max_speech:
                cuts.append(self._cut(end))
        return cuts

    def finish(self) -> Stretch | None:
        """The end of the input: what is left, if speech began in it."""
        if self._speech_from is None or not len(self._buf):
            return None
        return self._cut(self._base + len(self._buf))

    def _cut(self, end: int) -> Stretch:
        split = end - self._base
        stretch = Stretch(self._base, self._buf[:split])
        self._buf, self._base = self._buf[split:], end
        self._speech_from, self._quiet = None, 0
        return stretch

    def _drop_before(self, index: int) -> None:
        if index > self._base:
            self._buf = self._buf[index - self._base :]
            self._base = index


def silero() -> SileroVad:
    """A Silero VAD for one stream (the ONNX model is loaded once and shared)."""
    return SileroVad()


async def cut_stretches(
    pieces: AsyncIterator[bytes],
    feed: Pcm16Feed,
    finder: PauseFinder,
    put: Callable[[Stretch | BaseException | None], None],
) -> None:
    """Read a streamed input and ``put`` each stretch as the finder cuts it, the tail after
    the last piece, then None (or the error)."""
    try:
        async for data in pieces:
            for stretch in finder.push(feed.push(data)):
                put(stretch)
        for stretch in finder.push(feed.flush()):
            put(stretch)
        tail = finder.finish()
        if tail is not None:
            put(tail)
        put(None)
    except Exception as exc:
        put(exc)


def shifted(segment: Segment, offset_s: float, after_text: bool) -> Segment:
    """A segment of a stretch as one of the whole transcript: times counted from the
    input's start, and a space before its text when Whisper left none after earlier text,
    so the segments read as one transcript."""
    text = segment.text
    if after_text and text and not text[0].isspace():
        text = " " + text
    return msgspec.structs.replace(
        segment,
        text=text,
        start=round(segment.start + offset_s, 3),
        end=round(segment.end + offset_s, 3),
        seek=segment.seek + round(offset_s * 100),  # Whisper counts 10 ms frames
    )
