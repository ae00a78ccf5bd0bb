"""The Realtime API over WebRTC on the real voice pipeline: an aiortc caller
(``tests.webrtc_client``) speaks a question over its Opus track and hears the answer on
the call's track, with the session's events on the ``oai-events`` data channel; speech
during an answer clears the call's track at once, and a backchannel ("okay") over an
answer resumes it from where the track cut it, or, over an answer all made and still
playing, pauses the track and resumes it. Shares the session's ``voice_head``.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import numpy as np
import pytest

from omnistage.api.webrtc_media import hear_promptly
from tests.integration.harness import HeadProc
from tests.models.test_realtime import _trim
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
        _ask_typed(caller, STORY)
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


async def test_a_backchannel_over_an_answer_resumes_it_from_where_the_track_cut_it(
    voice_head: HeadProc,
) -> None:
    """The WebRTC form of test_realtime_truncate's: the call's track is the client that
    cuts. "Okay" said over a story clears the track at once and truncates the answer to
    what the track sent; the backchannel resumes it, from the cut: the caller hears all
    of the answer's audio once (nothing it heard repeated, nothing it missed skipped)."""
    okay = np.frombuffer(_trim(_speech(voice_head, "Okay.").tobytes()), np.int16)
    # Still being made when it is cut (the talker runs several times faster than real
    # time), short enough to hear out.
    session = {**SESSION, "instructions": STORYTELLER, "max_output_tokens": 150}
    caller = await _call(voice_head, session)
    for transceiver in caller.pc.getTransceivers():
        hear_promptly(transceiver.receiver, hold=1)  # one frame held, as a player: edges within it
    try:
        _ask_typed(caller, STORY)
        story = (await caller.next("response.created", WAIT_S))["response"]["id"]
        await caller.next("output_audio_buffer.started", WAIT_S)
        await asyncio.sleep(0.25)  # into the first sentence: the rest of it is queued
        caller.mic.say(np.concatenate([np.zeros(RATE // 5, np.int16), okay]))
        await caller.next("input_audio_buffer.speech_started", WAIT_S)
        cleared = await caller.seen("output_audio_buffer.cleared", WAIT_S)
        truncated = await caller.seen("conversation.item.truncated", WAIT_S)
        done = await caller.next("response.done", WAIT_S)
        await caller.next("output_audio_buffer.stopped", WAIT_S)
        await asyncio.sleep(0.3)  # the last frames through the caller's jitter buffer
        item_id = done["response"]["output"][0]["id"]
        caller.send({"type": "conversation.item.retrieve", "item_id": item_id})
        item = (await caller.next("conversation.item.retrieved", WAIT_S))["item"]
        heard = _answer_heard_ms(caller, story)
        # Past by more than a frame's edge: the caller hears up to the answer's last loud
        # frame, and the answer may end in a sentence's trailing silence.
        past, within = [
            await _truncate(caller, item_id, end_ms)
            for end_ms in (sum(heard) + PAUSE_SLACK_MS, sum(heard) - SLACK_MS)
        ]
    finally:
        await caller.close()
    assert cleared["response_id"] == story and truncated["item_id"] == item_id
    kinds = [e["type"] for _, e in caller.log]
    assert kinds.index("conversation.item.truncated") < kinds.index("response.done"), (
        "the answer was all made before the cut: this test needs it still being made"
    )
    # The backchannel did not cancel the answer: it ran to its end (or out of tokens),
    # and was the only answer.
    status = done["response"]["status"]
    details = done["response"].get("status_details") or {}
    assert done["response"]["id"] == story, done
    assert status == "completed" or details.get("reason") == "max_output_tokens", done
    assert [e["response"]["id"] for _, e in caller.log if e["type"] == "response.created"] == [
        story
    ]
    # The track cut the answer at what it had sent, which the caller heard up to the cut;
    # then it went on from there: the item holds as much audio as the caller heard in
    # all (what it missed would be short of it, what came twice past it), and all of
    # the answer's words.
    assert len(heard) >= 2, f"heard the answer in {heard} ms: it did not resume"
    assert abs(heard[0] - truncated["audio_end_ms"]) < SLACK_MS, (heard, truncated)
    assert past["type"] == "error" and "past the item's audio" in past["error"]["message"], (
        heard,
        past,
    )
    assert within["type"] == "conversation.item.truncated", (heard, within)
    planned = "".join(
        e["delta"]
        for _, e in caller.log
        if e["type"] == "response.output_audio_transcript.delta" and e["response_id"] == story
    )
    assert item["content"][0]["transcript"] == planned
    assert done["response"]["output"][0]["content"][0]["transcript"] == planned


async def test_a_backchannel_over_an_answer_all_made_pauses_the_calls_track_and_resumes_it(
    voice_head: HeadProc,
) -> None:
    """An answer is made faster than it plays: once it is all made (``response.done``)
    the call's track still plays it. "Okay" said then pauses the track (nothing cleared,
    nothing truncated) and the backchannel resumes it: the caller hears all of the
    answer's audio once, and the "okay" is not answered."""
    okay = np.frombuffer(_trim(_speech(voice_head, "Okay.").tobytes()), np.int16)
    session = {**SESSION, "instructions": STORYTELLER, "max_output_tokens": 80}
    caller = await _call(voice_head, session)
    for transceiver in caller.pc.getTransceivers():
        hear_promptly(transceiver.receiver, hold=1)
    try:
        _ask_typed(caller, STORY)
        story = (await caller.next("response.created", WAIT_S))["response"]["id"]
        done = await caller.seen("response.done", WAIT_S)
        # The track may have run dry between the answer's pieces (an opening sent alone,
        # the next piece late on a loaded machine): each gap is a stopped and a started.
        # What this test needs is the answer still playing once it is all made.
        edges = [e["type"] for _, e in caller.log if e["type"] in _EDGES]
        assert edges[-1:] != ["output_audio_buffer.stopped"], (
            "the answer played out before it was all made"
        )
        caller.mic.say(okay)
        await caller.next("input_audio_buffer.speech_started", WAIT_S)
        await caller.seen("input_audio_buffer.committed", WAIT_S)
        # The answer's end: the first stopped after the "okay" (nothing is left to make,
        # so the track cannot run dry before it).
        stopped = await caller.next("output_audio_buffer.stopped", WAIT_S)
        await asyncio.sleep(1.0)  # time for an answer to the "okay" to start, were it answered
        log = list(caller.log)
        item_id = done["response"]["output"][0]["id"]
        # The pause is in the track's clock (silence went out meanwhile): heard less it.
        pause = _silence_ms_at(caller, caller.arrived("input_audio_buffer.speech_started"))
        heard = sum(_answer_heard_ms(caller, story)) - pause
        past, within = [
            await _truncate(caller, item_id, end_ms)
            for end_ms in (heard + PAUSE_SLACK_MS, heard - SLACK_MS)
        ]
    finally:
        await caller.close()
    assert stopped["response_id"] == story
    assert pause >= len(okay) * 1000 / RATE, f"paused {pause} ms, under the okay's length"
    kinds = [e["type"] for _, e in log]
    assert "output_audio_buffer.cleared" not in kinds and "conversation.item.truncated" not in kinds
    assert [e["response"]["id"] for _, e in log if e["type"] == "response.created"] == [story]
    assert done["response"]["status"] == "completed" or (
        (done["response"].get("status_details") or {}).get("reason") == "max_output_tokens"
    ), done
    # All of the item's audio was heard, once: a truncate short of what was heard is
    # within the item's audio, one past it is not (past by a pause between sentences as
    # well: the silence measured as the track's pause may take one in).
    assert past["type"] == "error" and "past the item's audio" in past["error"]["message"], (
        heard,
        past,
    )
    assert within["type"] == "conversation.item.truncated", (heard, within)


_EDGES = ("output_audio_buffer.started", "output_audio_buffer.stopped")
SLACK_MS = 150  # the caller's frame edges: a frame or two each side of each run
PAUSE_SLACK_MS = 600  # ... and a pause between the answer's sentences


def _silence_ms_at(caller: Caller, at: float) -> float:
    """The silence the caller heard around ``at`` (its clock), in the track's time: from
    the last loud frame that came before it to the next loud one, by their RTP
    timestamps."""
    frames = list(zip(caller.loud, caller.loud_pts, strict=True))
    for (t0, p0), (t1, p1) in itertools.pairwise(frames):
        if t0 <= at + 0.1 < t1:
            return (p1 - p0) / 48 - 20
    return 0.0


def _ask_typed(caller: Caller, text: str) -> None:
    content = [{"type": "input_text", "text": text}]
    caller.send(
        {
            "type": "conversation.item.create",
            "item": {"type": "message", "role": "user", "content": content},
        }
    )
    caller.send({"type": "response.create"})


def _answer_heard_ms(caller: Caller, response_id: str) -> list[float]:
    """How much of the answer the caller heard, in ms, run by run: a run begins at its
    ``output_audio_buffer.started`` and plays without a gap to its last loud frame before
    the next run's (its ``stopped`` or ``cleared`` between). The frames' RTP timestamps
    (the server's clock) measure it; quiet frames inside a run (pauses between words)
    count, the silence between runs does not."""
    starts = [
        t
        for t, e in caller.log
        if e["type"] == "output_audio_buffer.started" and e["response_id"] == response_id
    ]
    runs = []
    for begin, end in zip(starts, [*starts[1:], float("inf")], strict=True):
        pts = [p for t, p in zip(caller.loud, caller.loud_pts, strict=True) if begin <= t < end]
        if pts:
            runs.append((pts[-1] - pts[0]) / 48 + 20)
    return runs


async def _truncate(caller: Caller, item_id: str, end_ms: float) -> dict[str, Any]:
    """``conversation.item.truncated``, or the ``error`` that refused it."""
    caller.send(
        {
            "type": "conversation.item.truncate",
            "item_id": item_id,
            "content_index": 0,
            "audio_end_ms": int(end_ms),
        }
    )
    async with asyncio.timeout(WAIT_S):
        while True:
            event = await caller.events.get()
            if event["type"] in ("conversation.item.truncated", "error"):
                return event
