"""A Realtime session over a scripted pipeline and a scripted VAD: barge-in, an early
answer held at a pause and released or dropped, manual commits and closing.

The VAD is the one stand-in for a model here: the test says which append completes a
turn event and where the silence under way began, so every turn is exact."""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import Awaitable, Callable
from types import SimpleNamespace
from typing import Any

import msgspec
import numpy as np
import pytest

from omnistage.audio.server_vad import ServerVadParams, SpeechStarted, SpeechStopped, VadEvent
from omnistage.protocol.chunk_meta import AudioMeta
from omnistage.protocol.enums import FinishReason, Modality
from omnistage.protocol.front import PipelineRequest
from omnistage.protocol.messages import ChatMessage
from omnistage.realtime import audio_input
from omnistage.realtime.backchannel import BackchannelPolicy
from omnistage.realtime.config import SessionConfig
from omnistage.realtime.context import SessionContext
from omnistage.realtime.events import ServerEvent
from omnistage.realtime.session import RealtimeSession
from tests.unit.fakes import FakeService, ScriptedStream, chunk, ticks, until

THINKER, TALKER, LISTENER = 0, 1, 2
AUDIO = AudioMeta(sample_rate=22050, format="pcm16")


class ScriptedVad:
    """A ``VadStream`` whose next events and running silence the test sets."""

    def __init__(self, params: ServerVadParams) -> None:
        self.params = params
        self.detector = SimpleNamespace(silence_from=None)
        self.next: list[VadEvent] = []
        self.late: list[Any] = []  # verdict coroutines handed out after the next feed
        self.fed = 0
        self.resets = 0

    def feed(self, pcm: bytes) -> list[VadEvent]:
        self.fed += len(pcm)
        events, self.next = self.next, []
        return events

    def reset(self) -> None:
        self.resets += 1
        self.detector.silence_from = None

    def verdicts(self) -> list[Any]:
        late, self.late = self.late, []
        return late


class Stats:
    def __init__(self) -> None:
        self.turns = self.barge_ins = 0
        self.first_audio_s: list[float] = []

    def turn(self) -> None:
        self.turns += 1

    def barge_in(self) -> None:
        self.barge_ins += 1

    def first_audio(self, seconds: float) -> None:
        self.first_audio_s.append(seconds)


class Harness:
    """A session, what it sent, its pipeline requests and its VAD."""

    def __init__(
        self,
        *transcripts: str,
        hears: bool = False,
        policy: BackchannelPolicy | None = None,
        guess: bool = False,
        words: Callable[[str, str], Awaitable[float | None]] | None = None,
    ) -> None:
        self.transcripts = list(transcripts)
        self.listened: list[PipelineRequest] = []
        self.answers: list[ScriptedStream] = []
        self.requests: list[PipelineRequest] = []
        self.vads: list[ScriptedVad] = []
        self.sent: list[dict[str, Any]] = []
        self.stats = Stats()

        async def opener(request: PipelineRequest) -> ScriptedStream:
            stream = ScriptedStream(request.request_id)
            if request.only and request.finals == [LISTENER]:
                self.listened.append(request)
                text = self.transcripts.pop(0) if self.transcripts else ""
                stream.put(chunk(LISTENER, Modality.TEXT, text, finished=True))
                stream.end()
            else:
                self.requests.append(request)
                self.answers.append(stream)
            return stream

        def vad(params: ServerVadParams) -> ScriptedVad:
            self.vads.append(ScriptedVad(params))
            return self.vads[-1]

        ctx = SessionContext(
            FakeService(opener=opener),  # type: ignore[arg-type]
            THINKER,
            TALKER,
            None if hears else LISTENER,
            stats=self.stats,
            vad=vad,  # type: ignore[arg-type]
            rate_limits=lambda: [{"name": "requests", "limit": 4, "remaining": 3}],
            hears=hears,
            guess=lambda: guess,
            words=words,
        )
        self.session = RealtimeSession(ctx, SessionConfig(model="voice"), self._sent)
        # Words are awaited however long they take, unless a test says otherwise: whether
        # they come before a timer would otherwise depend on the machine's speed.
        self.session.turns.interruptions.policy = policy or BackchannelPolicy(quick_ms=0)
        self.session.opened()

    def _sent(self, event: ServerEvent) -> None:
        # As the client reads it, were it written to the socket now.
        self.sent.append(msgspec.json.decode(msgspec.json.encode(event)))

    @property
    def vad(self) -> ScriptedVad:
        return self.vads[-1]

    async def send(self, kind: str, **fields: Any) -> None:
        await self.session.handle(json.dumps({"type": kind, **fields}))

    async def append(self, ms: int, *events: VadEvent) -> None:
        """``ms`` of 24 kHz audio; the VAD completes ``events`` with it."""
        self.vad.next = list(events)
        pcm = (np.ones(ms * 24) * 1000).astype("<i2").tobytes()
        await self.send("input_audio_buffer.append", audio=base64.b64encode(pcm).decode())

    def kinds(self) -> list[str]:
        return [e["type"] for e in self.sent]

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.sent if e["type"] == kind]

    def index(self, kind: str) -> int:
        return self.kinds().index(kind)

    def errors(self) -> list[dict[str, Any]]:
        return [e["error"] for e in self.of("error")]

    async def answered(self, n: int = 1) -> ScriptedStream:
        """The ``n``-th answer's pipeline stream, once the session has opened it."""
        await until(lambda: len(self.answers) >= n, what=f"answer {n}")
        return self.answers[n - 1]


