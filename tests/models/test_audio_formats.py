"""Every audio output format over real HTTP with the real Piper voice: each one decodes
back (PyAV) at 24 kHz to about the length of the same speech as PCM."""

from __future__ import annotations

import base64
import io
from typing import Any

import openai
import pytest

av = pytest.importorskip("av")

pytestmark = pytest.mark.slow

TEXT = "Hello there. This is a short test."
QUESTION = "What is the capital of France?"
SPEECH_MEDIA = {
    "mp3": "audio/mpeg",
    "opus": "audio/ogg",
    "aac": "audio/aac",
    "flac": "audio/flac",
    "wav": "audio/wav",
    "pcm": "audio/pcm",
}
CHAT_FORMATS = ("wav", "mp3", "flac", "opus", "aac", "pcm16")


def decode(fmt: str, data: bytes) -> tuple[int, float]:
    """The sample rate and seconds of an encoded file (raw PCM is 24 kHz int16)."""
    if fmt in ("pcm", "pcm16"):
        return 24000, len(data) / 2 / 24000
    with av.open(io.BytesIO(data)) as container:
        samples = rate = 0
        for frame in container.decode(audio=0):
            samples, rate = samples + frame.samples, frame.sample_rate
    assert rate, f"no audio decoded from {fmt}"
    return rate, samples / rate


def expected_rate(fmt: str) -> int:
    return 48000 if fmt == "opus" else 24000  # Opus always decodes at 48 kHz


def close_to(seconds: float, reference: float, fmt: str = "pcm") -> bool:
    """Within 15%: the same text's length varies up to ~7% from one synthesis to the next
    (Piper's noisy duration predictor), too much to see a 22050/24000 mix-up (8%) here;
    tests/unit/test_audio_out.py checks rates by pitch. mp3 and AAC may keep up to
    ~0.1 s of the encoder's priming and padding (ADTS and a bare mp3 stream cannot say)."""
    slack = 0.1 if fmt in ("mp3", "aac") else 0.0
    return -0.15 * reference <= seconds - reference <= 0.15 * reference + slack


def speak(client: openai.OpenAI, fmt: str | None) -> Any:
    extra = {} if fmt is None else {"response_format": fmt}
    return client.audio.speech.create(model="voice", voice="joe", input=TEXT, **extra)


@pytest.fixture(scope="module")
def wav_seconds(voice_client: openai.OpenAI) -> float:
    data = speak(voice_client, "wav").content
    assert data[:4] == b"RIFF"
    return (len(data) - 44) / 2 / 24000


@pytest.mark.parametrize("fmt", [None, *SPEECH_MEDIA])
def test_speech_in_every_format_decodes_at_24khz_to_the_wavs_length(
    voice_client: openai.OpenAI, wav_seconds: float, fmt: str | None
) -> None:
    out = speak(voice_client, fmt)
    fmt = fmt or "mp3"  # OpenAI's default
    assert out.response.headers["content-type"] == SPEECH_MEDIA[fmt]
    rate, seconds = decode(fmt, out.content)
    assert rate == expected_rate(fmt)
    assert close_to(seconds, wav_seconds, fmt), (fmt, seconds, wav_seconds)


@pytest.mark.parametrize("fmt", ["mp3", "opus"])
def test_speech_streams_in_pieces_that_join_into_one_file(
    voice_client: openai.OpenAI, wav_seconds: float, fmt: str
) -> None:
    text = "First sentence here. A second one follows. And a third one ends it."
    with voice_client.audio.speech.with_streaming_response.create(
        model="voice", voice="joe", input=text, response_format=fmt
    ) as response:
        pieces = [piece for piece in response.iter_bytes() if piece]
    assert len(pieces) > 1  # sent as the sentences were spoken
    rate, seconds = decode(fmt, b"".join(pieces))
    assert rate == expected_rate(fmt)
    assert seconds > 2 * wav_seconds * 0.6


def ask(client: openai.OpenAI, fmt: str, **extra: Any) -> Any:
    return client.chat.completions.create(
        model="voice",
        messages=[{"role": "user", "content": QUESTION}],
        temperature=0,
        max_tokens=30,
        modalities=["text", "audio"],
        audio={"voice": "joe", "format": fmt},  # type: ignore[typeddict-item]
        **extra,
    )


@pytest.fixture(scope="module")
def chat_pcm_seconds(voice_client: openai.OpenAI) -> float:
    audio = ask(voice_client, "pcm16").choices[0].message.audio
    assert "Paris" in audio.transcript
    return decode("pcm16", base64.b64decode(audio.data))[1]


@pytest.mark.parametrize("fmt", CHAT_FORMATS)
def test_chat_audio_in_every_format_decodes_at_24khz(
    voice_client: openai.OpenAI, chat_pcm_seconds: float, fmt: str
) -> None:
    audio = ask(voice_client, fmt).choices[0].message.audio
    rate, seconds = decode(fmt, base64.b64decode(audio.data))
    assert rate == expected_rate(fmt)
    assert close_to(seconds, chat_pcm_seconds, fmt), (fmt, seconds, chat_pcm_seconds)


def test_streamed_chat_pcm16_is_24khz(voice_client: openai.OpenAI, chat_pcm_seconds: float) -> None:
    pcm = b""
    for chunk in ask(voice_client, "pcm16", stream=True):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        audio = getattr(delta, "audio", None) or (delta.model_extra or {}).get("audio")
        if audio:
            audio = audio if isinstance(audio, dict) else audio.model_dump()
            pcm += base64.b64decode(audio.get("data") or "")  # transcript-only deltas too
    # The same answer (temperature 0) as the non-streamed one, so about as long.
    _, seconds = decode("pcm16", pcm)
    assert len(pcm) % 2 == 0
    assert close_to(seconds, chat_pcm_seconds), (seconds, chat_pcm_seconds)


def test_a_streamed_chat_in_mp3_is_refused(voice_client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        ask(voice_client, "mp3", stream=True)
    assert info.value.body["param"] == "audio.format"  # type: ignore[index]
