"""POST /v1/responses (OpenAI's Responses API): over a real echo head with the openai
SDK, and in-process over a scripted stand-in head for what the echo engine cannot say
(function calls, a cut-off answer, a failure mid-stream) or cannot show (the chat
history and stage params the text stage is sent)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any, get_args

import httpx
import msgspec
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from starlette.testclient import TestClient

from omnistage.api.app import create_app
from omnistage.config.load import load_config
from omnistage.dataplane.graph import StageGraph
from omnistage.protocol.chunk_meta import ToolCallMeta
from omnistage.protocol.errors import BadRequestError, StageFailedError
from omnistage.protocol.front import PipelineRequest
from omnistage.protocol.messages import ChatMessage, OutputChunk, ToolCall, Usage
from omnistage.protocol.params import GenerationParams
from tests.integration.harness import HeadProc

# Every stream event type the SDK knows, to validate each event strictly (the SDK
# itself builds them without validation, so a missing field would go unnoticed).
EVENT_TYPES = {
    get_args(cls.model_fields["type"].annotation)[0]: cls
    for cls in get_args(get_args(ResponseStreamEvent)[0])
}
TEXT_EVENTS = [
    "response.output_item.added",
    "response.content_part.added",
    "response.output_text.delta",
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
]


def _sdk(head: HeadProc) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{head.url}/v1", api_key="x", max_retries=0)


def _sse(response: httpx.Response) -> list[dict[str, Any]]:
    """Each event of an SSE body, checked against the SDK's type of it; its ``event:``
    line must name its type."""
    events, kind = [], None
    for line in response.iter_lines():
        if line.startswith("event: "):
            kind = line.removeprefix("event: ")
        elif line.startswith("data: "):
            event = json.loads(line.removeprefix("data: "))
            assert event["type"] == kind
            EVENT_TYPES[event["type"]].model_validate(event)
            events.append(event)
    return events


def _chat_text(head: HeadProc, messages: list[dict[str, Any]]) -> str:
    r = head.client.post("/v1/chat/completions", json={"messages": messages})
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["message"]["content"])


# -- over a real echo head -------------------------------------------------------------


def test_create_answers_what_chat_answers_in_the_response_shape(echo_head: HeadProc) -> None:
    out = _sdk(echo_head).responses.create(model="echo", input="hello world")
    assert out.output_text == _chat_text(echo_head, [{"role": "user", "content": "hello world"}])
    assert out.output_text == "hello world [thinker] [talker] [vocoder]"
    assert out.id.startswith("resp_") and out.object == "response" and out.model == "echo"
    assert out.status == "completed" and out.error is None and out.incomplete_details is None
    (message,) = out.output
    assert message.type == "message" and message.id.startswith("msg_")
    assert message.role == "assistant" and message.status == "completed"
    # Every field the SDK's type requires is there (the SDK does not check).
    raw = echo_head.client.post("/v1/responses", json={"input": "hello world"}).json()
    Response.model_validate(raw)


def test_usage_counts_input_and_output_tokens_as_chat_does(echo_head: HeadProc) -> None:
    out = _sdk(echo_head).responses.create(model="echo", input="count these words")
    chat = echo_head.chat("count these words").json()["usage"]
    usage = out.usage
    assert usage is not None
    assert (usage.input_tokens, usage.output_tokens) == (
        chat["prompt_tokens"],
        chat["completion_tokens"],
    )
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.input_tokens_details.cached_tokens == 0
    assert usage.output_tokens_details.reasoning_tokens == 0


def test_streamed_events_come_in_order_and_deltas_join_to_the_final_text(
    echo_head: HeadProc,
) -> None:
    events = list(_sdk(echo_head).responses.create(model="echo", input="sdk stream", stream=True))
    kinds = [e.type for e in events]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert deltas
    collapsed = [k for i, k in enumerate(kinds) if not (i and k == kinds[i - 1] == deltas[0].type)]
    assert collapsed == [
        "response.created",
        "response.in_progress",
        *TEXT_EVENTS,
        "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response  # type: ignore[union-attr]
    text = "".join(d.delta for d in deltas)
    assert text == final.output_text == "sdk stream [thinker] [talker] [vocoder]"
    assert final.usage is not None and final.usage.input_tokens == 2


def test_raw_stream_is_sse_with_event_lines_and_no_done_marker(echo_head: HeadProc) -> None:
    body = {"input": "raw stream", "stream": True}
    with echo_head.client.stream("POST", "/v1/responses", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = _sse(r)
    assert events[-1]["type"] == "response.completed"
    assert events[0]["response"]["status"] == "in_progress"
    Response.model_validate(events[-1]["response"])


def test_the_stream_helper_yields_typed_events_and_the_final_response(
    echo_head: HeadProc,
) -> None:
    with _sdk(echo_head).responses.stream(model="echo", input="helper") as stream:
        snapshots = [e.snapshot for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert final.output_text == snapshots[-1] == "helper [thinker] [talker] [vocoder]"


def test_instructions_and_metadata_are_echoed_and_the_input_still_answered(
    echo_head: HeadProc,
) -> None:
    out = _sdk(echo_head).responses.create(
        model="echo", input="question", instructions="Be brief.", metadata={"k": "v"}
    )
    # The echo stages answer the last user message: the instructions went in before it.
    assert out.output_text == "question [thinker] [talker] [vocoder]"
    assert out.instructions == "Be brief." and out.metadata == {"k": "v"}


def test_input_as_a_message_list_answers_as_chat_with_those_messages(
    echo_head: HeadProc,
) -> None:
    parts = [{"type": "input_text", "text": "two "}, {"type": "input_text", "text": "parts"}]
    out = _sdk(echo_head).responses.create(
        model="echo",
        input=[
            {"role": "system", "content": "sys"},
            {"role": "user", "content": "first"},
            {"role": "assistant", "content": "reply"},
            {"type": "message", "role": "user", "content": parts},
        ],
    )
    chat = [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "reply"},
        {"role": "user", "content": "two parts"},
    ]
    assert (
        out.output_text == _chat_text(echo_head, chat) == "two parts [thinker] [talker] [vocoder]"
    )


@pytest.mark.parametrize("part", ["input_image", "input_file"])
def test_a_media_input_part_is_a_400_naming_it(echo_head: HeadProc, part: str) -> None:
    content = [{"type": "input_text", "text": "look"}, {"type": part}]
    body = {"input": [{"role": "user", "content": content}]}
    r = echo_head.client.post("/v1/responses", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "input.0.content.1.type"
    assert part in error["message"]


def test_audio_in_where_no_stage_hears_is_a_400_naming_the_message(echo_head: HeadProc) -> None:
    spoken = {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}
    body = {"input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}, spoken]}]}
    r = echo_head.client.post("/v1/responses", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "input.0.content"
    assert "audio input" in error["message"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
        ({"input": "x", "modalities": ["text", "audio"]}, "modalities"),
        ({}, "input"),
        ({"input": []}, "input"),
        ({"input": "   "}, "input"),
        ({"input": 3}, "input"),
        ({"input": [{"type": "reasoning"}]}, "input.0.type"),
        ({"input": [{"type": "function_call", "call_id": "c"}]}, "input.0"),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "x", "temperature": 3}, "temperature"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools.0.type"),
        ({"input": "x", "tool_choice": "required"}, "tool_choice"),
        ({"input": "x", "tool_choice": "sometimes"}, "tool_choice.type"),
        ({"input": "x", "text": {"format": {"type": "json_schema"}}}, "text.format"),
        ({"input": "x", "stage_params": {"nope": {}}}, "stage_params"),
    ],
)
def test_bad_requests_are_400s_naming_the_field(
    echo_head: HeadProc, body: dict[str, Any], param: str
) -> None:
    r = echo_head.client.post("/v1/responses", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param, error


def test_an_unknown_previous_response_id_is_a_400_naming_it(echo_head: HeadProc) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        _sdk(echo_head).responses.create(model="echo", input="x", previous_response_id="resp_1")
    assert info.value.body["param"] == "previous_response_id"  # type: ignore[index]


def test_an_unknown_model_is_a_404(echo_head: HeadProc) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        _sdk(echo_head).responses.create(model="gpt-4o", input="x")
    assert info.value.body["code"] == "model_not_found"  # type: ignore[index]
    body = {"model": "gpt-4o", "input": "x", "stream": True}
    assert echo_head.client.post("/v1/responses", json=body).status_code == 404


# -- in-process, over a scripted head --------------------------------------------------


@dataclass
class _Stream:
    request_id: str
    chunks: list[OutputChunk]
    error: Exception | None
    closed: bool = False

    def __aiter__(self) -> AsyncIterator[OutputChunk]:
        return self._outputs()

    async def _outputs(self) -> AsyncIterator[OutputChunk]:
        for chunk in self.chunks:
            yield chunk
        if self.error is not None:
            raise self.error

    def close(self) -> None:
        self.closed = True

    def usage(self) -> Usage:
        return Usage(prompt_tokens=5, completion_tokens=7)


@dataclass
class _ScriptedHead:
    """What the API needs of a head (``api.service.PipelineService``) for a one-stage
    text pipeline whose stage answers every request with ``chunks`` (then raises
    ``error``, if set). It keeps what each request asked for."""

    chunks: list[OutputChunk] = field(default_factory=list)
    error: Exception | None = None
    opened: list[PipelineRequest] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.config = load_config("echo-1stage")
        self.graph = StageGraph(self.config)
        self.served_model = self.config.pipeline
        self.model_names = frozenset({self.served_model})

    async def open(self, request: PipelineRequest) -> _Stream:
        self.opened.append(request)
        return _Stream(request.request_id, self.chunks, self.error)


def _chunk(modality: str, text: str = "", **kw: Any) -> OutputChunk:
    return OutputChunk("r", 0, 0, 0, 0, modality, text, **kw)


def _call(index: int, name: str, text: str, **kw: Any) -> OutputChunk:
    return _chunk("tool_call", text, meta=ToolCallMeta(index=index, name=name), **kw)


TEXT_THEN_TWO_CALLS = [
    _chunk("text", "Let me look."),
    _call(0, "weather", '{"city": '),
    _call(0, "weather", '"Paris"}'),
    _call(1, "time", '{"tz": "CET"}', finished=True, finish_reason="tool_calls"),
]
WEATHER_TOOL = {
    "type": "function",
    "name": "weather",
    "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}


@pytest.fixture
def scripted() -> Iterator[tuple[_ScriptedHead, TestClient]]:
    head = _ScriptedHead()
    with TestClient(create_app(head)) as client:  # type: ignore[arg-type]
        yield head, client


def _scripted_sdk(client: TestClient) -> openai.OpenAI:
    return openai.OpenAI(
        base_url="http://testserver/v1", api_key="x", max_retries=0, http_client=client
    )


def test_function_calls_become_function_call_items_after_the_message(
    scripted: tuple[_ScriptedHead, TestClient],
) -> None:
    head, client = scripted
    head.chunks = TEXT_THEN_TWO_CALLS
    raw = client.post("/v1/responses", json={"input": "weather?", "tools": [WEATHER_TOOL]})
    assert raw.status_code == 200, raw.text
    out = Response.model_validate(raw.json())
    assert out.status == "completed" and out.output_text == "Let me look."
    message, weather, clock = out.output
    assert message.type == "message"
    assert weather.type == "function_call" and clock.type == "function_call"
    assert (weather.name, json.loads(weather.arguments)) == ("weather", {"city": "Paris"})
    assert (clock.name, json.loads(clock.arguments)) == ("time", {"tz": "CET"})
    assert weather.id and weather.id.startswith("fc_") and weather.call_id.startswith("call_")
    assert weather.call_id != clock.call_id and weather.status == "completed"
    assert out.tools[0].type == "function" and out.tools[0].name == "weather"


def test_streamed_function_calls_follow_openais_event_order(
    scripted: tuple[_ScriptedHead, TestClient],
) -> None:
    head, client = scripted
    head.chunks = TEXT_THEN_TWO_CALLS
    body = {"input": "weather?", "tools": [WEATHER_TOOL], "stream": True}
    with client.stream("POST", "/v1/responses", json=body) as r:
        events = _sse(r)
    call = [
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
    ]
    two_deltas = [*call[:2], call[1], *call[2:]]
    assert [e["type"] for e in events] == [
        "response.created",
        "response.in_progress",
        *TEXT_EVENTS,
        *two_deltas,
        *call,
        "response.completed",
    ]
    assert [e.get("output_index") for e in events[2:-1]] == [0] * 6 + [1] * 5 + [2] * 4
    done = [e for e in events if e["type"] == "response.function_call_arguments.done"]
    assert [d["arguments"] for d in done] == ['{"city": "Paris"}', '{"tz": "CET"}']
    # The SDK's stream helper accepts the sequence and parses the arguments.
    with _scripted_sdk(client).responses.stream(
        model="echo-1stage",
        input="weather?",
        tools=[WEATHER_TOOL],  # type: ignore[list-item]
    ) as stream:
        final = stream.get_final_response()
    assert [item.type for item in final.output] == ["message", "function_call", "function_call"]


def test_history_instructions_and_settings_reach_the_text_stage_in_the_chat_shape(
    scripted: tuple[_ScriptedHead, TestClient],
) -> None:
    head, client = scripted
    head.chunks = [_chunk("text", "{}", finished=True, finish_reason="stop")]
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    _scripted_sdk(client).responses.create(
        model="echo-1stage",
        instructions="Use tools.",
        input=[
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": "Checking."},
            {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": "{}"},
            {"type": "function_call", "call_id": "c2", "name": "time", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
            {"type": "function_call_output", "call_id": "c2", "output": "noon"},
        ],
        tools=[WEATHER_TOOL],  # type: ignore[list-item]
        tool_choice={"type": "function", "name": "weather"},
        text={"format": {"type": "json_schema", "name": "a", "schema": schema, "strict": True}},
        max_output_tokens=20,
        temperature=0.5,
        top_p=0.9,
        store=True,
    )
    (opened,) = head.opened
    assert opened.finals == [0]
    assert opened.prompt.messages == [
        ChatMessage("system", "Use tools."),
        ChatMessage("user", "weather?"),
        ChatMessage(
            "assistant",
            "Checking.",
            tool_calls=[ToolCall("c1", "weather", "{}"), ToolCall("c2", "time", "{}")],
        ),
        ChatMessage("tool", "sunny", tool_call_id="c1"),
        ChatMessage("tool", "noon", tool_call_id="c2"),
    ]
    assert opened.params.generation == GenerationParams(max_tokens=20, temperature=0.5, top_p=0.9)
    (answering,) = opened.stage_params.values()
    assert msgspec.structs.asdict(answering.generation) == {
        **msgspec.structs.asdict(GenerationParams()),
        **{
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "a", "schema": schema, "strict": True},
            },
            "tools": [
                {
                    "type": "function",
                    "function": {
                        "name": "weather",
                        "description": "Weather in a city",
                        "parameters": WEATHER_TOOL["parameters"],
                    },
                }
            ],
            "tool_choice": {"type": "function", "function": {"name": "weather"}},
        },
    }
    assert list(opened.stage_params) == [0]


def test_a_responses_output_sent_back_as_input_continues_the_conversation(
    scripted: tuple[_ScriptedHead, TestClient],
) -> None:
    head, client = scripted
    head.chunks = TEXT_THEN_TWO_CALLS
    sdk = _scripted_sdk(client)
    tools = [WEATHER_TOOL]
    first = sdk.responses.create(model="echo-1stage", input="weather?", tools=tools)  # type: ignore[arg-type]
    _, weather, clock = first.output
    answers = [
        {"type": "function_call_output", "call_id": call.call_id, "output": "ok"}  # type: ignore[union-attr]
        for call in (weather, clock)
    ]
    history = [{"role": "user", "content": "weather?"}, *first.output, *answers]
    sdk.responses.create(model="echo-1stage", input=history, tools=tools)  # type: ignore[arg-type]
    messages = head.opened[-1].prompt.messages
    assert messages is not None
    assert [(m.role, m.content) for m in messages] == [
        ("user", "weather?"),
        ("assistant", "Let me look."),
        ("tool", "ok"),
        ("tool", "ok"),
    ]
    calls = messages[1].tool_calls or []
    assert [(c.name, c.arguments) for c in calls] == [
        ("weather", '{"city": "Paris"}'),
        ("time", '{"tz": "CET"}'),
    ]
    assert [m.tool_call_id for m in messages[2:]] == [c.id for c in calls]


def test_json_object_and_mode_tool_choices_map_to_their_chat_names(
    scripted: tuple[_ScriptedHead, TestClient],
) -> None:
    head, client = scripted
    body = {
        "input": "x",
        "text": {"format": {"type": "json_object"}},
        "tools": [WEATHER_TOOL],
        "tool_choice": "required",
        "stage_params": {"echo": {"seed": 1}},
    }
    assert client.post("/v1/responses", json=body).status_code == 200
    params = head.opened[-1].stage_params[0].generation
    assert params.response_format == {"type": "json_object"}
    assert params.tool_choice == "required" and params.seed == 1


def test_an_answer_cut_off_by_max_output_tokens_is_incomplete(
    scripted: tuple[_ScriptedHead, TestClient],
) -> None:
    head, client = scripted
    head.chunks = [_chunk("text", "Paris is", finished=True, finish_reason="length")]
    out = _scripted_sdk(client).responses.create(input="x", max_output_tokens=2)
    assert out.status == "incomplete" and out.output_text == "Paris is"
    assert out.incomplete_details is not None
    assert out.incomplete_details.reason == "max_output_tokens"
    assert out.output[0].status == "incomplete"  # type: ignore[union-attr]
    body = {"input": "x", "max_output_tokens": 2, "stream": True}
    with client.stream("POST", "/v1/responses", json=body) as r:
        events = _sse(r)
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}


def test_a_failure_after_the_stream_started_is_a_response_failed_event(
    scripted: tuple[_ScriptedHead, TestClient],
) -> None:
    head, client = scripted
    head.chunks = [_chunk("text", "Half an ans")]
    head.error = StageFailedError(0, "echo", "replica died")
    with client.stream("POST", "/v1/responses", json={"input": "x", "stream": True}) as r:
        assert r.status_code == 200
        events = _sse(r)
    failed = events[-1]
    assert failed["type"] == "response.failed"
    assert failed["response"]["status"] == "failed"
    assert failed["response"]["error"]["code"] == "server_error"
    assert "replica died" in failed["response"]["error"]["message"]
    (message,) = failed["response"]["output"]
    assert message["status"] == "incomplete"
    assert message["content"][0]["text"] == "Half an ans"
    Response.model_validate(failed["response"])


def test_a_bad_param_the_stage_finds_first_is_a_400_in_the_responses_terms(
    scripted: tuple[_ScriptedHead, TestClient],
) -> None:
    head, client = scripted
    head.error = BadRequestError("response_format: bad schema", "response_format")
    for stream in (False, True):
        body = {"input": "x", "text": {"format": {"type": "json_object"}}, "stream": stream}
        r = client.post("/v1/responses", json=body)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "text.format"


def test_an_answer_with_no_output_is_one_empty_message(
    scripted: tuple[_ScriptedHead, TestClient],
) -> None:
    head, client = scripted
    head.chunks = [_chunk("text", "", finished=True, finish_reason="stop")]
    out = _scripted_sdk(client).responses.create(input="x")
    assert out.output_text == "" and [i.type for i in out.output] == ["message"]
