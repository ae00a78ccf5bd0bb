"""What real OpenAI clients send, against the default pipeline with its real models.

The official openai SDK, LangChain's ChatOpenAI and LiteLLM, as their users call them:
structured output (JSON mode, strict schemas), function calling (required, named, auto,
the call's result fed back), logprobs, benchmark fields, and refusals of what the
pipeline cannot honour. Audio formats are checked in test_audio_formats.py and the
Responses API in test_responses_models.py, over the same kind of server.
"""

from __future__ import annotations

import json
import math
from typing import Any

import openai
import pytest
from pydantic import BaseModel

from tests.integration.harness import HeadProc

pytestmark = pytest.mark.slow

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The current time in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


class City(BaseModel):
    name: str
    country: str
    is_capital: bool


def _chat(client: openai.OpenAI, content: str, **extra: Any) -> Any:
    return client.chat.completions.create(
        model="voice",
        messages=[{"role": "user", "content": content}],
        temperature=extra.pop("temperature", 0),
        max_tokens=extra.pop("max_tokens", 80),
        **extra,
    )


# -- structured output ------------------------------------------------------------------


def test_json_mode_answers_parse_as_an_object(voice_client: openai.OpenAI) -> None:
    out = _chat(
        voice_client,
        "Return a JSON object for Paris with the keys city and country.",
        response_format={"type": "json_object"},
    )
    choice = out.choices[0]
    assert choice.finish_reason == "stop", choice
    assert isinstance(json.loads(choice.message.content), dict)


def test_a_strict_schema_through_the_sdks_parse_helper(voice_client: openai.OpenAI) -> None:
    out = voice_client.chat.completions.parse(
        model="voice",
        messages=[{"role": "user", "content": "Which city is the capital of France?"}],
        response_format=City,
        temperature=0,
        max_tokens=80,
    )
    city = out.choices[0].message.parsed
    assert isinstance(city, City) and city.name


def test_json_schema_output_streams_and_still_parses(voice_client: openai.OpenAI) -> None:
    schema = {
        "type": "object",
        "properties": {"answer": {"type": "string"}, "sure": {"type": "boolean"}},
        "required": ["answer", "sure"],
        "additionalProperties": False,
    }
    stream = _chat(
        voice_client,
        "What is the capital of France?",
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "answer", "schema": schema, "strict": True},
        },
        stream=True,
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    value = json.loads(text)
    assert set(value) == {"answer", "sure"} and isinstance(value["sure"], bool)


def test_a_bad_schema_is_a_400_naming_response_format(voice_client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        _chat(
            voice_client,
            "hi",
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "intege"}},
            },
        )
    assert info.value.body["param"] == "response_format"  # type: ignore[index]


# -- function calling -------------------------------------------------------------------


def test_a_required_tool_call_parses_and_matches_its_schema(voice_client: openai.OpenAI) -> None:
    out = _chat(
        voice_client, "What's the weather in Paris?", tools=[WEATHER, TIME], tool_choice="required"
    )
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    arguments = json.loads(call.function.arguments)
    if call.function.name == "get_weather":
        assert set(arguments) == {"city", "unit"} and arguments["unit"] in ("celsius", "fahrenheit")
    else:
        assert call.function.name == "get_time" and isinstance(arguments["city"], str)


def test_a_named_tool_call_streams_as_argument_deltas(voice_client: openai.OpenAI) -> None:
    stream = _chat(
        voice_client,
        "What's the weather in Paris?",
        tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        stream=True,
    )
    deltas, finish = [], None
    for chunk in stream:
        if chunk.choices:
            deltas += chunk.choices[0].delta.tool_calls or []
            finish = chunk.choices[0].finish_reason or finish
    assert len(deltas) > 1  # pieces as they are written, not one blob
    assert deltas[0].id and deltas[0].function.name == "get_weather"
    arguments = json.loads("".join(d.function.arguments or "" for d in deltas))
    assert set(arguments) == {"city", "unit"}
    assert finish == "tool_calls"


