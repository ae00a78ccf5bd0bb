"""Pipecat's OpenAI Realtime service (``pipecat-ai``) holds a spoken conversation with
the voice pipeline: a framework users already run, unchanged, pointed at omnistage.

One conversation for the module, on the shared ``voice_head``: a microphone processor
feeds the head's own Piper voice (``/v1/audio/speech``) in 20 ms frames at real time,
silence between phrases, into a pipeline of Pipecat's context aggregators around
``OpenAIRealtimeLLMService`` (server VAD, Whisper transcription), with a sink that
records what comes out. The turns: the app's greeting (``LLMRunFrame``, as Pipecat's
examples start), a story request whose answer is interrupted by a spoken request (then
answered), then a spoken weather question answered through a tool call. Each test reads the one
record, ordered as things happened in the one event loop. The service is Pipecat's own;
its subclass here only notes the server events it handles.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from tests.integration.harness import HeadProc
from tests.speech import heard_as

pipecat = pytest.importorskip("pipecat.services.openai.realtime.llm")

from pipecat.frames.frames import (  # noqa: E402
    CancelFrame,
    EndFrame,
    ErrorFrame,
    Frame,
    InputAudioRawFrame,
    InterruptionFrame,
    LLMRunFrame,
    LLMUpdateSettingsFrame,
    OutputAudioRawFrame,
    StartFrame,
    TTSTextFrame,
)
from pipecat.pipeline.pipeline import Pipeline  # noqa: E402
from pipecat.pipeline.worker import PipelineParams, PipelineWorker  # noqa: E402
from pipecat.processors.aggregators.llm_context import LLMContext  # noqa: E402
from pipecat.processors.aggregators.llm_response_universal import (  # noqa: E402
    LLMContextAggregatorPair,
)
from pipecat.processors.frame_processor import FrameDirection, FrameProcessor  # noqa: E402
from pipecat.services.openai.realtime import events as rt  # noqa: E402
from pipecat.workers.runner import WorkerRunner  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

RATE = 24000  # the Realtime session's pcm16 rate, and /v1/audio/speech's pcm
FRAME = RATE // 50  # 20 ms, as a transport's microphone frames
WAIT_S = 120.0  # generous: the machine is shared, the models run on its CPUs
WEATHER = "What is the weather in Paris?"
STORY = "Tell me a long story about a dragon."
# One breath, no comma: longer than a backchannel (``BackchannelPolicy.max_speech_ms``)
# before its first pause, so it cancels the answer on its length alone. ("Wait, stop,
# ..." pauses after "Wait", short enough to resume the answer until its words are heard:
# a short answer could end in that window.)
STOP = "Stop the story now and listen to my other question."
STORYTELLER = "You are a storyteller. Tell long stories of many sentences."
ASSISTANT = "You are a helpful assistant."
Record = list[tuple[Any, ...]]


class Mic(FrameProcessor):
    """A microphone: 20 ms frames at real time, silence unless a phrase is queued."""

    def __init__(self, record: Record) -> None:
        super().__init__()
        self.record = record
        self.phrases: list[tuple[str, np.ndarray]] = []
        self.task: asyncio.Task[None] | None = None

    def say(self, name: str, pcm: bytes) -> None:
        self.phrases.append((name, np.frombuffer(pcm, "<i2")))

    async def process_frame(self, frame: Frame, direction: FrameDirection) -> None:
        await super().process_frame(frame, direction)
        if isinstance(frame, StartFrame) and self.task is None:
            self.task = self.create_task(self.run())
        elif isinstance(frame, (EndFrame, CancelFrame)) and self.task is not None:
            await self.cancel_task(self.task)
        await self.push_frame(frame, direction)

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        due, current, at = loop.time(), None, 0
        while True:
            due += FRAME / RATE
            await asyncio.sleep(max(0.0, due - loop.time()))
            if current is None and self.phrases:
                (name, current), at = self.phrases.pop(0), 0
                self.record.append(("said", name))
            chunk = np.zeros(FRAME, np.int16)
            if current is not None:
                part = current[at : at + FRAME]
                chunk[: len(part)] = part
                at += FRAME
                if at >= len(current):
                    current = None
            audio = InputAudioRawFrame(audio=chunk.tobytes(), sample_rate=RATE, num_channels=1)
            await self.push_frame(audio)


class Sink(FrameProcessor):
    """Where the bot's output would be played: records what reaches it."""

    def __init__(self, record: Record) -> None:
        super().__init__()
        self.record = record

    async def process_frame(self, frame: Frame, direction: FrameDirection) -> None:
        await super().process_frame(frame, direction)
        if isinstance(frame, OutputAudioRawFrame):
            self.record.append(("audio", len(frame.audio)))
        elif isinstance(frame, InterruptionFrame):
            self.record.append(("interruption",))
        elif isinstance(frame, ErrorFrame):
            self.record.append(("error", frame.error))
        elif isinstance(frame, TTSTextFrame):
            self.record.append(("said_by_bot", frame.text))
        await self.push_frame(frame, direction)