def words(*texts: str) -> list[Any]:
    out = [chunk(THINKER, Modality.TEXT, t) for t in texts]
    return [*out, chunk(THINKER, Modality.TEXT, finished=True, finish_reason=FinishReason.STOP)]


def speech(text: str, samples: int = 2205) -> Any:
    pcm = (np.sin(np.arange(samples) / 10) * 8000).astype("<i2").tobytes()
    return chunk(TALKER, Modality.AUDIO, text, pcm, meta=AUDIO)


async def consumed(stream: ScriptedStream) -> None:
    await until(lambda: stream.pending == 0, what="the chunks to be read")
    await ticks()


async def spoken_turn(h: Harness, start_ms: int = 0) -> None:
    """A turn the VAD starts and ends, with no pause the session hears before."""
    await h.append(100, SpeechStarted(start_ms))
    await h.append(300, SpeechStopped(start_ms + 300))


# ------------------------------------------------------------------------ turns


async def test_a_turn_is_committed_transcribed_and_answered() -> None:
    h = Harness("what time is it")
    await h.send("session.update", session={"audio": {"input": {"transcription": {"model": "w"}}}})
    await spoken_turn(h)
    answer = await h.answered()
    answer.put(*words("Noon."), speech("Noon."))
    answer.end()
    await until(lambda: h.of("response.done"), what="response.done")
    kinds = h.kinds()
    assert kinds[:5] == [
        "session.created",
        "session.updated",
        "input_audio_buffer.speech_started",
        "input_audio_buffer.speech_stopped",
        "input_audio_buffer.committed",
    ]
    assert h.index("conversation.item.added") < h.index("response.created")
    (completed,) = h.of("conversation.item.input_audio_transcription.completed")
    assert completed["transcript"] == "what time is it"
    # The thinker heard the turn's words, after the transcript was ready.
    assert h.index("conversation.item.input_audio_transcription.completed") < h.index(
        "response.output_item.added"
    )
    messages = h.requests[0].prompt.messages
    assert messages is not None and messages[-1].content == "what time is it"
    assert h.of("response.done")[0]["response"]["status"] == "completed"
    item_id = h.of("input_audio_buffer.committed")[0]["item_id"]
    assert h.of("input_audio_buffer.speech_started")[0]["item_id"] == item_id
    assert next(i.id for i in h.session.conversation) == item_id
    assert len(h.session.conversation) == 2  # the turn and its answer
    assert h.stats.turns == 1 and len(h.stats.first_audio_s) == 1
    assert h.errors() == []
    # After each answer, the server's limits (the route: sessions at once).
    assert kinds[kinds.index("response.done") + 1] == "rate_limits.updated"
    assert h.of("rate_limits.updated")[0]["rate_limits"][0]["remaining"] == 3