def test_a_tool_result_goes_back_through_the_chat_template(voice_client: openai.OpenAI) -> None:
    first = _chat(
        voice_client,
        "What's the weather in Paris?",
        tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    call = first.choices[0].message.tool_calls[0]
    out = voice_client.chat.completions.create(
        model="voice",
        messages=[
            {"role": "user", "content": "What's the weather in Paris?"},
            first.choices[0].message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 24 degrees celsius"},
        ],
        tools=[WEATHER],
        tool_choice="none",
        temperature=0,
        max_tokens=60,
    )
    answer = out.choices[0].message
    assert answer.content and not answer.tool_calls
    plain = _chat(voice_client, "What's the weather in Paris?", max_tokens=1)
    # The call and its result are in the prompt.
    assert out.usage.prompt_tokens > plain.usage.prompt_tokens + 20


def test_tool_choice_auto_answers_text_or_a_valid_call(voice_client: openai.OpenAI) -> None:
    out = _chat(voice_client, "Say hello to me.", tools=[WEATHER], tool_choice="auto")
    message = out.choices[0].message
    # The small model decides; whichever it is, it is well formed.
    if message.tool_calls:
        assert out.choices[0].finish_reason == "tool_calls"
        json.loads(message.tool_calls[0].function.arguments)
    else:
        assert message.content and "<tool_call>" not in message.content


# -- logprobs and benchmark fields ------------------------------------------------------


def test_chat_logprobs_match_the_text(voice_client: openai.OpenAI) -> None:
    out = _chat(voice_client, "What is the capital of France?", logprobs=True, top_logprobs=3)
    choice = out.choices[0]
    content = choice.logprobs.content
    assert "".join(t.token for t in content) == choice.message.content
    for t in content:
        assert t.logprob <= 0 and len(t.top_logprobs) == 3
        assert bytes(t.bytes).decode("utf-8", errors="replace") == t.token
        # Greedy: the chosen token is the most likely one.
        assert math.isclose(t.logprob, t.top_logprobs[0].logprob, abs_tol=1e-4)
    assert len(content) == out.usage.completion_tokens


def test_logprobs_stop_where_a_stop_string_cuts_the_text(voice_client: openai.OpenAI) -> None:
    full = _chat(voice_client, "Name three colours.", logprobs=True, max_tokens=30)
    text = full.choices[0].message.content
    words = text.split()
    assert len(words) > 3, text
    cut = _chat(voice_client, "Name three colours.", logprobs=True, max_tokens=30, stop=[words[2]])
    choice = cut.choices[0]
    assert choice.message.content == text[: text.index(words[2])]
    joined = "".join(t.token for t in choice.logprobs.content)
    assert choice.message.content.startswith(joined) and len(joined) > 0


def test_streamed_chat_logprobs_join_to_the_streamed_text(voice_client: openai.OpenAI) -> None:
    stream = _chat(voice_client, "Name three colours.", logprobs=True, stream=True, max_tokens=30)
    text, tokens = "", []
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            if chunk.choices[0].logprobs:
                tokens += chunk.choices[0].logprobs.content
    assert text and "".join(t.token for t in tokens) == text


def test_completions_logprobs_in_the_legacy_shape(voice_client: openai.OpenAI) -> None:
    out = voice_client.completions.create(
        model="voice", prompt="The capital of France is", max_tokens=8, temperature=0, logprobs=2
    )
    choice = out.choices[0]
    lp = choice.logprobs
    assert "".join(lp.tokens) == choice.text
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
    assert all(len(top) <= 2 for top in lp.top_logprobs)
    assert lp.text_offset[0] == 0


def test_min_tokens_and_ignore_eos_as_benchmark_clients_send_them(
    voice_client: openai.OpenAI,
) -> None:
    short = _chat(voice_client, "Reply with one word: yes or no?", max_tokens=40)
    assert short.usage.completion_tokens < 20, short.choices[0].message.content
    longer = _chat(
        voice_client,
        "Reply with one word: yes or no?",
        max_tokens=40,
        extra_body={"min_tokens": 20},
    )
    assert longer.usage.completion_tokens >= 20
    fixed = _chat(
        voice_client,
        "Reply with one word: yes or no?",
        max_tokens=30,
        extra_body={"ignore_eos": True},
    )
    assert fixed.usage.completion_tokens == 30 and fixed.choices[0].finish_reason == "length"


def test_a_repeated_system_turn_is_reported_as_cached_prompt_tokens(
    voice_client: openai.OpenAI,
) -> None:
    system = {"role": "system", "content": "You answer in one short sentence, politely."}
    asks = ("What is the capital of Italy?", "What is the capital of Spain?")
    outs = [
        voice_client.chat.completions.create(
            model="voice",
            messages=[system, {"role": "user", "content": ask}],
            temperature=0,
            max_tokens=12,
        )
        for ask in asks
    ]
    first, second = (o.usage.prompt_tokens_details.cached_tokens for o in outs)
    # The second request found the system turn (~15 tokens) in the thinker's prefix
    # cache; never more than its whole prompt.
    assert second >= 10 and second > first
    assert second < outs[1].usage.prompt_tokens
    # Streamed usage carries the same field.
    stream = voice_client.chat.completions.create(
        model="voice",
        messages=[system, {"role": "user", "content": asks[0]}],
        temperature=0,
        max_tokens=12,
        stream=True,
        stream_options={"include_usage": True},
    )
    usage = [c.usage for c in stream if c.usage is not None]
    assert usage and usage[-1].prompt_tokens_details.cached_tokens >= 10


# -- what the pipeline cannot honour is a 400 naming the field --------------------------


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "What is this?"},
                            {"type": "image_url", "image_url": {"url": "https://x/y.png"}},
                        ],
                    }
                ]
            },
            "messages.0.content.1",
        ),
        ({"n": 2}, "n"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
        ({"tool_choice": "required"}, "tool_choice"),
    ],
)
def test_unsupported_requests_are_400s_naming_the_field(
    voice_client: openai.OpenAI, extra: dict[str, Any], param: str
) -> None:
    body: dict[str, Any] = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
    body.update(extra)
    with pytest.raises(openai.BadRequestError) as info:
        voice_client.chat.completions.create(model="voice", **body)
    assert info.value.body["param"] == param, info.value.body  # type: ignore[index]


