"""The Realtime API over WebRTC on the real voice pipeline: an aiortc caller
(``tests.webrtc_client``) speaks a question over its Opus track and hears the answer on
the call's track, with the session's events on the ``oai-events`` data channel; speech
during an answer clears the call's track at once. Shares the session's ``voice_head``.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from tests.integration.harness import HeadProc
from tests.speech import heard_as
from tests.webrtc_client import Caller

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

RATE = 24000
WAIT_S = 60.0
CAPITAL = "What is the capital of France?"
STORY = "Tell me a long story about a dragon."
STORYTELLER = "You are a storyteller. Tell long stories of many sentences."
VAD = {"type": "server_vad", "silence_duration_ms": 500}
SESSION = {
    "type": "realtime",
    "audio": {"input": {"transcription": {"model": "whisper-1"}, "turn_detection": VAD}},
}


def _speech(head: HeadProc, text: str) -> np.ndarray:
    body = {"model": "voice", "input": text, "voice": "alloy", "response_format": "pcm"}
    r = head.client.post("/v1/audio/speech", json=body, timeout=WAIT_S)
    r.raise_for_status()
    silence = np.zeros(RATE // 3, np.int16)
    return np.concatenate([silence, np.frombuffer(r.content, "<i2"), silence, silence])


async def _call(head: HeadProc, session: dict[str, Any]) -> Caller:
    caller = Caller()
    r = await caller.call(head.url, session=session)
    assert r.status_code == 201, r.text
    await caller.next("session.created", WAIT_S)
    return caller


async def test_a_spoken_question_is_heard_and_answered_on_the_calls_track(
    voice_head: HeadProc,
) -> None:
    question = _speech(voice_head, CAPITAL)
    caller = await _call(voice_head, SESSION)
    try:
        caller.mic.say(question)
        # In any order: the user's transcript may come after a short answer is done.
        heard = await caller.seen("conversation.item.input_audio_transcription.completed", WAIT_S)
        assert heard_as(heard["transcript"], CAPITAL), heard
        done = await caller.seen("response.done", WAIT_S)
        assert done["response"]["status"] == "completed", done
        stopped = await caller.seen("output_audio_buffer.stopped", WAIT_S)
        assert stopped["response_id"] == done["response"]["id"]
    finally:
        await caller.close()
    kinds = [e["type"] for _, e in caller.log]
    # The answer's audio came on the track, not as events on the channel.
    assert "response.output_audio.delta" not in kinds
    assert kinds.index("output_audio_buffer.started") < kinds.index("output_audio_buffer.stopped")
    started = caller.arrived("output_audio_buffer.started")
    loud = [t for t in caller.loud if t >= started - 0.1]
    assert len(loud) > 25, f"{len(loud)} loud 20 ms frames of the answer"  # over half a second
    said = next(e for _, e in caller.log if e["type"] == "response.output_audio_transcript.done")
    assert said["transcript"].strip()


async def test_speech_during_an_answer_clears_the_calls_track_at_once(
    voice_head: HeadProc,
) -> None:
    question = _speech(voice_head, CAPITAL)
    session = {**SESSION, "instructions": STORYTELLER, "max_output_tokens": 300}
    caller = await _call(voice_head, session)
    try:
        text_in = [{"type": "input_text", "text": STORY}]
        caller.send(
            {
                "type": "conversation.item.create",
                "item": {"type": "message", "role": "user", "content": text_in},
            }
        )
        caller.send({"type": "response.create"})
        first = (await caller.next("response.created", WAIT_S))["response"]["id"]
        await caller.next("output_audio_buffer.started", WAIT_S)
        await asyncio.sleep(0.5)
        caller.mic.say(question)
        await caller.next("input_audio_buffer.speech_started", WAIT_S)
        cleared = await caller.seen("output_audio_buffer.cleared", WAIT_S)
        assert cleared["response_id"] == first
        second = await caller.next("output_audio_buffer.started", WAIT_S)
        assert second["response_id"] != first
    finally:
        await caller.close()
    # When the server sent each loud frame, on its own clock: the frame's RTP timestamp
    # from the answer's first one, which it sent as it emitted output_audio_buffer.started
    # (the caller's jitter buffer and decoder may deliver frames late and bunched).
    began = caller.arrived("output_audio_buffer.started", response_id=first)
    barge = caller.arrived("input_audio_buffer.speech_started")
    again = caller.arrived("output_audio_buffer.started", response_id=second["response_id"])
    pts = [p for t, p in zip(caller.loud, caller.loud_pts, strict=True) if began <= t < again]
    sent = [began + (p - pts[0]) / 48000 - barge for p in pts]
    print(f"the first answer's last audio sent {sent[-1]:+.3f} s from speech_started")
    late = [round(s, 3) for s in sent if s > 0.1]
    assert not late, f"the first answer's audio was sent {late} s after speech_started"