async def test_a_turn_ended_by_a_late_verdict_is_committed_when_it_comes() -> None:
    """semantic_vad's verdict is awaited off the loop: the audio that asked for it is
    handled first, and the turn ends when the verdict comes (a superseded VAD's does not)."""
    h = Harness("what time is it")
    await h.append(100, SpeechStarted(0))
    verdict: asyncio.Future[list[VadEvent]] = asyncio.get_running_loop().create_future()

    async def late() -> list[VadEvent]:
        return await verdict

    h.vad.late.append(late())
    await h.append(300)
    assert "input_audio_buffer.speech_stopped" not in h.kinds()
    verdict.set_result([SpeechStopped(300)])
    await until(lambda: h.of("input_audio_buffer.committed"), what="the commit")
    assert h.of("input_audio_buffer.speech_stopped")[0]["audio_end_ms"] == 300
    await h.answered()


async def test_a_thinker_that_hears_is_given_each_turns_audio_itself() -> None:
    """An omni thinker: no listener request; the answer's prompt carries the turn's
    audio as Realtime pcm16, in the last user message, which has no words."""
    h = Harness(hears=True)
    await spoken_turn(h)
    answer = await h.answered()
    answer.put(*words("Hi."))
    answer.end()
    await until(lambda: h.of("response.done"), what="response.done")
    await h.append(200, SpeechStarted(450))
    await h.append(100, SpeechStopped(650))
    await h.answered(2)

    assert h.listened == []
    first, second = (r.prompt for r in h.requests)
    assert (first.audio_format, first.sample_rate) == ("pcm16", 24000)
    assert len(first.audio) == 400 * 48  # both appends: all of it, not only the first
    assert set(np.frombuffer(first.audio, "<i2")) == {1000}
    assert first.messages is not None and first.messages[-1] == ChatMessage("user", "")
    # The next turn is the one heard; the first, which has no words, drops out.
    assert len(second.audio) == 250 * 48  # from its start (450 ms) to the last append's end
    assert second.messages is not None
    assert [(m.role, m.content) for m in second.messages[-2:]] == [
        ("assistant", "Hi."),
        ("user", ""),
    ]
    assert all(m.role != "user" for m in second.messages[:-1])


async def test_a_thinker_that_hears_hears_a_created_items_audio() -> None:
    h = Harness(hears=True)
    pcm = (np.arange(2400) % 500).astype("<i2").tobytes()
    part = {"type": "input_audio", "audio": base64.b64encode(pcm).decode()}
    item = {"type": "message", "role": "user", "content": [part]}
    await h.send("conversation.item.create", item=item)
    await h.send("response.create")
    await h.answered()
    (prompt,) = (r.prompt for r in h.requests)
    assert prompt.audio == pcm  # the session's pcm16 is 24 kHz already: as it was sent
    assert prompt.messages is not None and prompt.messages[-1] == ChatMessage("user", "")
    (added,) = h.of("conversation.item.added")
    assert added["item"]["content"] == [{"type": "input_audio"}]  # not echoed back
    part["audio"] = "not base64!"
    await h.send("conversation.item.create", item=item)
    assert h.errors()[-1]["param"] == "item.content[0].audio"


async def test_a_turns_words_are_judged_as_a_reply_to_the_last_answer() -> None:
    asked: list[tuple[str, str]] = []

    async def judge(words: str, said: str) -> float | None:
        asked.append((words, said))
        return 0.5

    h = Harness(words=judge)
    judged = h.session.audio._words  # what the audio input asks at a silence
    assert judged is not None and await judged("hello") == 0.5
    said = {"type": "output_text", "text": "Which city?"}
    await h.send(
        "conversation.item.create",
        item={"type": "message", "role": "assistant", "content": [said]},
    )
    await judged("paris")
    assert asked == [("hello", ""), ("paris", "Which city?")]
    assert Harness().session.audio._words is None  # no judge: semantic_vad hears only


