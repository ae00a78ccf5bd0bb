"""One Realtime response over a scripted pipeline: its events in order, audio in the
session's format, cancellation, tool calls and how it ends."""

from __future__ import annotations

import asyncio
import base64
from math import ceil
from typing import Any

import msgspec
import numpy as np
import pytest

from omnistage.audio.formats import PCM, PCMU, AudioFormat
from omnistage.protocol.chunk_meta import AudioMeta, ToolCallMeta
from omnistage.protocol.enums import FinishReason, Modality
from omnistage.protocol.errors import BadRequestError
from omnistage.protocol.front import PipelineRequest
from omnistage.protocol.messages import ChatMessage, Prompt, Usage
from omnistage.realtime.conversation import Item, Spoken
from omnistage.realtime.events import ServerEvent
from omnistage.realtime.replies import ResponseSettings
from omnistage.realtime.response_run import ResponseRun, StopReason
from tests.unit.fakes import FakeService, ScriptedStream, chunk, until

THINKER, TALKER = 0, 1
TTS_RATE = 22050
AUDIO = AudioMeta(sample_rate=TTS_RATE, format="pcm16")


def settings(modality: str = "audio", fmt: AudioFormat = PCM, **kw: Any) -> ResponseSettings:
    base: dict[str, Any] = dict(
        modalities=(modality,),
        output_format=fmt,
        voice="alloy",
        speed=1.0,
        tools=[],
        tool_choice="auto",
        max_output_tokens=None,
        temperature=None,
    )
    return ResponseSettings(**{**base, **kw})


def on_the_wire(event: ServerEvent) -> tuple[str, dict[str, Any]]:
    """An event as the client reads it when it is sent: its type and its other fields
    (the session, not the run, gives it its id)."""
    fields = msgspec.json.decode(msgspec.json.encode(event))
    assert fields.pop("event_id") == ""
    return fields.pop("type"), fields


class Pipeline:
    """A fake service whose one request streams what the test puts."""

    def __init__(self) -> None:
        self.stream = ScriptedStream(usage=Usage(prompt_tokens=7, completion_tokens=3))
        self.requests: list[PipelineRequest] = []

        async def opener(request: PipelineRequest) -> ScriptedStream:
            self.requests.append(request)
            return self.stream

        self.service = FakeService(opener=opener)


class Run:
    """A ``ResponseRun`` with its events and conversation items recorded."""

    def __init__(self, s: ResponseSettings, talker: int | None = TALKER) -> None:
        self.pipeline = Pipeline()
        self.events: list[tuple[str, dict[str, Any]]] = []
        self.items: list[Item] = []
        self.run = ResponseRun(
            self.pipeline.service,  # type: ignore[arg-type]
            (THINKER, talker),
            s,
            lambda: Prompt(messages=[ChatMessage("user", "hi")]),
            lambda event: self.events.append(on_the_wire(event)),
            on_item=self.items.append,
            affinity="sess_1",
        )
        self.task: asyncio.Task[None] | None = None

    @property
    def stream(self) -> ScriptedStream:
        return self.pipeline.stream

    def start(self, before: Any = None) -> None:
        self.run.created()
        self.task = asyncio.ensure_future(self.run.run(before))

    async def finish(self) -> None:
        assert self.task is not None
        await asyncio.wait_for(self.task, 5)

    def kinds(self) -> list[str]:
        return [kind for kind, _ in self.events]

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [fields for k, fields in self.events if k == kind]

    def audio_bytes(self) -> bytes:
        deltas = self.of("response.output_audio.delta")
        return b"".join(base64.b64decode(d["delta"]) for d in deltas)

    def done(self) -> dict[str, Any]:
        (done,) = self.of("response.done")
        assert self.kinds()[-1] == "response.done"
        return done["response"]  # type: ignore[no-any-return]


def words(*texts: str, reason: FinishReason = FinishReason.STOP) -> list[Any]:
    out = [chunk(THINKER, Modality.TEXT, t) for t in texts]
    out.append(chunk(THINKER, Modality.TEXT, finished=True, finish_reason=reason))
    return out


def speech(text: str, samples: int) -> Any:
    pcm = (np.sin(np.arange(samples) / 10) * 8000).astype("<i2").tobytes()
    return chunk(TALKER, Modality.AUDIO, text, pcm, meta=AUDIO)


