"""The default voice pipeline (SmolLM2 thinker -> Piper talker) over real HTTP."""

from __future__ import annotations

import base64
import io
import time
import wave
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.integration.harness import HeadProc, Proc, headless, wait_for

pytestmark = pytest.mark.slow

QUESTION = "What is the capital of France?"


def _client(head: HeadProc) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{head.url}/v1", api_key="x", max_retries=0, timeout=120)


def _ask(head: HeadProc, audio: dict[str, str] | None = None, **extra: Any) -> Any:
    """QUESTION at temperature 0, at most 30 tokens; with ``audio``, also asks for speech."""
    if audio is not None:
        extra |= {"modalities": ["text", "audio"], "audio": audio}
    return _client(head).chat.completions.create(
        model="voice",
        messages=[{"role": "user", "content": QUESTION}],
        temperature=0,
        max_tokens=30,
        **extra,
    )


def _wav(data: bytes) -> tuple[int, int, float]:
    with wave.open(io.BytesIO(data)) as w:
        return w.getnchannels(), w.getsampwidth(), w.getnframes() / w.getframerate()


def _talker_dispatches(head: HeadProc) -> int:
    return sum(r["dispatched_total"] for r in head.replicas(1))


def test_text_only_chat_answers_and_never_touches_the_talker(voice_head: HeadProc) -> None:
    before = _talker_dispatches(voice_head)
    out = _ask(voice_head)
    assert "Paris" in (out.choices[0].message.content or "")
    assert out.usage is not None and out.usage.completion_tokens > 0
    assert _talker_dispatches(voice_head) == before


def test_chat_with_audio_returns_text_and_a_wav_of_it(voice_head: HeadProc) -> None:
    out = _ask(voice_head, audio={"voice": "joe", "format": "wav"})
    audio = out.choices[0].message.audio
    assert audio is not None
    assert "Paris" in audio.transcript
    channels, width, seconds = _wav(base64.b64decode(audio.data))
    assert (channels, width) == (1, 2)
    assert seconds > 0.5
    assert audio.id.startswith("audio_") and audio.expires_at > time.time()


def test_streamed_chat_with_audio_sends_text_deltas_and_pcm_chunks(voice_head: HeadProc) -> None:
    stream = _ask(voice_head, audio={"voice": "default", "format": "pcm16"}, stream=True)
    text, pcm, finish, transcript = "", b"", None, ""
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        text += delta.content or ""
        audio = getattr(delta, "audio", None) or (delta.model_extra or {}).get("audio")
        if audio:
            audio = audio if isinstance(audio, dict) else audio.model_dump()
            pcm += base64.b64decode(audio.get("data") or "")
            transcript += audio.get("transcript") or ""
        finish = chunk.choices[0].finish_reason or finish
    # As OpenAI: with audio the words come once, as the audio's transcript.
    assert text == "" and "Paris" in transcript, (text, transcript)
    assert len(pcm) > 24000  # > 0.5 s of 16-bit audio at 24 kHz
    assert finish == "stop"


def test_speech_endpoint_streams_a_wav(voice_head: HeadProc) -> None:
    text = "Hello there. This is a test of streaming speech. It has three sentences."
    started = time.monotonic()
    first_at = None
    data = b""
    with (
        httpx.Client(base_url=voice_head.url, timeout=60) as client,
        client.stream(
            "POST",
            "/v1/audio/speech",
            json={"input": text, "voice": "joe", "model": "voice", "response_format": "wav"},
        ) as r,
    ):
        assert r.status_code == 200
        assert r.headers["content-type"] == "audio/wav"
        for piece in r.iter_bytes():
            if first_at is None:
                first_at = time.monotonic() - started
            data += piece
    total = time.monotonic() - started
    assert data[:4] == b"RIFF" and data[8:12] == b"WAVE"
    assert first_at is not None and first_at < total
    pcm_seconds = (len(data) - 44) / 2 / 24000  # OpenAI's rate
    assert pcm_seconds > 2.0


def test_speech_via_the_openai_client_grows_with_the_text(voice_head: HeadProc) -> None:
    client = _client(voice_head)
    short = client.audio.speech.create(
        model="voice", voice="joe", input="Hi.", response_format="pcm"
    ).content
    longer = client.audio.speech.create(
        model="voice", voice="joe", input="Hi. " * 6, response_format="pcm"
    ).content
    assert len(longer) > 3 * len(short) > 0


def test_openai_voice_names_speak_with_the_default_voice(voice_head: HeadProc) -> None:
    # The SDK's own examples say voice="alloy"; without a mapping it is the default voice.
    client = _client(voice_head)
    alloy = client.audio.speech.create(
        model="voice", voice="alloy", input="Hello there.", response_format="pcm"
    ).content
    joe = client.audio.speech.create(
        model="voice", voice="joe", input="Hello there.", response_format="pcm"
    ).content
    assert len(alloy) > 0 and abs(len(alloy) - len(joe)) < 0.2 * len(joe)
    out = _ask(voice_head, audio={"voice": "alloy", "format": "wav"})
    assert out.choices[0].message.audio.data


