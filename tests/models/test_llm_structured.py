"""Structured output on the real SmolLM2-135M-Instruct weights, in-process: JSON mode and
JSON schemas, tool calls (named, required, resumed), logprobs, min_tokens, ignore_eos,
and up-front validation of all of it."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

from omnistage.audio.semantic_vad import WORDS_END, WORDS_END_EAGER
from omnistage.config.schema import StageConfig
from omnistage.engines.base import EngineChunk, EngineRequest, StageInput
from omnistage.engines.llm.engine import LlmEngine
from omnistage.protocol.chunk_meta import ToolCallMeta
from omnistage.protocol.errors import BadRequestError
from omnistage.protocol.messages import ChatMessage, Prompt
from omnistage.realtime.words_turn import end_probability
from tests import params as P

pytestmark = pytest.mark.slow

GREEDY = {"temperature": 0}

CITY_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "size": {"type": "string", "enum": ["small", "medium", "large"]},
    },
    "required": ["city", "size"],
    "additionalProperties": False,
}
CITY_FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "city", "strict": True, "schema": CITY_SCHEMA},
}

WEATHER_PARAMS = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME_PARAMS = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city",
            "parameters": WEATHER_PARAMS,
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "The current local time in a city",
            "parameters": TIME_PARAMS,
        },
    },
]
SCHEMAS = {"get_weather": WEATHER_PARAMS, "get_time": TIME_PARAMS}
WEATHER_QUESTION = "What is the weather in Paris?"
NAMED = {
    "tools": TOOLS,
    "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
    "max_tokens": 40,
    **GREEDY,
}
# The model's greedy answer to this is "Yes." (2 tokens, then end of sequence).
SHORT_QUESTION = "Reply with one word: yes or no?"


# -- helpers (as in test_llm_engine.py) -------------------------------------------------


async def _no_inputs() -> AsyncIterator[StageInput]:
    return
    yield  # pragma: no cover


OPEN = {"continue_final_message": True}


def _request(
    text: str, rid: str = "r", resume_text: str = "", resume_tokens: int = 0, **params: object
) -> EngineRequest:
    prompt = Prompt(messages=[ChatMessage("user", text)])
    return EngineRequest(rid, prompt, P.text(params), _no_inputs(), resume_text, resume_tokens)


BOOK = "Would you like me to book it?"


def _reply(words: str, said: str) -> EngineRequest:
    """``words`` left open after the assistant said ``said`` (as words_turn asks)."""
    request = _request(words, max_tokens=1, logprobs=True, top_logprobs=20, **OPEN, **GREEDY)
    if said:
        assert request.prompt.messages is not None
        request.prompt.messages.insert(0, ChatMessage("assistant", said))
    return request


async def _started(**engine_args: object) -> LlmEngine:
    engine = LlmEngine(
        StageConfig(stage_id=0, name="thinker", engine="llm", engine_args=engine_args)
    )
    await engine.start()
    return engine


async def _run(engine: LlmEngine, request: EngineRequest) -> list[EngineChunk]:
    return [c async for c in engine.generate(request)]


def _runs(engine: LlmEngine, *requests: EngineRequest) -> list[list[EngineChunk]]:
    """Run requests concurrently (batched: one decode step serves them all)."""

    async def main() -> list[list[EngineChunk]]:
        return list(await asyncio.gather(*(_run(engine, r) for r in requests)))

    return asyncio.run(main())


def _text(chunks: list[EngineChunk]) -> str:
    return "".join(c.text for c in chunks)


def _matches(value: Any, schema: dict[str, Any]) -> bool:
    """The little of JSON schema these tests use."""
    if "enum" in schema and value not in schema["enum"]:
        return False
    kind = schema.get("type")
    if kind == "string":
        return isinstance(value, str)
    if kind == "object":
        if not isinstance(value, dict):
            return False
        props = schema.get("properties", {})
        if any(key not in value for key in schema.get("required", ())):
            return False
        if schema.get("additionalProperties") is False and set(value) - set(props):
            return False
        return all(_matches(v, props[k]) for k, v in value.items() if k in props)
    return kind is None


@pytest.fixture(scope="module")
def engine() -> Iterator[LlmEngine]:
    # One engine for the module: loading the weights is much of the cost. Its worker is
    # a thread and each generate call binds to the running loop, so separate
    # asyncio.run calls can share it.
    eng = asyncio.run(_started())
    yield eng
    asyncio.run(eng.shutdown())


# -- generation: every independent request at once --------------------------------------


def _first_pass() -> dict[str, EngineRequest]:
    requests = {
        "json_object": _request(
            "Return a JSON object for Paris with the keys city and country.",
            response_format={"type": "json_object"},
            max_tokens=80,
            **GREEDY,
        ),
        "json_schema": _request(
            "Describe Paris as JSON.", response_format=CITY_FORMAT, max_tokens=60, **GREEDY
        ),
        "named": _request(WEATHER_QUESTION, **NAMED),
        "required": _request(
            WEATHER_QUESTION, tools=TOOLS, tool_choice="required", max_tokens=60, **GREEDY
        ),
        "logprobs": _request(
            "Name three colors.", max_tokens=16, logprobs=True, top_logprobs=3, **GREEDY
        ),
        "plain": _request(SHORT_QUESTION, max_tokens=40, **GREEDY),
        # A user's words left open (realtime.words_turn asks this): finished, cut, and
        # the finished words as a closed turn.
        **{
            name: _request(words, max_tokens=1, logprobs=True, top_logprobs=20, **extra, **GREEDY)
            for name, words, extra in (
                ("open_finished", "what is the capital of france", OPEN),
                ("open_cut", "what is the best way", OPEN),
                ("closed_finished", "what is the capital of france", {}),
            )
        },
        # A short reply, with and without the question it answers (words_turn shows the
        # assistant's last words), and a reply cut short after it.
        **{
            name: _reply(words, said)
            for name, words, said in (
                ("reply_finished", "yes please", BOOK),
                ("reply_alone", "yes please", ""),
                ("reply_cut", "yes but", BOOK),
            )
        },
        "min_tokens": _request(SHORT_QUESTION, max_tokens=40, min_tokens=20, **GREEDY),
        "ignore_eos": _request(SHORT_QUESTION, max_tokens=30, ignore_eos=True, **GREEDY),
    }
    for seed in range(3):
        requests[f"seed{seed}"] = _request(
            "Describe Paris as JSON.",
            response_format=CITY_FORMAT,
            max_tokens=60,
            temperature=1.0,
            seed=seed,
        )
    for name, request in requests.items():
        request.request_id = name
    return requests


@pytest.fixture(scope="module")
def outputs(engine: LlmEngine) -> dict[str, list[EngineChunk]]:
    # Continuous batching serves them all in one decode loop: a fraction of the steps
    # they would take one after another (greedy output is the same batched or alone).
    requests = _first_pass()
    return dict(zip(requests, _runs(engine, *requests.values()), strict=True))


# -- JSON -------------------------------------------------------------------------------


def test_json_object_output_is_a_json_object(outputs: dict[str, list[EngineChunk]]) -> None:
    chunks = outputs["json_object"]
    assert chunks[-1].finish_reason == "stop"
    value = json.loads(_text(chunks))
    assert isinstance(value, dict) and value


def test_strict_json_schema_output_matches_the_schema(
    outputs: dict[str, list[EngineChunk]],
) -> None:
    chunks = outputs["json_schema"]
    assert chunks[-1].finish_reason == "stop"
    value = json.loads(_text(chunks))
    assert _matches(value, CITY_SCHEMA), value
    assert all(c.modality == "text" for c in chunks)


@pytest.mark.parametrize("seed", range(3))
def test_sampled_json_schema_output_always_parses(
    outputs: dict[str, list[EngineChunk]], seed: int
) -> None:
    chunks = outputs[f"seed{seed}"]
    assert chunks[-1].finish_reason == "stop", _text(chunks)
    value = json.loads(_text(chunks))
    assert _matches(value, CITY_SCHEMA), value


# -- tools ------------------------------------------------------------------------------


def test_named_tool_choice_streams_arguments_matching_the_parameters(
    outputs: dict[str, list[EngineChunk]],
) -> None:
    chunks = outputs["named"]
    assert len(chunks) > 1  # streamed as written
    assert all(c.modality == "tool_call" for c in chunks)
    assert all(c.meta == ToolCallMeta(index=0, name="get_weather") for c in chunks)
    last = chunks[-1]
    assert last.finished and last.finish_reason == "tool_calls" and last.usage is not None
    arguments = json.loads(_text(chunks))
    assert _matches(arguments, WEATHER_PARAMS), arguments


def test_required_tool_choice_makes_exactly_one_call(
    outputs: dict[str, list[EngineChunk]],
) -> None:
    (call,) = outputs["required"]  # held back and emitted whole at the end
    assert call.modality == "tool_call" and call.meta is not None
    assert call.meta.index == 0 and call.meta.name in SCHEMAS
    assert call.finished and call.finish_reason == "tool_calls"
    arguments = json.loads(call.text)
    assert _matches(arguments, SCHEMAS[call.meta.name]), arguments


def _chunk_cut(chunks: list[EngineChunk], at_least: int) -> tuple[str, int]:
    """What a client has after the first chunks holding ``at_least`` characters, and
    the completion tokens the last of them reported (what the head puts in Resume). A
    failed replica's delivered text always ends at a chunk (so token) boundary; a cut
    inside a token ('{"city":"P' of '"Paris"') is continued differently ('alais')."""
    text = ""
    for chunk in chunks:
        text += chunk.text
        if len(text) >= at_least:
            assert chunk.usage is not None, "every chunk carries the usage so far"
            return text, chunk.usage.completion_tokens
    raise AssertionError(f"output shorter than {at_least}: {text!r}")


@pytest.fixture(scope="module")
def resumed(
    engine: LlmEngine, outputs: dict[str, list[EngineChunk]]
) -> tuple[str, int, list[EngineChunk]]:
    delivered, tokens = _chunk_cut(outputs["named"], 10)
    assert len(delivered) < len(_text(outputs["named"]))
    # With logprobs, to count the tokens the resumed run generates.
    request = _request(
        WEATHER_QUESTION, resume_text=delivered, resume_tokens=tokens, logprobs=True, **NAMED
    )
    (chunks,) = _runs(engine, request)
    return delivered, tokens, chunks


def test_a_resumed_named_call_continues_to_the_same_arguments(
    outputs: dict[str, list[EngineChunk]], resumed: tuple[str, int, list[EngineChunk]]
) -> None:
    delivered, _, chunks = resumed
    assert delivered + _text(chunks) == _text(outputs["named"])
    assert all(c.modality == "tool_call" for c in chunks)
    assert all(c.meta == ToolCallMeta(index=0, name="get_weather") for c in chunks)
    assert chunks[-1].finish_reason == "tool_calls"


def test_a_resumed_call_counts_the_tokens_the_failed_replica_reported(
    engine: LlmEngine,
    outputs: dict[str, list[EngineChunk]],
    resumed: tuple[str, int, list[EngineChunk]],
) -> None:
    delivered, tokens, chunks = resumed
    # Under the grammar the first run wrote the delivered text in more tokens than
    # re-encoding it gives; usage keeps the first run's count, not the re-encoded one.
    assert tokens > len(engine.tokenizer.encode(delivered, add_special_tokens=False))
    generated = sum(len(c.logprobs or []) for c in chunks)
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == tokens + generated


# -- logprobs ---------------------------------------------------------------------------


def test_greedy_logprobs_cover_the_text_and_the_top_choice(
    outputs: dict[str, list[EngineChunk]],
) -> None:
    chunks = outputs["logprobs"]
    entries = [lp for c in chunks for lp in (c.logprobs or [])]
    text = _text(chunks)
    assert text and "".join(e.token for e in entries) == text
    last = chunks[-1]
    assert last.usage is not None and len(entries) == last.usage.completion_tokens
    for e in entries:
        assert e.logprob <= 0
        assert e.bytes is not None and bytes(e.bytes).decode() == e.token
        assert len(e.top_logprobs) == 3
        values = [t.logprob for t in e.top_logprobs]
        assert all(v <= 0 for v in values) and values == sorted(values, reverse=True)
        # Greedy: the chosen token is the most likely one.
        assert e.top_logprobs[0].token == e.token
        assert e.top_logprobs[0].logprob == e.logprob
    # No logprobs unless asked.
    assert all(c.logprobs is None for c in outputs["plain"])


def test_an_open_user_message_is_continued_and_says_whether_the_words_end_it(
    outputs: dict[str, list[EngineChunk]],
) -> None:
    def ends(name: str) -> float:
        (entry,) = [lp for c in outputs[name] for lp in (c.logprobs or [])]
        return end_probability(entry)

    # Left open, the words go on: a sentence's end is likely after a finished question
    # and all but impossible after a cut one. Closed, the answer begins (no end mark).
    assert ends("open_finished") >= WORDS_END
    assert ends("open_cut") < 0.01
    assert ends("closed_finished") < 0.01
    # Read as a reply to the question it answers, a short reply ends a turn far more
    # surely than alone; one cut short still does not.
    assert ends("reply_finished") >= WORDS_END_EAGER > ends("reply_alone")
    assert ends("reply_finished") > 3 * ends("reply_alone")
    assert ends("reply_cut") < 0.01


# -- min_tokens, ignore_eos -------------------------------------------------------------


def _completion_tokens(chunks: list[EngineChunk]) -> int:
    usage = chunks[-1].usage
    assert usage is not None
    return usage.completion_tokens


def test_min_tokens_holds_off_the_end(outputs: dict[str, list[EngineChunk]]) -> None:
    plain = outputs["plain"]
    # Without min_tokens the answer ends well before 20 tokens, by itself.
    assert plain[-1].finish_reason == "stop" and _completion_tokens(plain) < 20
    held = outputs["min_tokens"]
    assert 20 <= _completion_tokens(held) <= 40
    assert _text(held).startswith(_text(plain))


def test_ignore_eos_runs_to_max_tokens(outputs: dict[str, list[EngineChunk]]) -> None:
    ignored = outputs["ignore_eos"]
    assert ignored[-1].finish_reason == "length"
    assert _completion_tokens(ignored) == 30


# -- validation -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("params", "param"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "intege"}},
                }
            },
            "response_format",
        ),
        ({"response_format": {"type": "xml"}}, "response_format"),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "f", "parameters": {"type": "intege"}},
                    }
                ],
                "tool_choice": "required",
            },
            "tools",
        ),
        ({"tools": TOOLS, "tool_choice": {"function": {"name": "nope"}}}, "tool_choice"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"min_tokens": -1}, "min_tokens"),
    ],
)
def test_check_rejects_bad_requests_up_front(
    engine: LlmEngine, params: dict[str, Any], param: str
) -> None:
    with pytest.raises(BadRequestError) as info:
        engine.check(P.text(params))
    assert info.value.param == param


def test_check_accepts_good_structured_requests(engine: LlmEngine) -> None:
    engine.check(P.text({"response_format": CITY_FORMAT, "logprobs": True, "top_logprobs": 5}))
    engine.check(P.text(NAMED))
    engine.check(P.text({"tools": TOOLS, "tool_choice": "required", "logit_bias": {"0": -100}}))


def test_check_rejects_a_logit_bias_token_outside_the_vocabulary(engine: LlmEngine) -> None:
    with pytest.raises(BadRequestError) as info:
        engine.check(P.text({"logit_bias": {"1000000": 1}}))
    assert info.value.param == "logit_bias"


def test_generate_rejects_a_logit_bias_token_outside_the_vocabulary(engine: LlmEngine) -> None:
    with pytest.raises(BadRequestError) as info:
        _runs(engine, _request("hi", logit_bias={"1000000": 1}, max_tokens=2))
    assert info.value.param == "logit_bias"