async def test_a_text_answer_streams_its_events_in_order() -> None:
    r = Run(settings("text"))
    r.start()
    r.stream.put(*words("Hello", " world"))
    r.stream.end()
    await r.finish()
    assert r.kinds() == [
        "response.created",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "conversation.item.done",
        "response.done",
    ]
    assert [d["delta"] for d in r.of("response.output_text.delta")] == ["Hello", " world"]
    assert r.of("response.output_text.done")[0]["text"] == "Hello world"
    inner = [f for k, f in r.events if k.startswith("response.") and "response" not in f]
    assert len(inner) == 7 and all(f["response_id"] == r.run.id for f in inner)
    assert r.of("response.created")[0]["response"]["id"] == r.run.id
    response = r.done()
    assert response["status"] == "completed" and response["status_details"] is None
    (item,) = response["output"]
    assert item["status"] == "completed" and item["role"] == "assistant"
    assert item["content"] == [{"type": "output_text", "text": "Hello world"}]
    assert response["usage"]["total_tokens"] == 10 and response["usage"]["input_tokens"] == 7
    assert [i.id for i in r.items] == [item["id"]]  # the session got the item
    (request,) = r.pipeline.requests
    assert request.finals == [THINKER] and request.affinity == "sess_1"
    assert request.prompt.messages == [ChatMessage("user", "hi")]
    assert r.stream.closed


@pytest.mark.parametrize(("fmt", "bytes_per_sample"), [(PCM, 2), (PCMU, 1)])
async def test_an_audio_answer_sends_audio_in_the_session_format(
    fmt: AudioFormat, bytes_per_sample: int
) -> None:
    r = Run(settings("audio", fmt))
    r.start()
    r.stream.put(*words("Hello there.", " Bye now."))
    r.stream.put(speech("Hello there. ", 4410), speech("Bye now.", 2205))
    r.stream.end()
    await r.finish()
    # All the speech, resampled from 22050 Hz to the format's rate, nothing more.
    assert len(r.audio_bytes()) == ceil(6615 * fmt.rate / TTS_RATE) * bytes_per_sample
    deltas = r.of("response.output_audio.delta")
    assert len(deltas) == 3  # one per sentence, and the resampler's tail
    transcript = [d["delta"] for d in r.of("response.output_audio_transcript.delta")]
    assert transcript == ["Hello there.", " Bye now."]
    kinds = r.kinds()
    assert kinds.index("response.output_audio.done") < kinds.index(
        "response.output_audio_transcript.done"
    )
    (done,) = r.of("response.output_audio_transcript.done")
    assert done["transcript"] == "Hello there. Bye now."
    part = r.of("response.content_part.done")[0]["part"]
    assert part == {"type": "audio", "transcript": "Hello there. Bye now."}
    assert r.run.message is not None
    assert r.run.message.spoken == [Spoken("Hello there.", 200.0), Spoken("Bye now.", 100.0)]
    assert r.run.audio_sent_ms == 300.0 and r.run.first_audio_at is not None
    response = r.done()
    assert response["status"] == "completed"
    assert response["audio"]["output"]["format"] == fmt.to_json()
    assert response["output"][0]["content"][0] == {
        "type": "output_audio",
        "transcript": "Hello there. Bye now.",
    }
    assert r.pipeline.requests[0].finals == [THINKER, TALKER]


async def test_a_cancelled_answer_says_nothing_more_and_keeps_what_was_sent() -> None:
    r = Run(settings("audio"))
    r.start()
    r.stream.put(*words("First one.", " Second one."))
    r.stream.put(speech("First one.", 2205))
    await until(lambda: r.of("response.output_audio.delta"), what="the first audio")
    r.run.cancel(StopReason.TURN_DETECTED)
    assert r.stream.closed and r.run.done
    sent = len(r.events)
    r.stream.put(speech("Second one.", 2205))  # too late: the stream was aborted
    await r.finish()
    assert len(r.events) == sent
    kinds = r.kinds()
    last_delta = max(i for i, k in enumerate(kinds) if k == "response.output_audio.delta")
    assert kinds.index("response.output_audio.done") > last_delta
    assert len(r.of("response.output_audio.delta")) == 1  # no tail after a cancel
    response = r.done()
    assert response["status"] == "cancelled"
    assert response["status_details"] == {"type": "cancelled", "reason": "turn_detected"}
    (item,) = response["output"]
    assert item["status"] == "incomplete"
    # The words the thinker wrote are more than was said: the item keeps what was sent.
    assert item["content"][0]["transcript"] == "First one."
    r.run.cancel(StopReason.CLIENT_CANCELLED)  # a second cancel changes nothing
    assert len(r.events) == sent


async def test_a_cancel_before_the_request_opens_sends_nothing_to_the_pipeline() -> None:
    r = Run(settings("text"))
    gate: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    r.start(gate)
    r.run.cancel(StopReason.CLIENT_CANCELLED)
    gate.set_result(None)
    await r.finish()
    assert r.pipeline.requests == []
    assert r.kinds() == ["response.created", "response.done"]
    assert r.done()["status"] == "cancelled"


async def test_a_failed_transcription_fails_the_response() -> None:
    async def before() -> None:
        raise RuntimeError("listener down")

    r = Run(settings("text"))
    r.start(before())
    await r.finish()
    details = r.done()["status_details"]
    assert details["type"] == "failed" and details["error"]["code"] == "transcription_failed"
    assert r.pipeline.requests == []


