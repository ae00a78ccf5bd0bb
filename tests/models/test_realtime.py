"""The Realtime API end to end: the official ``openai`` SDK on the real voice pipeline.

Spoken turns are the head's own Piper voice (``/v1/audio/speech``, 24 kHz pcm16), sent
in 40 ms frames at about real time and followed by silence, as a microphone would; the
server's Silero VAD, Whisper, SmolLM2 and Piper do the rest. Tests that only talk to the
head share ``voice_head``; the one that kills replicas starts its own.
"""

from __future__ import annotations

import asyncio
import base64
import difflib
import io
import json
import os
import signal
import time
import unicodedata
import wave
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from openai import AsyncOpenAI

from omnistage.audio import g711, smart_turn
from omnistage.audio.formats import PCM, PCMU, AudioFormat, encode
from tests.integration.harness import HeadProc, wait_for
from tests.speech import heard_as

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

RATE = 24000  # the session's pcm16 rate, and /v1/audio/speech's pcm
FRAME_MS = 40
WAIT_S = 60.0  # generous: the machine is shared, models run on its CPUs
THINKER, TALKER = 0, 1
CAPITAL = "What is the capital of France?"
STORY = "Tell me a long story about a dragon."
STORYTELLER = "You are a storyteller. Tell long stories of many sentences."
TRANSCRIBE = {"transcription": {"model": "whisper-1"}}
# A long story told to a session whose server VAD may interrupt it.
STORY_OVER_VAD = {
    "instructions": STORYTELLER,
    "max_output_tokens": 300,
    "audio": {
        "input": {
            **TRANSCRIBE,
            "turn_detection": {"type": "server_vad", "silence_duration_ms": 500},
        }
    },
}
Event = Any  # the SDK's RealtimeServerEvent union


def words(text: str) -> set[str]:
    return {w.strip(".,!?;:'\"").lower() for w in text.split()}


def letters(text: str) -> str:
    """Only the letters, lowercased and without accents: how a recognizer's spelling
    of a phrase is compared (it may join or split words: "le grand château" heard as
    "legrancheto")."""
    plain = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode()
    return "".join(c for c in plain.lower() if c.isalpha())