async def test_speech_during_an_answer_cancels_it_and_no_audio_follows() -> None:
    """Plain barge-in, where backchannels are not told apart (the default, which waits
    to hear them, is in test_realtime_interruptions.py)."""
    h = Harness("tell me a story")
    td = {"type": "server_vad", "resume_after_backchannel": False}
    await h.send("session.update", session={"audio": {"input": {"turn_detection": td}}})
    await spoken_turn(h)
    answer = await h.answered()
    answer.put(*words("Once upon a time.", " The end."), speech("Once upon a time."))
    await until(lambda: h.of("response.output_audio.delta"), what="the first audio")
    await h.append(100, SpeechStarted(900))  # the user talks over the answer
    answer.put(speech("The end."))
    await ticks(20)
    assert answer.closed and h.stats.barge_ins == 1
    started = h.kinds().index("input_audio_buffer.speech_started", 3)
    assert "response.output_audio.delta" not in h.kinds()[started:]
    (done,) = h.of("response.done")
    assert h.sent.index(done) < started
    assert done["response"]["status_details"] == {"type": "cancelled", "reason": "turn_detected"}
    answer_item = done["response"]["output"][0]
    assert answer_item["content"][0]["transcript"] == "Once upon a time."
    assert h.session.conversation.get(answer_item["id"]).json["status"] == "incomplete"


async def test_interrupt_response_false_lets_the_answer_go_on() -> None:
    h = Harness("hi")
    td = {"turn_detection": {"type": "server_vad", "interrupt_response": False}}
    await h.send("session.update", session={"audio": {"input": td}})
    await spoken_turn(h)
    answer = await h.answered()
    answer.put(chunk(THINKER, Modality.TEXT, "Hello"))
    await h.append(100, SpeechStarted(900))
    answer.put(*words(" there"))
    answer.end()
    await until(lambda: h.of("response.done"), what="response.done")
    assert h.of("response.done")[0]["response"]["status"] == "completed"
    assert h.stats.barge_ins == 0


# ------------------------------------------------------------------------ early answers


async def pause(h: Harness) -> ScriptedStream:
    """A turn started, then 200 ms of silence: the session answers early."""
    await h.append(100, SpeechStarted(0))
    h.vad.detector.silence_from = 100
    await h.append(200)
    answer = await h.answered()
    answer.put(*words("Sure."), speech("Sure."))
    await consumed(answer)
    return answer


async def test_an_early_answer_is_held_until_the_turn_ends() -> None:
    h = Harness("can you help")
    await h.send("session.update", session={"audio": {"input": {"transcription": {"model": "w"}}}})
    answer = await pause(h)
    assert len(h.listened) == 1  # the phrase before the pause is being transcribed
    assert h.kinds() == [
        "session.created",
        "session.updated",
        "input_audio_buffer.speech_started",
    ]  # the answer has said everything so far, and nothing of it went out
    await h.append(100, SpeechStopped(100))
    # Committed first, then the held answer in the order it was made.
    kinds = h.kinds()[3:]
    assert kinds[:4] == [
        "input_audio_buffer.speech_stopped",
        "input_audio_buffer.committed",
        "conversation.item.added",
        # The phrase was heard while the answer was held: its words go out now.
        "conversation.item.input_audio_transcription.delta",
    ]
    held = [
        "response.created",
        "response.output_item.added",
        "conversation.item.added",
        "response.content_part.added",
        "response.output_audio_transcript.delta",
        "response.output_audio.delta",
    ]
    assert kinds[4:10] == held
    answer.end()
    await until(lambda: h.of("response.done"), what="response.done")
    assert h.of("response.done")[0]["response"]["status"] == "completed"
    user_id = h.of("input_audio_buffer.committed")[0]["item_id"]
    assert h.of("conversation.item.added")[0]["item"]["id"] == user_id
    # One listener request for the whole turn: the early answer's transcript is reused.
    assert len(h.listened) == 1 and len(h.requests) == 1
    messages = h.requests[0].prompt.messages
    assert messages is not None and messages[-1].content == "can you help"
    assert next(i.id for i in h.session.conversation) == user_id


