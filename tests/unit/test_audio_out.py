"""Audio output formats: a synthetic tone encoded, decoded back with PyAV, and checked
for its rate, length and pitch (a wrong rate anywhere would shift the pitch)."""

from __future__ import annotations

import base64
import io
import json
from collections.abc import AsyncIterator
from itertools import pairwise
from typing import get_args

import pytest

av = pytest.importorskip("av")
np = pytest.importorskip("numpy")

from omnistage.api.audio_out import (  # noqa: E402
    MEDIA_TYPES,
    OUTPUT_RATE,
    SPEECH_FORMATS,
    AudioEncoder,
    encode_whole,
)
from omnistage.api.routes.chat import _events, _Plan  # noqa: E402
from omnistage.api.routes.common import ChunkShape  # noqa: E402
from omnistage.api.schemas.speech import SpeechRequest  # noqa: E402
from omnistage.protocol.chunk_meta import AudioMeta  # noqa: E402
from omnistage.protocol.messages import OutputChunk, Usage  # noqa: E402

IN_RATE = 22050  # Piper's default voice
SECONDS = 1.3
TONE_HZ = 440.0
# Uneven cuts, one of them through the middle of a sample (an odd byte count).
CUTS = (0, 10001, 24691, 40000, 51000)
# Decoded length may exceed the input by the encoder's delay and padding. Opus (Ogg's
# pre-skip and end granule), FLAC and PCM are exact; so is a whole mp3 (its LAME frame
# tells the decoder what to trim). A streamed mp3 and ADTS AAC cannot say, so ~50 ms of
# priming plus padding to a frame (576 or 1024 samples) stays in.
SLACK_S = {"mp3": 0.1, "aac": 0.1}


def tone(seconds: float = SECONDS, rate: int = IN_RATE) -> bytes:
    t = np.arange(int(seconds * rate)) / rate
    return (np.sin(2 * np.pi * TONE_HZ * t) * 12000).astype("<i2").tobytes()


def streamed(fmt: str, pcm: bytes) -> bytes:
    encoder = AudioEncoder(fmt, IN_RATE)
    cuts = [*CUTS, len(pcm)]
    parts = [encoder.feed(pcm[a:b]) for a, b in pairwise(cuts)]
    return b"".join(parts) + encoder.finish()


def decode(fmt: str, data: bytes) -> tuple[int, np.ndarray]:
    """The sample rate and the mono samples (float) of an encoded file."""
    if fmt == "pcm":
        return OUTPUT_RATE, np.frombuffer(data, "<i2").astype(np.float64)
    with av.open(io.BytesIO(data)) as container:
        rate = container.streams.audio[0].sample_rate
        frames = [f.to_ndarray().reshape(-1) for f in container.decode(audio=0)]
    return rate, np.concatenate([np.zeros(0), *frames]).astype(np.float64)


def dominant_hz(samples: np.ndarray, rate: int) -> float:
    spectrum = np.abs(np.fft.rfft(samples * np.hanning(len(samples))))
    return float(np.fft.rfftfreq(len(samples), 1 / rate)[np.argmax(spectrum)])


@pytest.mark.parametrize("whole", [False, True], ids=["streamed", "whole"])
@pytest.mark.parametrize("fmt", SPEECH_FORMATS)
def test_every_format_decodes_to_24khz_with_the_input_length(fmt: str, whole: bool) -> None:
    pcm = tone()
    data = encode_whole(pcm, IN_RATE, fmt) if whole else streamed(fmt, pcm)
    rate, samples = decode(fmt, data)
    # Opus decodes at 48 kHz whatever it was encoded at.
    assert rate == (48000 if fmt == "opus" else OUTPUT_RATE)
    seconds = len(samples) / rate
    slack = 0.0 if whole and fmt == "mp3" else SLACK_S.get(fmt, 0.0)
    assert SECONDS - 0.06 <= seconds <= SECONDS + 0.06 + slack, seconds


@pytest.mark.parametrize("fmt", ["pcm", "wav", "mp3", "opus", "aac", "flac"])
def test_the_tone_keeps_its_pitch(fmt: str) -> None:
    rate, samples = decode(fmt, streamed(fmt, tone()))
    assert abs(dominant_hz(samples, rate) - TONE_HZ) < 3


