"""Audio output formats: 16-bit mono PCM from a TTS stage in, the bytes of a file out.

Every format is resampled to 24 kHz mono first (``OUTPUT_RATE``, the rate of OpenAI's
audio outputs), whatever the voice's own rate, so a client hears and gets the same
thing from every voice and format. One ``AudioEncoder`` serves one response: its
resampler and codec keep their state across chunks (a chunk is a sentence), so the
joined output has no seams, and ``finish`` flushes what they still hold.

Streamed outputs: ``pcm`` (raw little-endian int16), ``wav`` (a streaming header, sizes
unknown, then raw PCM), ``mp3`` (bare MPEG frames), ``aac`` (ADTS frames), ``flac``
(native FLAC; STREAMINFO without the total length) and ``opus`` (Ogg Opus; pages of at
most ``_OGG_PAGE_US`` of audio, so up to that much of a sentence's end waits for the
next sentence or the end). A whole file (``whole=True``, ``encode_whole``) is written
to a seekable buffer instead, so the muxers fill in what a stream cannot know: the WAV
sizes, FLAC's STREAMINFO, and mp3's Xing/LAME frame (which tells decoders to trim the
encoder's delay and padding).

PyAV (FFmpeg) loads on the first encoder, not with the API.
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from omnistage.audio.wav import wav_header
from omnistage.protocol.errors import ApiError

OUTPUT_RATE = 24000
# The rate of a TTS stage's pcm16 when its chunks do not say (they carry
# ``meta["sample_rate"]``): a Piper voice's usual rate.
DEFAULT_INPUT_RATE = 22050
SPEECH_FORMATS = ("mp3", "opus", "aac", "flac", "wav", "pcm")
# Chat names raw PCM "pcm16" (OpenAI's chat audio formats); it is the same output.
_ALIASES = {"pcm16": "pcm"}
MEDIA_TYPES = {
    "mp3": "audio/mpeg",
    "opus": "audio/ogg",
    "aac": "audio/aac",
    "flac": "audio/flac",
    "wav": "audio/wav",
    "pcm": "audio/pcm",
    "pcm16": "audio/pcm",
}

# An Ogg page is written once it holds this much audio (the muxer's default is 1 s).
_OGG_PAGE_US = 100_000


@dataclass(frozen=True)
class _Container:
    muxer: str
    codec: str
    bit_rate: int | None
    options: dict[str, str] = field(default_factory=dict)


_CONTAINERS = {
    # No ID3 tag: a bare run of MPEG frames can be cut and joined anywhere.
    "mp3": _Container("mp3", "libmp3lame", 64_000, {"id3v2_version": "0"}),
    "aac": _Container("adts", "aac", 64_000),
    # No 8 KiB padding block after STREAMINFO: nothing rewrites the tags later.
    "flac": _Container("flac", "flac", None, {"metadata_header_padding": "0"}),
    "opus": _Container("ogg", "libopus", 32_000, {"page_duration": str(_OGG_PAGE_US)}),
}


def require_av() -> Any:
    """The ``av`` module, or a 500 saying how to install it."""
    try:
        import av
    except ImportError:
        raise ApiError(
            500, "audio encoding needs the 'av' package: pip install av", "server_error"
        ) from None
    return av


class _Sink:
    """A write-only file for a streaming muxer: no ``seek``, so muxers write nothing
    they would have to come back and fix, and ``take`` hands out what is new."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def write(self, data: Any) -> int:
        self._buf += data
        return len(data)

    def take(self) -> bytes:
        out = bytes(self._buf)
        self._buf.clear()
        return out


class AudioEncoder:
    """One response's audio: ``feed`` chunks of pcm16 at ``in_rate``, then ``finish``.

    Each call returns the output bytes that became ready (possibly none: encoders hold
    a few ms back). With ``whole=True`` everything comes back from ``finish`` as one
    complete file. Not thread-safe; calls may come from any one thread at a time.
    """

    def __init__(self, fmt: str, in_rate: int, *, whole: bool = False) -> None:
        fmt = _ALIASES.get(fmt, fmt)
        if fmt not in SPEECH_FORMATS:
            raise ValueError(f"unknown audio format {fmt!r}; use one of {SPEECH_FORMATS}")
        if in_rate <= 0:
            raise ValueError(f"bad input sample rate {in_rate}")
        self.fmt, self.in_rate, self.whole = fmt, in_rate, whole
        self._av = require_av()
        self._resampler = self._av.AudioResampler(format="s16", layout="mono", rate=OUTPUT_RATE)
        self._odd = b""  # a lone byte of a sample split across chunks
        self._pcm: list[bytes] = []  # whole-file pcm/wav output so far
        self._header_sent = False
        self._samples = 0  # samples handed to the codec: the next frame's pts
        self._container: Any = None
        self._stream: Any = None
        self._file: io.BytesIO | _Sink | None = None
        self._finished = False

    def feed(self, pcm16: bytes) -> bytes:
        if self._finished:
            raise ValueError("feed after finish")
        data = self._odd + pcm16
        cut = len(data) - len(data) % 2
        self._odd = data[cut:]
        if not cut:
            return self._out([])
        frame = self._av.AudioFrame(format="s16", layout="mono", samples=cut // 2)
        frame.planes[0].update(data[:cut])
        frame.sample_rate = self.in_rate
        return self._out(self._resampler.resample(frame))

    def finish(self) -> bytes:
        if self._finished:
            raise ValueError("finish called twice")
        out = self._out(self._resampler.resample(None))
        self._finished = True
        if self.fmt in ("pcm", "wav"):
            if not self.whole:
                return out
            pcm = b"".join(self._pcm)
            return wav_header(OUTPUT_RATE, data_bytes=len(pcm)) + pcm if self.fmt == "wav" else pcm
        self._open()
        self._container.mux(self._stream.encode(None))
        self._container.close()
        if isinstance(self._file, io.BytesIO):
            return self._file.getvalue()
        assert self._file is not None
        return out + self._file.take()

    def _out(self, frames: list[Any]) -> bytes:
        """Hand resampled frames on; return the output bytes now ready."""
        if self.fmt in ("pcm", "wav"):
            # A plane's buffer may be padded past its samples.
            pcm = b"".join(bytes(f.planes[0])[: f.samples * 2] for f in frames)
            if self.whole:
                self._pcm.append(pcm)
                return b""
            if self.fmt == "wav" and not self._header_sent:
                self._header_sent = True
                return wav_header(OUTPUT_RATE, data_bytes=None) + pcm
            return pcm
        self._open()
        for frame in frames:
            frame.pts = self._samples
            frame.time_base = Fraction(1, OUTPUT_RATE)
            self._samples += frame.samples
            self._container.mux(self._stream.encode(frame))
        return self._file.take() if isinstance(self._file, _Sink) else b""

    def _open(self) -> None:
        if self._container is not None:
            return
        spec = _CONTAINERS[self.fmt]
        self._file = io.BytesIO() if self.whole else _Sink()
        self._container = self._av.open(
            self._file, "w", format=spec.muxer, options=dict(spec.options)
        )
        self._stream = self._container.add_stream(spec.codec, rate=OUTPUT_RATE, layout="mono")
        if spec.bit_rate:
            self._stream.bit_rate = spec.bit_rate


def encode_whole(pcm16: bytes, in_rate: int, fmt: str) -> bytes:
    """A complete file in ``fmt`` (24 kHz mono) holding ``pcm16`` at ``in_rate``."""
    encoder = AudioEncoder(fmt, in_rate, whole=True)
    encoder.feed(pcm16)
    return encoder.finish()