async def test_speech_after_the_pause_drops_the_early_answer() -> None:
    h = Harness("so", "what is the weather")
    early = await pause(h)
    early_id = h.requests[0].request_id.removeprefix("realtime-")
    h.vad.detector.silence_from = None  # the user goes on
    await h.append(100)
    assert early.closed
    early.put(speech("Late."))
    await h.append(300, SpeechStopped(500))
    answer = await h.answered(2)
    answer.put(*words("Sunny."), speech("Sunny."))
    answer.end()
    await until(lambda: h.of("response.done"), what="response.done")
    (done,) = h.of("response.done")
    assert done["response"]["id"] != early_id
    assert not any(e.get("response_id") == early_id for e in h.sent)
    assert not any(e.get("response", {}).get("id") == early_id for e in h.sent)
    assert len(h.of("response.created")) == 1
    # Both phrases are the turn's words.
    messages = h.requests[1].prompt.messages
    assert messages is not None and messages[-1].content == "so what is the weather"
    assert len(h.session.conversation) == 2


async def test_a_new_turn_drops_an_early_answer() -> None:
    h = Harness("one", "two")
    early = await pause(h)
    await h.append(100, SpeechStopped(100), SpeechStarted(150))
    # The stop committed the turn and released the early answer; the new turn holds it,
    # and, being a request ("two"), cancels it.
    assert h.session.turns.interruptions.held is h.session.response
    await h.append(300, SpeechStopped(450))
    await until(lambda: early.closed, what="the answer to be cancelled")
    assert h.stats.barge_ins == 1
    assert h.of("response.done")[0]["response"]["status"] == "cancelled"


async def test_a_guessed_phrase_is_answered_before_its_pause_ends_it_and_kept_after() -> None:
    # Transcripts in the order the listener requests are made: the phrase's own request
    # (opened with its first audio, dropped once the guess has the words), the guess's.
    h = Harness("(its own request)", "can you help", guess=True)
    await h.append(100, SpeechStarted(0))
    h.vad.detector.silence_from = 100
    await h.append(40)  # quiet for 40 ms: shorter than the pause that ends a phrase
    answer = await h.answered()  # started on the guess's words
    assert len(h.listened) == 2 and h.kinds()[-1] == "input_audio_buffer.speech_started"
    answer.put(*words("Sure."), speech("Sure."))
    await consumed(answer)
    await h.append(200)  # the pause ends the phrase with the guess's words: kept
    assert not answer.closed and len(h.requests) == 1
    await h.append(100, SpeechStopped(100))
    answer.end()
    await until(lambda: h.of("response.done"), what="response.done")
    assert h.of("response.done")[0]["response"]["status"] == "completed"
    assert len(h.requests) == 1 and len(h.of("response.created")) == 1
    assert h.of("response.output_audio.delta")
    messages = h.requests[0].prompt.messages
    assert messages is not None and messages[-1].content == "can you help"


async def test_an_answer_on_a_guess_is_dropped_when_the_user_goes_on() -> None:
    h = Harness("can you help me with", "can you help", guess=True)
    await h.append(100, SpeechStarted(0))
    h.vad.detector.silence_from = 100
    await h.append(40)
    early = await h.answered()
    h.vad.detector.silence_from = None  # a dip between words, not a pause
    await h.append(100)
    assert early.closed
    await h.append(300, SpeechStopped(500))
    answer = await h.answered(2)
    answer.put(*words("Sure."))
    answer.end()
    await until(lambda: h.of("response.done"), what="response.done")
    assert len(h.of("response.created")) == 1
    # The phrase went on: its own request's words, not the guess's.
    messages = h.requests[1].prompt.messages
    assert messages is not None and messages[-1].content == "can you help me with"


async def test_a_clients_response_create_replaces_a_held_answer() -> None:
    h = Harness("hello")
    early = await pause(h)
    await h.send("response.create")
    assert early.closed
    answer = await h.answered(2)
    await h.append(100, SpeechStopped(100))
    answer.put(*words("Hi."))
    answer.end()
    await until(lambda: h.of("response.done"), what="response.done")
    assert len(h.of("response.created")) == 1 and h.errors() == []
    assert h.of("response.done")[0]["response"]["status"] == "completed"
    assert h.session.response is not None
    assert h.session.response.id == h.of("response.done")[0]["response"]["id"]