def test_streamed_pcm_is_the_whole_file_pcm_without_seams() -> None:
    pcm = tone()
    out = streamed("pcm", pcm)
    assert out == encode_whole(pcm, IN_RATE, "pcm")
    assert len(out) == 2 * round(SECONDS * OUTPUT_RATE)
    # No click where the chunks meet: neighbouring samples of a 440 Hz tone at 24 kHz
    # differ by at most 2*pi*440/24000 of the amplitude (~1400 here).
    samples = np.frombuffer(out, "<i2").astype(np.int32)
    assert np.max(np.abs(np.diff(samples[100:-100]))) < 1500


def test_a_streamed_wav_has_a_streaming_header_and_a_whole_one_exact_sizes() -> None:
    pcm = tone()
    stream = streamed("wav", pcm)
    whole = encode_whole(pcm, IN_RATE, "wav")
    assert stream[4:8] == b"\xff\xff\xff\xff" and stream[40:44] == b"\xff\xff\xff\xff"
    assert int.from_bytes(whole[40:44], "little") == len(whole) - 44
    assert stream[44:] == whole[44:] == encode_whole(pcm, IN_RATE, "pcm")


def test_pcm16_is_chats_name_for_pcm() -> None:
    pcm = tone(0.2)
    assert encode_whole(pcm, IN_RATE, "pcm16") == encode_whole(pcm, IN_RATE, "pcm")


def test_a_24khz_input_passes_through_at_its_length() -> None:
    pcm = tone(0.5, OUTPUT_RATE)
    assert len(encode_whole(pcm, OUTPUT_RATE, "pcm")) == len(pcm)


@pytest.mark.parametrize("fmt", SPEECH_FORMATS)
def test_no_audio_gives_an_empty_or_header_only_output(fmt: str) -> None:
    encoder = AudioEncoder(fmt, IN_RATE)
    data = encoder.feed(b"") + encoder.finish()
    if fmt == "wav":
        assert len(data) == 44 and data[:4] == b"RIFF"
    elif data:  # FLAC writes its stream header; mp3, AAC and Ogg write nothing
        rate, samples = decode(fmt, data)
        assert rate == OUTPUT_RATE and len(samples) == 0


def test_a_bad_format_or_rate_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="unknown audio format"):
        AudioEncoder("ogg", IN_RATE)
    with pytest.raises(ValueError, match="sample rate"):
        AudioEncoder("mp3", 0)


def test_feeding_after_finish_is_an_error() -> None:
    encoder = AudioEncoder("pcm", IN_RATE)
    encoder.finish()
    with pytest.raises(ValueError):
        encoder.feed(b"\x00\x00")


def test_the_speech_request_accepts_exactly_the_encoders_formats() -> None:
    field = SpeechRequest.model_fields["response_format"]
    assert set(get_args(field.annotation)) == set(SPEECH_FORMATS)
    assert field.default == "mp3"
    assert set(SPEECH_FORMATS) <= set(MEDIA_TYPES)


class _Stream:
    request_id = "chatcmpl-1"

    def close(self) -> None:
        pass

    def usage(self) -> Usage:
        return Usage()


async def _chunks(pcm: bytes) -> AsyncIterator[OutputChunk]:
    meta = AudioMeta(sample_rate=IN_RATE, format="pcm16")
    yield OutputChunk("r", 0, 0, 1, 0, "text", "A tone.", finished=True)
    cuts = [*CUTS, len(pcm)]
    for seq, (a, b) in enumerate(pairwise(cuts)):
        last = b == len(pcm)
        yield OutputChunk("r", 1, 0, 1, seq, "audio", "", pcm[a:b], finished=last, meta=meta)


async def test_streamed_chat_audio_is_24khz_pcm16_without_seams() -> None:
    pcm = tone()
    plan = _Plan(text=[0], audio=[1], audio_format="pcm16")
    shape = ChunkShape("chatcmpl-1", "chat.completion.chunk", 0, "voice", False)
    body = b"".join([e async for e in _events(_chunks(pcm), _Stream(), shape, plan)])
    joined = b""
    for line in body.decode().splitlines():
        if line.startswith("data: {"):
            for choice in json.loads(line[6:])["choices"]:
                joined += base64.b64decode(choice["delta"].get("audio", {}).get("data", ""))
    # One resampler across the chunks, flushed with the last: the whole tone, unbroken.
    assert joined == encode_whole(pcm, IN_RATE, "pcm16")
