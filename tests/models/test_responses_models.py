"""POST /v1/responses on the default voice pipeline (SmolLM2 thinker) over real HTTP,
with the openai SDK."""

from __future__ import annotations

import json

import openai
import pytest

from tests.integration.harness import HeadProc

pytestmark = pytest.mark.slow

QUESTION = "What is the capital of France?"


def _client(head: HeadProc) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{head.url}/v1", api_key="x", max_retries=0, timeout=120)


def _talker_dispatches(head: HeadProc) -> int:
    return sum(r["dispatched_total"] for r in head.replicas(1))


def test_a_short_answer_names_paris_and_never_touches_the_talker(voice_head: HeadProc) -> None:
    before = _talker_dispatches(voice_head)
    out = _client(voice_head).responses.create(
        model="voice", input=QUESTION, temperature=0, max_output_tokens=40
    )
    assert "Paris" in out.output_text
    assert out.status in ("completed", "incomplete")
    assert (out.status == "incomplete") == (out.incomplete_details is not None)
    assert out.usage is not None and out.usage.output_tokens > 0
    assert out.usage.input_tokens > 5
    assert _talker_dispatches(voice_head) == before


def test_a_streamed_answer_arrives_in_deltas_that_join_to_the_final_text(
    voice_head: HeadProc,
) -> None:
    stream = _client(voice_head).responses.create(
        model="voice", input=QUESTION, temperature=0, max_output_tokens=40, stream=True
    )
    events = list(stream)
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 1  # token by token, not one piece at the end
    final = events[-1]
    assert final.type in ("response.completed", "response.incomplete")
    assert "".join(deltas) == final.response.output_text  # type: ignore[union-attr]
    assert "Paris" in final.response.output_text  # type: ignore[union-attr]


def test_string_and_message_list_input_agree_and_instructions_are_followed(
    voice_head: HeadProc,
) -> None:
    client = _client(voice_head)
    ask = {"model": "voice", "temperature": 0, "max_output_tokens": 24}
    plain = client.responses.create(input=QUESTION, **ask)  # type: ignore[arg-type]
    again = client.responses.create(input=[{"role": "user", "content": QUESTION}], **ask)  # type: ignore[arg-type]
    assert plain.output_text == again.output_text
    terse = client.responses.create(
        input=QUESTION,
        instructions="Answer with one word.",
        **ask,  # type: ignore[arg-type]
    )
    assert "Paris" in terse.output_text


def test_a_named_function_is_called_with_json_arguments(voice_head: HeadProc) -> None:
    tool = {
        "type": "function",
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
            "additionalProperties": False,
        },
    }
    out = _client(voice_head).responses.create(
        model="voice",
        input="What is the weather in Paris?",
        tools=[tool],  # type: ignore[list-item]
        tool_choice={"type": "function", "name": "get_weather"},
        temperature=0,
        max_output_tokens=40,
    )
    calls = [item for item in out.output if item.type == "function_call"]
    assert len(calls) == 1, out.output
    assert calls[0].name == "get_weather" and calls[0].call_id.startswith("call_")
    assert isinstance(json.loads(calls[0].arguments)["city"], str)
    # Streamed, the arguments arrive in pieces as they are written.
    with _client(voice_head).responses.stream(
        model="voice",
        input="What is the weather in Paris?",
        tools=[tool],  # type: ignore[list-item]
        tool_choice={"type": "function", "name": "get_weather"},
        temperature=0,
        max_output_tokens=40,
    ) as stream:
        pieces = [e.delta for e in stream if e.type == "response.function_call_arguments.delta"]
        final = stream.get_final_response()
    (call,) = [item for item in final.output if item.type == "function_call"]
    assert len(pieces) > 1 and "".join(pieces) == call.arguments == calls[0].arguments


def test_a_json_schema_format_gives_json_of_that_schema(voice_head: HeadProc) -> None:
    schema = {
        "type": "object",
        "properties": {"capital": {"type": "string"}},
        "required": ["capital"],
        "additionalProperties": False,
    }
    out = _client(voice_head).responses.create(
        model="voice",
        input=QUESTION,
        text={"format": {"type": "json_schema", "name": "capital", "schema": schema}},
        temperature=0,
        max_output_tokens=40,
    )
    assert isinstance(json.loads(out.output_text)["capital"], str)


def test_a_chained_turn_continues_the_stored_conversation_from_the_prefix_cache(
    voice_head: HeadProc,
) -> None:
    client = _client(voice_head)
    turns = []
    previous = None
    for text in (
        "My name is Ada and I live in Lyon, a city in France. Remember that.",
        "I also have a cat called Pixel.",
        "What is my name?",
    ):
        turn = client.responses.create(
            model="voice",
            input=text,
            previous_response_id=previous,
            temperature=0,
            max_output_tokens=24,
        )
        assert turn.previous_response_id == previous and turn.usage is not None
        turns.append(turn)
        previous = turn.id
    first, second, third = (t.usage for t in turns)
    assert first is not None and second is not None and third is not None
    # Each prompt replays the turns before it (inputs and answers) ...
    assert second.input_tokens > first.input_tokens + first.output_tokens
    # ... and what the previous prompt prefilled, the first turn and its answer included,
    # comes from the thinker's prefix cache (cached prefixes end at an end of turn).
    cached = third.input_tokens_details.cached_tokens
    assert cached >= first.input_tokens + first.output_tokens, (cached, first, second)
    # (Whether a 135M model then recalls the name is its own business; the echo tests
    # check the replayed conversation word for word.)


def test_truncation_auto_answers_a_conversation_longer_than_the_window(
    voice_head: HeadProc,
) -> None:
    # Some 80 exchanges: about 3,000 tokens, where the thinker's window is 2,048.
    history: list[dict[str, str]] = []
    for i in range(80):
        history.append({"role": "user", "content": f"Tell me a fact about the number {i}."})
        history.append({"role": "assistant", "content": f"The number {i} comes after {i - 1}."})
    history.append({"role": "user", "content": QUESTION})
    client = _client(voice_head)
    ask = {"model": "voice", "temperature": 0, "max_output_tokens": 24, "store": False}
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(input=history, **ask)  # type: ignore[arg-type]
    assert refused.value.code == "context_length_exceeded"
    out = client.responses.create(input=history, truncation="auto", **ask)  # type: ignore[arg-type]
    assert out.truncation == "auto" and out.status in ("completed", "incomplete")
    assert "Paris" in out.output_text  # the newest turn is kept and answered
    assert out.usage is not None and out.usage.input_tokens < 2048