# ------------------------------------------------------------------------ push-to-talk


async def push_to_talk() -> Harness:
    h = Harness("push")
    await h.send("session.update", session={"audio": {"input": {"turn_detection": None}}})
    return h


async def test_a_commit_of_under_100_ms_is_refused() -> None:
    h = await push_to_talk()
    await h.append(50)
    await h.send("input_audio_buffer.commit", event_id="c1")
    (error,) = h.errors()
    assert error["code"] == "input_audio_buffer_commit_empty" and error["event_id"] == "c1"
    assert "50 ms" in error["message"]
    await h.append(60)
    await h.send("input_audio_buffer.commit")
    assert len(h.errors()) == 1
    (committed,) = h.of("input_audio_buffer.committed")
    assert committed["previous_item_id"] is None
    assert h.requests == []  # push-to-talk: no answer until response.create
    await h.send("response.create")
    answer = await h.answered()
    answer.put(*words("Yes."))
    answer.end()
    await until(lambda: h.of("response.done"), what="response.done")
    messages = h.requests[0].prompt.messages
    assert messages is not None and messages[-1].content == "push"


async def test_an_empty_buffer_cannot_be_committed() -> None:
    h = await push_to_talk()
    await h.send("input_audio_buffer.commit")
    assert h.errors()[0]["code"] == "input_audio_buffer_commit_empty"


async def test_push_to_talk_audio_over_the_limit_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(audio_input, "MAX_BUFFER_MS", 300)
    h = await push_to_talk()
    await h.append(200)
    await h.append(200)
    (error,) = h.errors()
    assert (error["code"], error["param"]) == ("input_audio_buffer_full", "audio")
    assert h.session.audio.held_ms() == 200  # the refused append was not kept
    await h.send("input_audio_buffer.clear")
    await h.append(200)
    assert len(h.errors()) == 1 and h.of("input_audio_buffer.cleared")


async def test_bad_audio_and_bad_frames_are_errors_and_the_session_goes_on() -> None:
    h = Harness()
    await h.send("input_audio_buffer.append", audio="not base64!", event_id="a1")
    await h.session.handle("{")
    await h.send("response.cancel")
    codes = [(e["code"], e["param"], e["event_id"]) for e in h.errors()]
    assert codes == [
        ("invalid_value", "audio", "a1"),
        ("invalid_json", None, None),
        ("response_cancel_not_active", "", None),
    ]


async def test_a_wav_file_where_raw_samples_belong_is_refused() -> None:
    h = Harness()
    header = b"RIFF" + (36).to_bytes(4, "little") + b"WAVEfmt " + bytes(24)
    await h.send("input_audio_buffer.append", audio=base64.b64encode(header).decode())
    [error] = h.errors()
    assert error["param"] == "audio" and "WAV file" in error["message"]
    assert len(h.session.audio.buffer) == 0  # nothing of it was taken as audio


# ------------------------------------------------------------------------ closing


async def test_close_cancels_everything() -> None:
    h = Harness("first", "second")
    await spoken_turn(h)
    answer = await h.answered()
    answer.put(chunk(THINKER, Modality.TEXT, "Let me"))
    await consumed(answer)
    await h.append(100, SpeechStarted(900))  # barge-in, and a turn under way
    await h.append(100, SpeechStopped(1000))
    second = await h.answered(2)
    await h.session.close()
    assert answer.closed and second.closed
    statuses = [e["response"]["status"] for e in h.of("response.done")]
    assert statuses == ["cancelled", "cancelled"]
    sent = len(h.sent)
    second.put(*words("late"))
    await ticks(20)
    assert len(h.sent) == sent
    assert h.vad.resets >= 1


async def test_close_drops_a_held_answer_without_a_word() -> None:
    h = Harness("hmm")
    early = await pause(h)
    await h.session.close()
    assert early.closed
    assert h.kinds() == ["session.created", "input_audio_buffer.speech_started"]