async def test_tool_calls_become_function_call_items() -> None:
    r = Run(settings("text"))
    r.start()
    weather = ToolCallMeta(index=0, name="weather")
    clock = ToolCallMeta(index=1, name="time")
    r.stream.put(
        chunk(THINKER, Modality.TOOL_CALL, '{"city": ', meta=weather),
        chunk(THINKER, Modality.TOOL_CALL, "{}", meta=clock),
        chunk(THINKER, Modality.TOOL_CALL, '"Oslo"}', meta=weather),
        chunk(THINKER, Modality.TEXT, finished=True, finish_reason=FinishReason.TOOL_CALLS),
    )
    r.stream.end()
    await r.finish()
    added = [f["item"] for f in r.of("response.output_item.added")]
    assert [(i["type"], i["name"]) for i in added] == [
        ("function_call", "weather"),
        ("function_call", "time"),
    ]
    deltas = r.of("response.function_call_arguments.delta")
    assert [(d["output_index"], d["delta"]) for d in deltas] == [
        (0, '{"city": '),
        (1, "{}"),
        (0, '"Oslo"}'),
    ]
    assert deltas[0]["call_id"] == added[0]["call_id"] and deltas[0]["item_id"] == added[0]["id"]
    done = r.of("response.function_call_arguments.done")
    assert [(d["name"], d["arguments"]) for d in done] == [
        ("weather", '{"city": "Oslo"}'),
        ("time", "{}"),
    ]
    response = r.done()
    assert response["status"] == "completed"
    assert [i["arguments"] for i in response["output"]] == ['{"city": "Oslo"}', "{}"]
    assert all(i["status"] == "completed" for i in response["output"])
    assert len(r.items) == 2 and r.run.message is None


async def test_tools_go_to_the_thinker() -> None:
    tools = [{"type": "function", "name": "weather", "parameters": {"type": "object"}}]
    r = Run(settings("text", tools=tools, max_output_tokens=20, temperature=0.3))
    r.start()
    r.stream.put(*words("ok"))
    r.stream.end()
    await r.finish()
    text = r.pipeline.requests[0].stage_params[THINKER].text
    assert text is not None and text.max_tokens == 20 and text.temperature == 0.3
    assert text.tools == [
        {"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}
    ]


async def test_a_length_finish_is_incomplete() -> None:
    r = Run(settings("text", max_output_tokens=2))
    r.start()
    r.stream.put(*words("Once", " upon", reason=FinishReason.LENGTH))
    r.stream.end()
    await r.finish()
    response = r.done()
    assert response["status"] == "incomplete"
    assert response["status_details"] == {"type": "incomplete", "reason": "max_output_tokens"}
    assert response["output"][0]["status"] == "incomplete"
    assert response["max_output_tokens"] == 2


async def test_an_audio_answer_out_of_tokens_was_said_whole() -> None:
    """Not cut short: every sample made goes out (the resampler's tail too), and the
    transcript is the words (a talker's chunks may carry none, as an omni model's)."""
    r = Run(settings("audio", max_output_tokens=2))
    r.start()
    r.stream.put(*words("Once", " upon", reason=FinishReason.LENGTH))
    r.stream.put(speech("", 4410))
    r.stream.end()
    await r.finish()
    assert r.done()["status"] == "incomplete"
    assert len(r.audio_bytes()) == ceil(4410 * PCM.rate / TTS_RATE) * 2
    (done,) = r.of("response.output_audio_transcript.done")
    assert done["transcript"] == "Once upon"


async def test_a_stage_failure_fails_the_response() -> None:
    r = Run(settings("audio"))
    r.start()
    r.stream.put(*words("Hi.")[:1])
    r.stream.fail(RuntimeError("talker died"))
    await r.finish()
    response = r.done()
    assert response["status"] == "failed"
    error = response["status_details"]["error"]
    assert error == {"type": "server_error", "code": "stage_failed", "message": "talker died"}
    assert response["output"][0]["status"] == "incomplete"
    assert r.stream.closed


async def test_a_refused_request_fails_as_the_clients_error() -> None:
    r = Run(settings("text"))
    r.start()
    r.stream.fail(BadRequestError("prompt too long", code="context_length_exceeded"))
    await r.finish()
    error = r.done()["status_details"]["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "context_length_exceeded"


async def test_an_audio_answer_without_a_talker_is_text_and_out_of_band_adds_no_item() -> None:
    r = Run(settings("audio", in_conversation=False), talker=None)
    r.start()
    r.stream.put(*words("Hi"))
    r.stream.end()
    await r.finish()
    assert "response.output_text.delta" in r.kinds()
    assert "conversation.item.done" not in r.kinds()
    assert r.items == [] and r.done()["conversation_id"] is None
    assert r.pipeline.requests[0].finals == [THINKER]