def silence(ms: int) -> bytes:
    return b"\0\0" * (RATE * ms // 1000)


def _trim(pcm: bytes, level: int = 300) -> bytes:
    """Speech without its leading and trailing silence."""
    samples = np.frombuffer(pcm, "<i2")
    loud = np.flatnonzero(np.abs(samples.astype(np.int32)) > level)
    return samples[loud[0] : loud[-1] + 1].tobytes() if len(loud) else b""


@pytest.fixture(scope="module")
def speak(voice_head: HeadProc) -> Callable[[str], bytes]:
    """Text -> 24 kHz pcm16 speech in the head's own voice, cached for the module."""
    cache: dict[str, bytes] = {}

    def say(text: str) -> bytes:
        if text not in cache:
            body = {"model": "voice", "input": text, "voice": "alloy", "response_format": "pcm"}
            r = voice_head.client.post("/v1/audio/speech", json=body, timeout=WAIT_S)
            r.raise_for_status()
            cache[text] = r.content
        return cache[text]

    return say


class Live:
    """One Realtime connection: events read with their arrival time (the client's clock),
    audio streamed in the background while the test reads."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn
        self.events: list[tuple[float, Event]] = []
        self._read = 0  # events before this index were already returned by ``expect``
        self.last_at = 0.0  # when the event ``expect`` returned last arrived
        self._streams: list[asyncio.Task[None]] = []

    async def _recv(self, timeout: float) -> Event:
        event = await asyncio.wait_for(self.conn.recv(), timeout)
        self.events.append((time.monotonic(), event))
        return event

    async def expect(
        self, *types: str, timeout: float = WAIT_S, where: Callable[[Event], bool] | None = None
    ) -> Event:
        """The next event of one of ``types`` (skipping others); an unexpected ``error``
        fails the test."""
        deadline = time.monotonic() + timeout
        while True:
            if self._read < len(self.events):
                event = self.events[self._read][1]
            else:
                event = await self._recv(max(0.01, deadline - time.monotonic()))
            self._read += 1
            if event.type == "error" and "error" not in types:
                raise AssertionError(f"unexpected error event: {event.error}")
            if event.type in types and (where is None or where(event)):
                self.last_at = self.events[self._read - 1][0]
                return event

    async def find(self, *types: str, where: Callable[[Event], bool] | None = None) -> Event:
        """The first event of ``types`` read so far, else the next one to arrive."""
        for at, event in self.events:
            if event.type in types and (where is None or where(event)):
                self.last_at = at
                return event
        return await self.expect(*types, where=where)

    async def marker(self) -> list[Event]:
        """Every event until one the server sends after all input so far was handled
        (events go out in order): a cheap, sleep-free barrier."""
        start = len(self.events)
        await self.conn.conversation.item.retrieve(item_id="item_marker")
        await self.expect("error", where=lambda e: e.error.code == "item_not_found")
        return [e for _, e in self.events[start:-1]]

    def stream(
        self, audio: bytes, after_ms: int = 1000, speed: float = 1.0, fmt: AudioFormat = PCM
    ) -> asyncio.Task[None]:
        """Send ``audio`` (in ``fmt``) then ``after_ms`` of silence in 40 ms frames,
        ``speed`` times real time (0: as fast as it goes), in the background."""
        per_ms = fmt.rate * fmt.bytes_per_sample // 1000
        data = audio + encode(fmt, np.zeros(fmt.rate * after_ms // 1000, np.int16))
        frame = per_ms * FRAME_MS

        async def send() -> None:
            t0 = time.monotonic()
            for i in range(0, len(data), frame):
                chunk = base64.b64encode(data[i : i + frame]).decode()
                await self.conn.input_audio_buffer.append(audio=chunk)
                if speed:
                    due = t0 + (i + frame) / per_ms / 1000 / speed
                    await asyncio.sleep(max(0.0, due - time.monotonic()))

        task = asyncio.ensure_future(send())
        self._streams.append(task)
        return task

    def since(self, index: int, *types: str) -> list[Event]:
        return [e for _, e in self.events[index:] if not types or e.type in types]

    async def close(self) -> None:
        for task in self._streams:
            task.cancel()
        await asyncio.gather(*self._streams, return_exceptions=True)


@asynccontextmanager
async def session(head: HeadProc, **update: Any) -> AsyncIterator[Live]:
    """A connected session, ``session.update``d with ``update`` (``type`` "realtime"
    unless it says otherwise)."""
    client = AsyncOpenAI(base_url=f"{head.url}/v1", api_key="x", max_retries=0)
    async with client.realtime.connect(model="voice") as conn:
        live = Live(conn)
        await live.expect("session.created")
        if update:
            await conn.session.update(session={"type": "realtime", **update})
            await live.expect("session.updated")
        try:
            yield live
        finally:
            await live.close()


async def typed(live: Live, text: str) -> None:
    """A typed user message, added to the conversation."""
    content = [{"type": "input_text", "text": text}]
    await live.conn.conversation.item.create(
        item={"type": "message", "role": "user", "content": content}
    )


async def ask(live: Live, text: str, **response: Any) -> Event:
    """A typed user turn and its response: the ``response.done`` event."""
    await typed(live, text)
    await live.conn.response.create(**({"response": response} if response else {}))
    return await live.expect("response.done")


def audio_of(events: list[Event]) -> bytes:
    return b"".join(
        base64.b64decode(e.delta) for e in events if e.type == "response.output_audio.delta"
    )


def busy(head: HeadProc, stage_id: int) -> list[dict[str, Any]]:
    return [r for r in head.replicas(stage_id) if r["in_flight"] > 0]


# --------------------------------------------------------------------------------------
# turns
# --------------------------------------------------------------------------------------


async def test_a_spoken_turn_is_heard_answered_and_spoken_in_openai_order(voice_head, speak):
    vad = {"type": "server_vad", "silence_duration_ms": 500}
    async with session(voice_head, audio={"input": {**TRANSCRIBE, "turn_detection": vad}}) as live:
        start = len(live.events)
        live.stream(silence(300) + speak(CAPITAL))
        done = await live.expect("response.done")
        heard = await live.find("conversation.item.input_audio_transcription.completed")
        events = live.since(start)
    assert heard_as(heard.transcript, CAPITAL), heard.transcript
    assert done.response.status == "completed", done.response
    assert done.response.usage is not None and done.response.usage.output_tokens > 0
    kinds = [e.type for e in events]
    order = [
        "input_audio_buffer.speech_started",
        "input_audio_buffer.speech_stopped",
        "input_audio_buffer.committed",
        "conversation.item.added",  # the user's turn
        "response.created",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_audio.delta",
        "response.output_audio.done",
        "response.output_audio_transcript.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.done",
    ]
    firsts = [kinds.index(kind) for kind in order]
    assert firsts == sorted(firsts), list(zip(order, firsts, strict=True))
    assert kinds.count("input_audio_buffer.speech_started") == 1, kinds
    last_delta = max(i for i, k in enumerate(kinds) if k == "response.output_audio.delta")
    assert last_delta < kinds.index("response.output_audio.done")
    committed = events[kinds.index("input_audio_buffer.committed")]
    user = events[kinds.index("conversation.item.added")].item
    assert user.id == committed.item_id and user.role == "user"
    pcm = audio_of(events)
    assert len(pcm) > RATE * 2 // 2 and len(pcm) % 2 == 0  # over half a second of pcm16
    assert np.abs(np.frombuffer(pcm, "<i2")).max() > 1000  # speech, not silence
    said = events[kinds.index("response.output_audio_transcript.done")].transcript
    deltas = "".join(e.delta for e in events if e.type == "response.output_audio_transcript.delta")
    assert said and said == deltas, (said, deltas)


@pytest.mark.skipif(not smart_turn.available(), reason=smart_turn.INSTALL)
async def test_a_semantic_vad_session_commits_a_finished_question_and_answers_it(voice_head, speak):
    vad = {"type": "semantic_vad", "eagerness": "auto"}
    audio = {"input": {**TRANSCRIBE, "turn_detection": vad}}
    async with session(voice_head, audio=audio) as live:
        updated = live.since(0, "session.updated")[-1]
        start = len(live.events)
        # Well under the 1 s a turn the model called unfinished would wait: it ends on
        # the model's word, with the silence after it still streaming.
        live.stream(silence(300) + speak(CAPITAL), after_ms=3000)
        stopped = await live.expect("input_audio_buffer.speech_stopped")
        committed = await live.expect("input_audio_buffer.committed")
        done = await live.expect("response.done")
        heard = await live.find("conversation.item.input_audio_transcription.completed")
        events = live.since(start)
    assert updated.session.audio.input.turn_detection.type == "semantic_vad"
    spoken_ms = 300 + len(_trim(speak(CAPITAL))) * 1000 / 2 / RATE
    assert stopped.audio_end_ms < spoken_ms + 1000, (stopped.audio_end_ms, spoken_ms)
    assert committed.item_id == stopped.item_id
    assert heard_as(heard.transcript, CAPITAL), heard.transcript
    assert done.response.status == "completed", done.response
    kinds = [e.type for e in events]
    assert kinds.count("input_audio_buffer.committed") == 1, kinds
    assert np.abs(np.frombuffer(audio_of(events), "<i2")).max() > 1000  # spoken


async def test_a_typed_turn_with_text_output_has_text_deltas_and_no_audio(voice_head):
    async with session(voice_head, output_modalities=["text"]) as live:
        start = len(live.events)
        done = await ask(live, "Say hello.")
        limits = (await live.expect("rate_limits.updated")).rate_limits
        events = live.since(start)
    # The server's one limit, sessions at once, as OpenAI's "requests".
    assert limits[0].name == "requests" and 0 <= limits[0].remaining < limits[0].limit
    assert done.response.status == "completed", done.response
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text.strip()
    final = next(e for e in events if e.type == "response.output_text.done")
    assert final.text == text
    assert not [e for e in events if e.type.startswith("response.output_audio")]
    assert done.response.output[0].content[0].type == "output_text"


async def test_a_conversation_longer_than_the_thinkers_window_is_truncated_not_failed(
    voice_head,
):
    # The session says truncation "auto", as OpenAI's: some 80 exchanges (about 3,000
    # tokens, where the thinker's window is 2,048) lose their oldest, and the newest
    # turn is answered. Before, every answer of a long conversation failed.
    async with session(voice_head, output_modalities=["text"]) as live:
        assert live.since(0, "session.updated")[-1].session.truncation == "auto"
        for i in range(80):
            await typed(live, f"Tell me a fact about the number {i}.")
            content = [{"type": "output_text", "text": f"The number {i} comes after {i - 1}."}]
            await live.conn.conversation.item.create(
                item={"type": "message", "role": "assistant", "content": content}
            )
        done = await ask(live, CAPITAL)
    assert done.response.status == "completed", done.response.status_details
    answer = done.response.output[0].content[0].text
    assert answer.strip(), done.response
    assert done.response.usage.input_tokens < 2048


async def test_speech_during_an_answer_cancels_it_at_once_and_is_answered(voice_head, speak):
    update = STORY_OVER_VAD
    question = speak(CAPITAL)
    async with session(voice_head, **update) as live:
        await typed(live, STORY)
        await live.conn.response.create()
        first = (await live.expect("response.created")).response.id
        await live.expect("response.output_audio.delta")
        live.stream(silence(200) + question)
        started = await live.expect("input_audio_buffer.speech_started")
        started_at = live.last_at
        cancelled = await live.find("response.done", where=lambda e: e.response.id == first)
        assert cancelled.response.status == "cancelled", cancelled.response
        assert cancelled.response.status_details.reason == "turn_detected"
        second = await live.expect("response.done", where=lambda e: e.response.id != first)
        # Answered: to its end, or to the token cap where the sampled answer rambled on.
        capped = second.response.status_details and second.response.status_details.reason
        assert second.response.status == "completed" or (
            second.response.status == "incomplete" and capped == "max_output_tokens"
        ), second.response
        late = [
            t - started_at
            for t, e in live.events
            if t > started_at + 0.150
            and e.type == "response.output_audio.delta"
            and e.response_id == first
        ]
        assert not late, f"first answer's audio {late} s after speech_started"
        answer = next(o for o in cancelled.response.output if o.type == "message")
        planned = "".join(
            e.delta
            for _, e in live.events
            if e.type == "response.output_audio_transcript.delta" and e.response_id == first
        )
        await live.conn.conversation.item.retrieve(item_id=answer.id)
        kept = (await live.expect("conversation.item.retrieved")).item.content[0].transcript
        heard = [
            e
            for _, e in live.events
            if e.type == "conversation.item.input_audio_transcription.completed"
            and e.item_id == started.item_id
        ]
    assert heard and heard_as(heard[0].transcript, CAPITAL), heard
    assert kept and len(kept) < len(planned), (kept, planned)
    assert planned.split()[: len(kept.split())] == kept.split(), (kept, planned)


async def test_a_backchannel_during_an_answer_pauses_it_and_it_resumes_whole(voice_head, speak):
    """ "Okay" said over a story: the story's audio pauses, then flows on from where it
    paused; the story runs to its end, with all of its words and nothing cut."""
    update = STORY_OVER_VAD
    okay = _trim(speak("Okay."))
    async with session(voice_head, **update) as live:
        await typed(live, STORY)
        await live.conn.response.create()
        story = (await live.expect("response.created")).response.id
        await live.expect("response.output_audio.delta")
        live.stream(silence(200) + okay)
        started = await live.expect("input_audio_buffer.speech_started")
        started_at = live.last_at
        done = await live.expect("response.done", where=lambda e: e.response.id == story)
        stopped = await live.find("input_audio_buffer.speech_stopped")
        await live.marker()
    # It ran to its end (or to max_output_tokens): not cut short by the "okay".
    details = done.response.status_details
    assert done.response.status == "completed" or (
        done.response.status == "incomplete" and details.reason == "max_output_tokens"
    ), done.response
    # The answer waited while the user spoke, and went on after.
    after = [
        t - started_at
        for t, e in live.events
        if t > started_at and e.type == "response.output_audio.delta" and e.response_id == story
    ]
    assert after and after[0] < 5.0, after  # resumed (generous: models on shared CPUs)
    planned = "".join(
        e.delta
        for _, e in live.events
        if e.type == "response.output_audio_transcript.delta" and e.response_id == story
    )
    assert done.response.output[0].content[0].transcript == planned  # nothing cut
    assert stopped.item_id == started.item_id
    answered = [e for _, e in live.events if e.type == "response.created"]
    assert len(answered) == 1  # the backchannel was not answered


async def test_a_required_tool_call_and_its_output_are_answered(voice_head):
    tool = {
        "type": "function",
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    }
    # Greedy: sampled, the 135M thinker sometimes fills the city with words up to its
    # token limit.
    update = {
        "output_modalities": ["text"],
        "tools": [tool],
        "tool_choice": "required",
        "temperature": 0,
    }
    async with session(voice_head, **update) as live:
        done = await ask(live, "What is the weather in Paris?")
        assert done.response.status == "completed", done.response
        calls = live.since(0, "response.function_call_arguments.done")
        assert len(calls) == 1, done.response
        call = calls[0]
        assert call.name == "get_weather"
        assert isinstance(json.loads(call.arguments), dict), call.arguments
        output = {"type": "function_call_output", "call_id": call.call_id, "output": '{"c": 21}'}
        await live.conn.conversation.item.create(item=output)
        await live.conn.response.create(response={"tool_choice": "none"})
        after = await live.expect("response.done")
    assert after.response.status == "completed", after.response
    assert after.response.output, after.response


async def test_an_out_of_band_response_leaves_the_conversation_alone(voice_head):
    async with session(voice_head, output_modalities=["text"]) as live:
        await typed(live, "Hi.")
        mine = (await live.expect("conversation.item.done")).item.id
        start = len(live.events)
        oob = {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": "Say yes."}],
        }
        await live.conn.response.create(
            response={"conversation": "none", "input": [oob], "metadata": {"topic": "oob"}}
        )
        done = await live.expect("response.done")
        events = live.since(start)
        assert done.response.status == "completed", done.response
        assert done.response.metadata == {"topic": "oob"}
        assert done.response.output and done.response.output[0].content[0].text.strip()
        assert not [e for e in events if e.type.startswith("conversation.item")], events
        await live.conn.conversation.item.retrieve(item_id=done.response.output[0].id)
        missing = await live.expect("error", "conversation.item.retrieved")
        assert missing.type == "error" and missing.error.code == "item_not_found"
        await live.conn.conversation.item.retrieve(item_id=mine)
        assert (await live.expect("conversation.item.retrieved")).item.id == mine


async def test_push_to_talk_commits_by_hand_and_refuses_an_empty_commit(voice_head, speak):
    update = {"audio": {"input": {**TRANSCRIBE, "turn_detection": None}}}
    async with session(voice_head, **update) as live:
        await live.stream(speak(CAPITAL), after_ms=200, speed=0)
        start = len(live.events)
        await live.conn.input_audio_buffer.commit()
        committed = await live.expect("input_audio_buffer.committed")
        await live.conn.response.create()
        done = await live.expect("response.done")
        heard = await live.find("conversation.item.input_audio_transcription.completed")
        assert not live.since(start, "input_audio_buffer.speech_started")
        assert done.response.status == "completed", done.response
        assert heard.item_id == committed.item_id
        assert heard_as(heard.transcript, CAPITAL), heard.transcript
        await live.conn.input_audio_buffer.commit()
        empty = await live.expect("error")
    assert empty.error.code == "input_audio_buffer_commit_empty", empty.error


async def test_a_transcription_session_transcribes_and_never_answers(voice_head, speak):
    vad = {"type": "server_vad"}
    update = {"type": "transcription", "audio": {"input": {**TRANSCRIBE, "turn_detection": vad}}}
    async with session(voice_head, **update) as live:
        assert live.since(0, "session.updated")[0].session.type == "transcription"
        sent = live.stream(speak(CAPITAL), after_ms=1500)
        heard = await live.expect("conversation.item.input_audio_transcription.completed")
        await sent
        events = live.since(0) + await live.marker()
    assert heard_as(heard.transcript, CAPITAL), heard.transcript
    kinds = {e.type for e in events}
    assert "conversation.item.input_audio_transcription.delta" in kinds
    assert "input_audio_buffer.committed" in kinds
    assert not [k for k in kinds if k.startswith("response.")], kinds


async def test_g711_mu_law_in_and_out(voice_head, speak):
    pcmu = {"type": "audio/pcmu"}
    update = {"audio": {"input": {**TRANSCRIBE, "format": pcmu}, "output": {"format": pcmu}}}
    question = encode(PCMU, np.frombuffer(silence(300) + speak(CAPITAL), "<i2"), RATE)
    async with session(voice_head, **update) as live:
        start = len(live.events)
        live.stream(question, fmt=PCMU)
        done = await live.expect("response.done")
        heard = await live.find("conversation.item.input_audio_transcription.completed")
        spoken = audio_of(live.since(start))
    assert heard_as(heard.transcript, CAPITAL), heard.transcript
    assert done.response.status == "completed", done.response
    assert done.response.audio.output.format.type == "audio/pcmu"
    # One byte a sample at 8 kHz: Whisper hears the answer when read back that way.
    pcm = g711.mulaw_decode(spoken)
    wav = io.BytesIO()
    with wave.open(wav, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(8000)
        w.writeframes(pcm.astype("<i2").tobytes())
    files = {"file": ("answer.wav", wav.getvalue(), "audio/wav")}
    r = voice_head.client.post(
        "/v1/audio/transcriptions", data={"model": "voice"}, files=files, timeout=WAIT_S
    )
    assert r.status_code == 200, r.text
    # The sampled answer varies; a French name in it is heard with words joined, so the
    # letters are compared, not the words. Noise, or audio read at the wrong rate,
    # scores far below (~0.2 between unrelated sentences).
    said = letters(done.response.output[0].content[0].transcript)
    back = letters(r.json()["text"])
    assert difflib.SequenceMatcher(None, said, back).ratio() >= 0.6, (said, back)


# --------------------------------------------------------------------------------------
# errors
# --------------------------------------------------------------------------------------


async def test_bad_client_events_are_error_events_and_the_session_goes_on(voice_head):
    async with session(voice_head) as live:
        conn = live.conn

        async def refused(send: Any) -> Any:
            await send
            return (await live.expect("error")).error

        err = await refused(conn.send_raw("{not json"))
        assert err.code == "invalid_json", err
        err = await refused(conn.send_raw(json.dumps({"type": "session.dance"})))
        assert err.param == "type" and "session.dance" in err.message, err
        err = await refused(
            conn.send_raw(json.dumps({"type": "input_audio_buffer.append", "audio": "%%%"}))
        )
        assert err.param == "audio", err
        vad = {"type": "server_vad", "threshold": 7}
        err = await refused(
            conn.session.update(
                session={"type": "realtime", "audio": {"input": {"turn_detection": vad}}}
            )
        )
        assert err.param and "threshold" in err.param, err
        err = await refused(
            conn.conversation.item.truncate(item_id="item_nope", content_index=0, audio_end_ms=0)
        )
        assert err.code == "item_not_found" and "item_nope" in err.message, err
        err = await refused(conn.response.cancel())
        assert err.code == "response_cancel_not_active", err
        # The threshold was refused as a whole: the session still has its default.
        await conn.session.update(session={"type": "realtime", "instructions": "Be brief."})
        updated = await live.expect("session.updated")
        assert updated.session.audio.input.turn_detection.threshold == 0.5
        done = await ask(live, "Say hi.", output_modalities=["text"])
    assert done.response.status == "completed", done.response


async def test_an_unknown_model_is_refused_before_the_upgrade(voice_head):
    from websockets.exceptions import InvalidStatus

    client = AsyncOpenAI(base_url=f"{voice_head.url}/v1", api_key="x", max_retries=0)
    with pytest.raises(InvalidStatus) as refused:
        async with client.realtime.connect(model="no-such-model"):
            pass
    assert refused.value.response.status_code == 404
    assert b"model_not_found" in refused.value.response.body


# --------------------------------------------------------------------------------------
# VAD edges
# --------------------------------------------------------------------------------------


async def test_silence_and_noise_start_no_turn(voice_head):
    # White noise at about -20 dBFS: Silero scores it as no speech (even at -12 dBFS).
    rng = np.random.default_rng(7)
    noise = (rng.normal(0, 3000, RATE * 5)).clip(-32768, 32767).astype("<i2").tobytes()
    async with session(voice_head, audio={"input": TRANSCRIBE}) as live:
        await live.stream(b"", after_ms=30_000, speed=0)
        quiet = await live.marker()
        await live.stream(noise, after_ms=1000, speed=0)
        noisy = await live.marker()
    for events in (quiet, noisy):
        kinds = {e.type for e in events}
        assert not kinds & {"input_audio_buffer.speech_started", "response.created"}, kinds


async def test_a_long_turn_with_short_pauses_is_one_turn(voice_head, speak):
    sentences = [
        "Once upon a time a fisherman lived near the sea.",
        "Every morning he took his small boat out past the rocks.",
        "He caught fish and sold them at the market in town.",
        "One day he found a bottle with an old map inside.",
        "The map showed an island far to the north.",
        "He decided to sail there with his brave daughter.",
        "They packed bread, water and warm blankets.",
        "After three days the island finally appeared on the horizon.",
    ]
    gap = silence(250)  # well under the VAD's 900 ms; over the 200 ms phrase pause
    audio = gap.join(_trim(speak(s)) for s in sentences)
    assert len(audio) / (2 * RATE) > 20
    vad = {"type": "server_vad", "silence_duration_ms": 900}
    update = {
        "instructions": "Be brief.",
        "output_modalities": ["text"],
        "audio": {"input": {**TRANSCRIBE, "turn_detection": vad}},
    }
    async with session(voice_head, **update) as live:
        live.stream(silence(300) + audio, after_ms=1500, speed=2.0)
        heard = await live.find("conversation.item.input_audio_transcription.completed")
        done = await live.expect("response.done")
        turns = live.since(0, "input_audio_buffer.committed")
        answers = live.since(0, "response.created")
    # One turn, one answer: the answers started early at each pause were dropped unseen.
    assert len(turns) == 1 and len(answers) == 1, [e.type for _, e in live.events]
    said = words(heard.transcript)
    assert {"fisherman", "sea"} & said and {"island", "horizon"} & said, heard.transcript
    # The one answer ran to its end: a story may retell itself up to max_output_tokens
    # (incomplete), but it was not cancelled by a later pause.
    finished = done.response.status == "completed" or (
        done.response.status == "incomplete"
        and done.response.status_details.reason == "max_output_tokens"
    )
    assert finished, done.response


# --------------------------------------------------------------------------------------
# resources and failures
# --------------------------------------------------------------------------------------


async def test_a_client_that_vanishes_mid_answer_frees_its_requests(voice_head):
    update = {"instructions": STORYTELLER, "max_output_tokens": 300}
    async with session(voice_head, **update) as live:
        await typed(live, STORY)
        await live.conn.response.create()
        await live.expect("response.output_audio.delta")
        held = busy(voice_head, THINKER) + busy(voice_head, TALKER)
        live.conn._connection.transport.abort()  # gone: no close frame
    assert held, "the answer should still be under way"
    wait_for(
        lambda: not busy(voice_head, THINKER) and not busy(voice_head, TALKER),
        15,
        0.1,
        "no thinker or talker request in flight",
    )


@pytest.mark.timeout(600)
async def test_a_replica_killed_mid_answer_does_not_end_the_answer(tmp_path: Path):
    two = json.dumps({"0": {"replicas": 2}, "1": {"replicas": 2}})
    head = HeadProc(tmp_path, "voice", "--stage-overrides", two, name="voice-2x2")
    try:
        head.wait_healthy(timeout=300)
        for sid in (THINKER, TALKER):
            head.wait_up(sid, 2, timeout=300)
        # At temperature 0 SmolLM2 ends this one by itself, after a few sentences.
        update = {"instructions": "You are a helpful assistant.", "temperature": 0}
        async with session(head, **update) as live:
            await typed(live, "Describe Paris in four short sentences.")
            await live.conn.response.create()
            killed: dict[int, int] = {}
            while True:
                event = await live.expect("response.output_audio.delta", "response.done")
                if event.type == "response.done":
                    break
                for sid in (TALKER, THINKER):
                    victims = busy(head, sid)
                    if sid not in killed and victims:
                        os.kill(victims[0]["pid"], signal.SIGKILL)
                        killed[sid] = victims[0]["replica_id"]
            assert killed, "no replica was busy while the answer streamed"
            assert event.response.status == "completed", (killed, event.response)
            assert event.response.output[0].content[0].transcript
            again = await ask(live, "Say hello.", output_modalities=["text"])
            assert again.response.status == "completed", again.response
        assert "retry 1 of" in head.log()
    finally:
        head.stop()