def test_a_bad_voice_in_a_streamed_chat_is_a_400_before_the_stream(voice_head: HeadProc) -> None:
    # Before, the thinker's first words went out with a 200 and the talker's refusal
    # followed as an error event, which clients surface as a generic APIError.
    with pytest.raises(openai.BadRequestError) as info:
        _ask(voice_head, audio={"voice": "nobody", "format": "pcm16"}, stream=True)
    error = info.value.body
    assert error["param"] == "voice" and "unknown voice" in error["message"]  # type: ignore[index]
    ok = _ask(voice_head, audio={"voice": "alloy", "format": "pcm16"}, stream=True)
    kinds = {
        ("audio" if c.choices and getattr(c.choices[0].delta, "audio", None) else "x") for c in ok
    }
    assert "audio" in kinds


def test_a_prompt_over_the_context_window_is_context_length_exceeded(
    voice_head: HeadProc,
) -> None:
    # LiteLLM and others pick their fallbacks by this code.
    with pytest.raises(openai.BadRequestError) as info:
        _client(voice_head).chat.completions.create(
            model="voice", messages=[{"role": "user", "content": "word " * 3000}], max_tokens=5
        )
    error = info.value.body
    assert error["code"] == "context_length_exceeded", error  # type: ignore[index]
    assert "maximum context length is 2048 tokens" in error["message"]  # type: ignore[index]


def test_completions_endpoint(voice_head: HeadProc) -> None:
    out = _client(voice_head).completions.create(
        model="voice", prompt="The capital of France is", max_tokens=8, temperature=0
    )
    assert out.choices[0].text
    assert out.usage is not None and out.usage.completion_tokens <= 8


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "hi"}],
                "modalities": ["text", "audio"],
                "audio": {"voice": "nobody", "format": "wav"},
                "max_tokens": 5,
            },
            "voice",
        ),
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "hi"}],
                "modalities": ["text", "audio"],
                "audio": {"voice": "joe", "format": "mp3"},
                "stream": True,  # a stream is pcm16, as OpenAI's
            },
            "audio.format",
        ),
        ("/v1/audio/speech", {"input": "   ", "voice": "joe"}, "input"),
        ("/v1/audio/speech", {"input": "Hello.", "voice": "nobody"}, "voice"),
        (
            "/v1/chat/completions",
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "What is in this picture?"},
                            {"type": "image_url", "image_url": {"url": "data:image/png;base64,"}},
                        ],
                    }
                ]
            },
            "messages.0.content",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "word " * 3000}], "max_tokens": 5},
            "messages",
        ),
    ],
)
def test_requests_the_pipeline_cannot_serve_get_a_4xx(
    voice_head: HeadProc, path: str, body: dict, param: str
) -> None:
    r = voice_head.client.post(path, json=body, timeout=60)
    assert 400 <= r.status_code < 500, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert param in (error["param"] or "") + error["message"]


def test_thinker_and_a_headless_talker_in_separate_processes(tmp_path: Path) -> None:
    head = HeadProc(tmp_path, "voice", "--stage-id", "0")
    talker: Proc | None = None
    listener: Proc | None = None
    try:
        head.wait_http()
        talker = headless(tmp_path, head, 1)
        # /health waits for every stage, the listener too (a chat like this one skips it).
        listener = headless(tmp_path, head, 2, name="listener")
        head.wait_healthy(timeout=240)
        assert [r["local"] for r in head.up_replicas(1)] == [False]
        out = _ask(head, audio={"voice": "joe", "format": "wav"})
        audio = out.choices[0].message.audio
        assert audio is not None and "Paris" in audio.transcript
        assert _wav(base64.b64decode(audio.data))[2] > 0.5
        wait_for(lambda: _talker_dispatches(head) >= 1, 5, what="talker used")
    finally:
        for proc in (talker, listener):
            if proc is not None:
                proc.stop()
        head.stop()


def test_eight_concurrent_streams_complete_with_their_own_text(voice_head: HeadProc) -> None:
    import concurrent.futures

    prompts = [f"Say something short about the color number {i}." for i in range(8)]

    def ask(prompt: str, stream: bool) -> str:
        client = _client(voice_head)
        kwargs = {"model": "voice", "temperature": 0, "max_tokens": 16}
        messages = [{"role": "user", "content": prompt}]
        if not stream:
            out = client.chat.completions.create(messages=messages, **kwargs)
            return out.choices[0].message.content or ""
        text = ""
        for chunk in client.chat.completions.create(messages=messages, stream=True, **kwargs):
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
        return text

    solo = [ask(p, stream=False) for p in prompts]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda p: ask(p, stream=True), prompts))
    assert all(solo)
    assert together == solo  # each stream got exactly its own request's text
