"""Speech in through the whole default pipeline: the listener transcribes a chat's
``input_audio``, the thinker answers the words, the talker speaks the answer."""

from __future__ import annotations

import base64
import json
from typing import Any

import openai
import pytest

from tests.integration.harness import HeadProc

pytestmark = pytest.mark.slow

QUESTION = "What is the capital of France?"
LISTENER = 2


@pytest.fixture(scope="module")
def spoken(voice_client: openai.OpenAI) -> dict[str, bytes]:
    """QUESTION said by the Piper voice, as WAV and as MP3."""
    return {
        fmt: voice_client.audio.speech.create(
            model="voice", voice="joe", input=QUESTION, response_format=fmt
        ).content
        for fmt in ("wav", "mp3")
    }


def _audio_part(data: bytes, fmt: str) -> dict[str, Any]:
    return {
        "type": "input_audio",
        "input_audio": {"data": base64.b64encode(data).decode(), "format": fmt},
    }


def _dispatched(head: HeadProc, stage_id: int) -> int:
    return sum(r["dispatched_total"] for r in head.replicas(stage_id))


@pytest.mark.parametrize("fmt", ["wav", "mp3"])
def test_a_spoken_question_is_answered(
    voice_head: HeadProc, voice_client: openai.OpenAI, spoken: dict[str, bytes], fmt: str
) -> None:
    before = _dispatched(voice_head, LISTENER)
    out = voice_client.chat.completions.create(
        model="voice",
        messages=[
            {"role": "system", "content": "Answer in one short sentence."},
            {"role": "user", "content": [_audio_part(spoken[fmt], fmt)]},
        ],
        temperature=0,
        max_tokens=30,
    )
    assert "Paris" in out.choices[0].message.content, out.choices[0].message.content
    assert _dispatched(voice_head, LISTENER) == before + 1
    # The thinker read the system turn and the transcript: those are the prompt tokens.
    assert out.usage.prompt_tokens > 15


def test_speech_in_speech_out_streams_audio_about_the_spoken_question(
    voice_head: HeadProc, spoken: dict[str, bytes]
) -> None:
    body = {
        "model": "voice",
        "messages": [{"role": "user", "content": [_audio_part(spoken["wav"], "wav")]}],
        "modalities": ["text", "audio"],
        "audio": {"voice": "joe", "format": "pcm16"},
        "stream": True,
        "temperature": 0,
        "max_tokens": 30,
    }
    transcript, pcm = "", 0
    with voice_head.client.stream("POST", "/v1/chat/completions", json=body, timeout=180) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            for choice in json.loads(line[6:])["choices"]:
                audio = choice["delta"].get("audio") or {}
                transcript += audio.get("transcript", "")
                pcm += len(base64.b64decode(audio.get("data", "")))
    assert "Paris" in transcript, transcript
    assert pcm > 24000  # over half a second of 16-bit audio at 24 kHz


def test_a_text_chat_never_touches_the_listener(
    voice_head: HeadProc, voice_client: openai.OpenAI
) -> None:
    before = _dispatched(voice_head, LISTENER)
    voice_client.chat.completions.create(
        model="voice", messages=[{"role": "user", "content": QUESTION}], max_tokens=5
    )
    assert _dispatched(voice_head, LISTENER) == before


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        # Not audio at all: the listener cannot decode it.
        (
            [{"role": "user", "content": [_audio_part(b"\x00\x01nonsense" * 100, "wav")]}],
            "messages.0.content",
        ),
        # Audio in a system turn, with no user turn at all.
        ([{"role": "system", "content": [_audio_part(b"RIFF", "wav")]}], "messages.0.content"),
        # Audio in an earlier turn: only the last user turn is listened to.
        (
            [
                {"role": "user", "content": [_audio_part(b"RIFF", "wav")]},
                {"role": "assistant", "content": "ok"},
                {"role": "user", "content": "and?"},
            ],
            "messages.0.content",
        ),
        (
            [
                {
                    "role": "user",
                    "content": [
                        {"type": "input_audio", "input_audio": {"data": "%%%", "format": "wav"}}
                    ],
                }
            ],
            "messages.0.content",
        ),
    ],
)
def test_bad_audio_is_a_400_naming_the_message(
    voice_client: openai.OpenAI, messages: list[dict[str, Any]], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        voice_client.chat.completions.create(model="voice", messages=messages, max_tokens=5)
    assert info.value.body["param"] == param, info.value.body  # type: ignore[index]