# -- LangChain --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def chat_model(voice_head: HeadProc) -> Any:
    langchain_openai = pytest.importorskip("langchain_openai")
    return langchain_openai.ChatOpenAI(
        model="voice",
        base_url=f"{voice_head.url}/v1",
        api_key="x",
        temperature=0,
        max_tokens=60,
        max_retries=0,
    )


def test_langchain_invoke_and_stream(chat_model: Any) -> None:
    answer = chat_model.invoke("What is the capital of France?")
    assert "Paris" in answer.content
    pieces = [c.content for c in chat_model.stream("What is the capital of France?")]
    assert len(pieces) > 2 and "".join(pieces) == answer.content


def test_langchain_structured_output(chat_model: Any) -> None:
    city = chat_model.with_structured_output(City, method="json_schema", strict=True).invoke(
        "Which city is the capital of France?"
    )
    assert isinstance(city, City) and city.name


def test_langchain_bind_tools(chat_model: Any) -> None:
    bound = chat_model.bind_tools([WEATHER], tool_choice="get_weather")
    message = bound.invoke("What's the weather in Paris?")
    (call,) = message.tool_calls
    assert call["name"] == "get_weather" and set(call["args"]) == {"city", "unit"}


# -- LiteLLM ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def litellm(voice_head: HeadProc) -> Any:
    return pytest.importorskip("litellm")


def _litellm_args(head: HeadProc) -> dict[str, Any]:
    return {"model": "openai/voice", "api_base": f"{head.url}/v1", "api_key": "x"}


def test_litellm_completion_and_stream(litellm: Any, voice_head: HeadProc) -> None:
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    out = litellm.completion(
        messages=messages, temperature=0, max_tokens=30, **_litellm_args(voice_head)
    )
    assert "Paris" in out.choices[0].message.content
    stream = litellm.completion(
        messages=messages, temperature=0, max_tokens=30, stream=True, **_litellm_args(voice_head)
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == out.choices[0].message.content


def test_litellm_sees_a_context_window_error(litellm: Any, voice_head: HeadProc) -> None:
    # LiteLLM's fallbacks to a bigger model key on this exception class.
    with pytest.raises(litellm.ContextWindowExceededError):
        litellm.completion(
            messages=[{"role": "user", "content": "word " * 3000}],
            max_tokens=5,
            **_litellm_args(voice_head),
        )
