"""A client's ``conversation.item.truncate`` of an answer still being made, then a
backchannel: the answer resumes from where the client cut it.

Pipecat-style clients truncate the answer at ``speech_started`` to what they played,
dropping the audio they had received past it. When the speech proves a backchannel, the
answer resumes: the audio after the truncate must carry on from the cut (nothing the
client heard twice, nothing it dropped skipped), and the item in the conversation must
hold the answer the client has. Real server, real WebSocket, the shared ``voice_head``.
"""

from __future__ import annotations

import base64

import pytest

from tests.models.test_realtime import (
    RATE,
    STORY,
    STORY_OVER_VAD,
    _trim,
    session,
    silence,
    speak,  # noqa: F401 (the module's fixture)
    typed,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

PER_MS = RATE * 2 // 1000  # pcm16 bytes per ms of audio


async def test_a_backchannel_after_a_client_truncate_resumes_from_the_cut(voice_head, speak):  # noqa: F811
    okay = _trim(speak("Okay."))
    async with session(voice_head, **STORY_OVER_VAD) as live:
        await typed(live, STORY)
        await live.conn.response.create()
        story = (await live.expect("response.created")).response.id
        delta = await live.expect("response.output_audio.delta")
        first_at, item_id = live.last_at, delta.item_id
        live.stream(silence(200) + okay)
        await live.expect("input_audio_buffer.speech_started")
        # As Pipecat does: playback stops here, the item is cut at what was played (in
        # real time from the first delta), and what was received past it is dropped.
        got = [
            e
            for _, e in live.events
            if e.type == "response.output_audio.delta" and e.response_id == story
        ]
        received = b"".join(base64.b64decode(e.delta) for e in got)
        played_ms = min(len(received) // PER_MS, int((live.last_at - first_at) * 1000))
        assert len(received) // PER_MS - played_ms > 200, "nothing received past what was played"
        await live.conn.conversation.item.truncate(
            item_id=item_id, content_index=0, audio_end_ms=played_ms
        )
        truncated = await live.expect("conversation.item.truncated")
        cut = len(live.events)
        done = await live.expect("response.done", where=lambda e: e.response.id == story)
        item = (await _retrieved(live, item_id)).item
        after = b"".join(
            base64.b64decode(e.delta)
            for e in live.since(cut, "response.output_audio.delta")
            if e.response_id == story
        )
        heard = received[: truncated.audio_end_ms * PER_MS]
        # The whole answer as the client has it: checked against the server's item below.
        kept_ms = (len(heard) + len(after)) // PER_MS
        past, within = [
            await _truncate(live, item_id, end_ms) for end_ms in (kept_ms + 300, kept_ms - 50)
        ]
    assert truncated.audio_end_ms == played_ms
    # The backchannel did not cancel the answer: it ran to its end.
    assert done.response.status == "completed" or (
        done.response.status == "incomplete"
        and done.response.status_details.reason == "max_output_tokens"
    ), done.response
    # It went on from the cut: first what the client dropped, then the rest; nothing it
    # heard came again.
    dropped = received[len(heard) :]
    assert after[: len(dropped)] == dropped, "the audio after the truncate skips or repeats"
    assert len(after) > len(dropped)
    # The item holds all of the answer: its words, and as much audio as the client has.
    planned = "".join(
        e.delta
        for _, e in live.events
        if e.type == "response.output_audio_transcript.delta" and e.response_id == story
    )
    # (completed, or incomplete where it ran out of tokens, as the response says)
    assert item.status == done.response.output[0].status != "in_progress"
    assert item.content[0].transcript == planned == done.response.output[0].content[0].transcript
    assert past.type == "error" and "past the item's audio" in past.error.message, past
    assert within.type == "conversation.item.truncated", within


async def _retrieved(live, item_id: str):  # type: ignore[no-untyped-def]
    await live.conn.conversation.item.retrieve(item_id=item_id)
    return await live.expect("conversation.item.retrieved")


async def _truncate(live, item_id: str, end_ms: int):  # type: ignore[no-untyped-def]
    """``conversation.item.truncated``, or the ``error`` that refused it."""
    await live.conn.conversation.item.truncate(
        item_id=item_id, content_index=0, audio_end_ms=end_ms
    )
    return await live.expect("conversation.item.truncated", "error")
