"""The audio formats of a Realtime session (``audio.input.format``, ``audio.output.format``).

OpenAI's Realtime API (GA shape) names three:

- ``{"type": "audio/pcm", "rate": 24000}``: 16-bit little-endian mono PCM at 24 kHz, the
  only rate it allows for pcm;
- ``{"type": "audio/pcmu"}``: G.711 mu-law at 8 kHz, and
- ``{"type": "audio/pcma"}``: G.711 A-law at 8 kHz, for telephony.

The beta API's strings (``"pcm16"``, ``"g711_ulaw"``, ``"g711_alaw"``) parse to the same.

Models want other rates (VAD and Whisper 16 kHz, Piper speaks at 22050 Hz), so the
converters take the caller's rate and resample (``resample.py``): ``to_pcm16`` turns a
client's bytes into PCM at the rate asked for, ``from_pcm16`` a model's PCM into the
session's bytes. ``decode``/``encode`` are the same with the format's own rate as the
default. The one-shot forms refuse a pcm payload of odd length; Realtime audio arrives
in small appends, so ``InputStream``/``OutputStream`` carry a split sample and the
resampler's state across chunks, and the joined output has no seams.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from omnistage.audio import g711
from omnistage.audio.resample import StreamResampler, resample

FormatType = Literal["audio/pcm", "audio/pcmu", "audio/pcma"]
PCM_RATE = 24000
G711_RATE = 8000


class AudioFormatError(ValueError):
    """A bad audio format or payload; ``field`` names the session field at fault."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(frozen=True, slots=True)
class AudioFormat:
    type: FormatType
    rate: int
    bytes_per_sample: int

    def to_json(self) -> dict[str, Any]:
        """The session JSON shape, as ``session.created``/``session.updated`` echo it."""
        if self.type == "audio/pcm":
            return {"type": self.type, "rate": self.rate}
        return {"type": self.type}  # G.711's rate is fixed and not sent


PCM = AudioFormat("audio/pcm", PCM_RATE, 2)
PCMU = AudioFormat("audio/pcmu", G711_RATE, 1)
PCMA = AudioFormat("audio/pcma", G711_RATE, 1)
_BY_TYPE = {f.type: f for f in (PCM, PCMU, PCMA)}
_BETA_NAMES = {"pcm16": PCM, "g711_ulaw": PCMU, "g711_alaw": PCMA}


def parse_audio_format(value: Any, field: str = "audio.input.format") -> AudioFormat:
    """The format a session update gives, checked; errors name the field (``field.rate``)."""
    if isinstance(value, str) and value in _BETA_NAMES:
        return _BETA_NAMES[value]
    if not isinstance(value, Mapping):
        raise AudioFormatError(field, f"expected an object with a 'type', got {value!r}")
    kind = value.get("type")
    fmt = _BY_TYPE.get(kind) if isinstance(kind, str) else None
    if fmt is None:
        raise AudioFormatError(
            f"{field}.type", f"expected one of {', '.join(_BY_TYPE)}, got {kind!r}"
        )
    for key in value:
        if key not in ("type", "rate"):
            raise AudioFormatError(f"{field}.{key}", f"unknown parameter for {fmt.type}")
    rate = value.get("rate", fmt.rate)
    if isinstance(rate, bool) or not isinstance(rate, int) or rate != fmt.rate:
        raise AudioFormatError(
            f"{field}.rate", f"{fmt.type} supports only {fmt.rate}, got {rate!r}"
        )
    return fmt


def _decoder(fmt: AudioFormat) -> Callable[[bytes], np.ndarray]:
    if fmt.type == "audio/pcmu":
        return g711.mulaw_decode
    if fmt.type == "audio/pcma":
        return g711.alaw_decode
    return lambda data: np.frombuffer(data, "<i2").astype(np.int16)  # native order, a copy


def _encoder(fmt: AudioFormat) -> Callable[[np.ndarray], bytes]:
    if fmt.type == "audio/pcmu":
        return g711.mulaw_encode
    if fmt.type == "audio/pcma":
        return g711.alaw_encode
    return lambda pcm: pcm.astype("<i2").tobytes()


def to_pcm16(fmt: AudioFormat, data: bytes, rate: int) -> np.ndarray:
    """A whole payload in ``fmt`` -> int16 PCM at ``rate``."""
    if len(data) % fmt.bytes_per_sample:
        raise AudioFormatError(
            "audio", f"{fmt.type} takes {fmt.bytes_per_sample}-byte samples, got {len(data)} bytes"
        )
    return resample(_decoder(fmt)(data), fmt.rate, rate)


def from_pcm16(fmt: AudioFormat, pcm: np.ndarray, rate: int) -> bytes:
    """int16 PCM at ``rate`` -> the bytes of ``fmt``."""
    return _encoder(fmt)(resample(pcm, rate, fmt.rate))


def decode(fmt: AudioFormat, data: bytes, rate: int | None = None) -> np.ndarray:
    """A payload in ``fmt`` -> int16 PCM at ``rate`` (default: the format's own)."""
    return to_pcm16(fmt, data, fmt.rate if rate is None else rate)


def encode(fmt: AudioFormat, pcm: np.ndarray, rate: int | None = None) -> bytes:
    """int16 PCM at ``rate`` (default: the format's own) -> the bytes of ``fmt``."""
    return from_pcm16(fmt, pcm, fmt.rate if rate is None else rate)


class InputStream:
    """A client's appends in ``fmt`` -> int16 PCM at ``rate``, seamless across appends.

    A pcm append of odd length keeps its last byte for the next one (``pending_bytes``);
    ``flush`` ends the stream, and drops such a byte, which cannot be a sample.
    """

    def __init__(self, fmt: AudioFormat, rate: int) -> None:
        self.format = fmt
        self._decode = _decoder(fmt)
        self._resampler = StreamResampler(fmt.rate, rate)
        self._carry = b""

    @property
    def pending_bytes(self) -> int:
        return len(self._carry)

    def push(self, data: bytes) -> np.ndarray:
        data = self._carry + data
        whole = len(data) - len(data) % self.format.bytes_per_sample
        self._carry = data[whole:]
        return self._resampler.push(self._decode(data[:whole]))

    def flush(self) -> np.ndarray:
        self._carry = b""
        return self._resampler.flush()


class OutputStream:
    """A model's int16 PCM at ``rate``, chunk by chunk -> the bytes of ``fmt``."""

    def __init__(self, fmt: AudioFormat, rate: int) -> None:
        self.format = fmt
        self._encode = _encoder(fmt)
        self._resampler = StreamResampler(rate, fmt.rate)

    def push(self, pcm: np.ndarray) -> bytes:
        return self._encode(self._resampler.push(pcm))

    def flush(self) -> bytes:
        return self._encode(self._resampler.flush())