class Service(pipecat.OpenAIRealtimeLLMService):
    """Pipecat's service as is, noting the server events a test checks as they come."""

    def __init__(self, record: Record, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.record = record

    async def _handle_evt_session_updated(self, evt: Any) -> None:
        self.record.append(("session.updated",))
        await super()._handle_evt_session_updated(evt)

    async def _handle_evt_response_created(self, evt: Any) -> None:
        self.record.append(("response.created", evt.response.id))
        await super()._handle_evt_response_created(evt)

    # Noted here, as it comes, not from the "on_conversation_item_created" event handler:
    # Pipecat runs event handlers as tasks, which can note an item after the events that
    # came after it (a tool's result after the answer's response.created).
    async def _handle_evt_conversation_item_added(self, evt: Any) -> None:
        self.record.append(("item", evt.item.type, evt.item.call_id))
        await super()._handle_evt_conversation_item_added(evt)

    async def handle_evt_input_audio_transcription_completed(self, evt: Any) -> None:
        # (Pipecat pushes the transcript upstream, to its user aggregator, not to the sink.)
        self.record.append(("heard", evt.transcript))
        await super().handle_evt_input_audio_transcription_completed(evt)

    async def _handle_evt_response_done(self, evt: Any) -> None:
        details = evt.response.status_details or {}
        reason = details.get("reason") if isinstance(details, dict) else details.reason
        self.record.append(("response.done", evt.response.id, evt.response.status, reason))
        await super()._handle_evt_response_done(evt)


def speech(head: HeadProc, text: str) -> bytes:
    body = {"model": "voice", "input": text, "voice": "alloy", "response_format": "pcm"}
    r = head.client.post("/v1/audio/speech", json=body, timeout=WAIT_S)
    r.raise_for_status()
    return r.content + b"\0\0" * (RATE // 5)  # and 200 ms of its own silence


def index(record: Record, kind: str, after: int = 0, where: Callable[..., bool] | None = None):
    """The index of the first entry of ``kind`` at or after ``after`` (None if none)."""
    for i in range(after, len(record)):
        if record[i][0] == kind and (where is None or where(*record[i][1:])):
            return i
    return None


async def until(record: Record, what: str, found: Callable[[], Any]) -> Any:
    """Wait for ``found()`` to be true (a condition, not a fixed time), generously."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WAIT_S
    while (value := found()) is None or value is False:
        if loop.time() > deadline:
            raise AssertionError(f"no {what} in {WAIT_S} s; the record's tail: {record[-40:]}")
        await asyncio.sleep(0.05)
    return value


def session_properties(**extra: Any) -> rt.SessionProperties:
    vad = rt.TurnDetection(type="server_vad", silence_duration_ms=500)
    transcription = rt.InputAudioTranscription(model="whisper-1")
    audio = rt.AudioConfiguration(
        input=rt.AudioInput(transcription=transcription, turn_detection=vad)
    )
    return rt.SessionProperties(audio=audio, **extra)


# In the OpenAI shape, as session properties carry it. Closed and bounded: the 135M
# thinker, sampled, sometimes fills a free-form call with words up to its token limit;
# "required" constrains its output to this schema.
WEATHER_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "The current weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 24}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


class Conversation:
    """The pipeline, as a Pipecat app builds it, and a script of the turns that waits
    on what the record shows, never for a fixed time."""

    def __init__(self, head: HeadProc) -> None:
        self.record: Record = []
        self.calls: list[Any] = []
        # Tools off at first (the greeting), then "required" for the weather question:
        # the 135M thinker calls a tool only when it must, and then would call it on
        # every response, so the tool's handler turns it back to "none" before its result
        # goes back (the settings frame is queued to the service ahead of the context
        # frame that asks for the answer), and the answer after the result is spoken.
        self.first = session_properties(
            tools=[WEATHER_TOOL], tool_choice="none", max_output_tokens=60
        )
        self.llm = Service(
            self.record,
            api_key="x",
            base_url=f"ws://127.0.0.1:{head.port}/v1/realtime",
            settings=Service.Settings(model="voice", session_properties=self.first),
        )
        self.llm.register_function("get_weather", self.get_weather)
        hello = [{"role": "user", "content": "Hello!"}]
        pair = LLMContextAggregatorPair(LLMContext(messages=hello), realtime_service_mode=True)
        self.mic, sink = Mic(self.record), Sink(self.record)
        self.worker = PipelineWorker(
            Pipeline([self.mic, pair.user(), self.llm, sink, pair.assistant()]),
            params=PipelineParams(audio_in_sample_rate=RATE, audio_out_sample_rate=RATE),
            idle_timeout_secs=None,
        )

    def update(self, **changes: Any) -> LLMUpdateSettingsFrame:
        props = self.first.model_copy(update=changes)
        return LLMUpdateSettingsFrame(delta=Service.Settings(session_properties=props))

    async def settle(self, **changes: Any) -> None:
        """Session settings changed, and the server says they are in effect."""
        mark = len(self.record)
        await self.llm.queue_frame(self.update(**changes))
        await self.until("session.updated", lambda: index(self.record, "session.updated", mark))

    async def get_weather(self, params: Any) -> None:
        self.calls.append(params)
        call = ("call", params.function_name, params.arguments, params.tool_call_id)
        self.record.append(call)
        await self.llm.queue_frame(self.update(tool_choice="none"))
        await params.result_callback({"temperature_c": 21, "sky": "sunny"})

    async def until(self, what: str, found: Callable[[], Any]) -> Any:
        return await until(self.record, what, found)

    async def response_after(self, what: str, after: int) -> int:
        """The index of the first response created after ``after``."""
        return await self.until(what, lambda: index(self.record, "response.created", after))

    async def done(self, created: int) -> int:
        rid = self.record[created][1]
        same = lambda r, *_: r == rid  # noqa: E731
        return await self.until(rid, lambda: index(self.record, "response.done", created, same))

    async def run(self, said: dict[str, bytes]) -> None:
        runner = WorkerRunner(handle_sigint=False)
        await runner.add_workers(self.worker)
        running = asyncio.ensure_future(runner.run())
        try:
            await self.script(said)
        finally:
            await self.worker.cancel()
            await asyncio.wait_for(running, WAIT_S)

    async def script(self, said: dict[str, bytes]) -> None:
        record = self.record
        await self.until("session.updated", lambda: index(record, "session.updated"))
        # The app starts the conversation (a greeting), as Pipecat's examples do.
        mark = len(record)
        await self.worker.queue_frame(LLMRunFrame())
        await self.done(await self.response_after("greeting", mark))
        # Turn 1: a story, and a request spoken over it once its audio comes. First, so
        # the 135M thinker tells it from a plain context (after a tool's result it tends
        # to echo JSON, short enough to be done before the request is heard).
        await self.settle(instructions=STORYTELLER, max_output_tokens=300)
        mark = len(record)
        self.mic.say("story", said["story"])
        story = await self.response_after(
            "story", await self.until("said", lambda: index(record, "said", mark))
        )
        await self.until("story audio", lambda: index(record, "audio", story))
        self.mic.say("stop", said["stop"])
        await self.done(story)
        barge = await self.until("stop said", lambda: index(record, "said", story))
        await self.until("interruption", lambda: index(record, "interruption", barge))
        await self.done(await self.response_after("answer to the request", barge))
        # Turn 2: a spoken question, answered through the tool.
        await self.settle(instructions=ASSISTANT, tool_choice="required")
        self.mic.say("weather", said["weather"])
        output = await self.until(
            "function_call_output item",
            lambda: index(record, "item", where=lambda kind, _: kind == "function_call_output"),
        )
        await self.done(await self.response_after("answer after the tool", output))


@pytest.fixture(scope="module")
def conversation(voice_head: HeadProc) -> tuple[Record, list[Any]]:
    said = {"weather": WEATHER, "story": STORY, "stop": STOP}
    audio = {name: speech(voice_head, text) for name, text in said.items()}
    conversation = Conversation(voice_head)
    asyncio.run(conversation.run(audio))
    record = conversation.record
    print("the record:", [e for e in record if e[0] != "audio"])
    return record, conversation.calls


# An answer that ran to its end: the 135M thinker, sampled, may ramble to the token limit.
ANSWERED = [("completed", None), ("incomplete", "max_output_tokens")]


def answer_to_the_tool(record: Record) -> tuple[int, int]:
    """Where the answer after the tool's result was created and where it was done."""
    output = index(record, "item", where=lambda kind, _: kind == "function_call_output")
    created = index(record, "response.created", output)
    rid = record[created][1]
    return created, index(record, "response.done", created, lambda r, *_: r == rid)


def test_a_spoken_question_is_heard_and_answered_in_audio(conversation):
    record, _ = conversation
    assert not [e for e in record if e[0] == "error"], record
    said = index(record, "said", where=lambda name: name == "weather")
    heard = index(record, "heard", said)
    assert heard is not None and heard_as(record[heard][1], WEATHER), record
    created, done = answer_to_the_tool(record)
    assert record[done][2:] in ANSWERED, record[done]
    # What reached the sink for it (up to the next thing said: frames trail events).
    until_next = index(record, "said", created)
    out = record[created:until_next]
    assert sum(e[1] for e in out if e[0] == "audio") > RATE, out  # over 0.5 s of pcm16
    assert "".join(e[1] for e in out if e[0] == "said_by_bot").strip(), out


def test_a_tool_call_goes_round_trip_and_is_answered(conversation):
    record, calls = conversation
    said = index(record, "said", where=lambda name: name == "weather")
    call = index(record, "call", said)
    assert call is not None, record
    _, name, arguments, call_id = record[call]
    assert name == "get_weather" and isinstance(arguments, dict), record[call]
    assert calls[0].tool_call_id == call_id
    # Its result went back: the server added it to the conversation, for that call.
    is_output = lambda kind, cid: (kind, cid) == ("function_call_output", call_id)  # noqa: E731
    output = index(record, "item", call, is_output)
    assert output is not None, record
    # Then Pipecat asked for an answer, which came.
    created, done = answer_to_the_tool(record)
    assert output < created < done and record[done][2:] in ANSWERED, record[done]


def test_speech_over_an_answer_interrupts_it_and_the_server_cancels_it(conversation):
    record, _ = conversation
    assert not [e for e in record if e[0] == "error"], record
    story_said = index(record, "said", where=lambda name: name == "story")
    story_at = index(record, "response.created", story_said)
    story = record[story_at][1]
    barge = index(record, "said", story_at, lambda name: name == "stop")
    assert barge is not None and index(record, "audio", story_at) < barge  # said over it
    done = index(record, "response.done", story_at, lambda rid, *_: rid == story)
    assert record[done][2:] == ("cancelled", "turn_detected"), record[done]
    assert index(record, "interruption", barge) is not None, record
