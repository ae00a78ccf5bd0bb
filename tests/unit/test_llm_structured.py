"""Structured output for the llm engine, without model weights: the new sampling params
(logprobs, min_tokens, ignore_eos, logit_bias), the sampler's handling of them and of a
grammar constraint, tool plans and prompts, the output shaper, and response_format."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from omnistage.engines.base import EngineChunk  # noqa: E402
from omnistage.engines.llm.guided import schema_of_response_format  # noqa: E402
from omnistage.engines.llm.sampling import (  # noqa: E402
    Sampler,
    SamplingParams,
)
from omnistage.engines.llm.tools import (  # noqa: E402
    CallShaper,
    ToolPlan,
    chat_messages,
    plan_tools,
)
from omnistage.protocol.chunk_meta import ToolCallMeta  # noqa: E402
from omnistage.protocol.errors import BadRequestError  # noqa: E402
from omnistage.protocol.messages import ChatMessage, TokenLogprob, ToolCall, Usage  # noqa: E402
from omnistage.protocol.params import (  # noqa: E402
    MAX_TOP_LOGPROBS,
    GenerationParams,
    ParamKind,
    decode,
)

CPU = torch.device("cpu")


def _plan(params: dict[str, Any]) -> ToolPlan:
    return plan_tools(GenerationParams(**params))


def _params(**params: Any) -> SamplingParams:
    return SamplingParams.from_params(decode(ParamKind.TEXT, params).generation, 16)


# -- SamplingParams ---------------------------------------------------------------------


def test_new_fields_default_to_off() -> None:
    p = _params()
    assert p.logprobs is None
    assert p.min_tokens == 0 and p.ignore_eos is False and p.logit_bias == ()


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        ({"logprobs": True, "top_logprobs": 5}, 5),  # chat
        ({"logprobs": True}, 0),  # chat, the chosen token only
        ({"logprobs": True, "top_logprobs": MAX_TOP_LOGPROBS}, MAX_TOP_LOGPROBS),
        ({"logprobs": False}, None),
        ({"logprobs": None, "top_logprobs": 0}, None),
        ({"logprobs": 3}, 3),  # completions
        ({"logprobs": 0}, 0),  # completions: 0 is "the chosen one only", not "off"
        ({"logprobs": 20}, 20),
    ],
)
def test_logprobs_are_parsed_in_chat_and_completions_shape(
    params: dict, expected: int | None
) -> None:
    assert _params(**params).logprobs == expected


def test_min_tokens_ignore_eos_and_logit_bias_are_parsed() -> None:
    p = _params(min_tokens=5, ignore_eos=True, logit_bias={"7": -100, "12": 2.5, "3": 100})
    assert p.min_tokens == 5 and p.ignore_eos is True
    assert p.logit_bias == ((7, -100.0), (12, 2.5), (3, 100.0))
    assert all(isinstance(t, int) and isinstance(b, float) for t, b in p.logit_bias)
    off = _params(min_tokens=None, ignore_eos=None, logit_bias=None)
    assert (off.min_tokens, off.ignore_eos, off.logit_bias) == (0, False, ())


@pytest.mark.parametrize(
    ("params", "param"),
    [
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 2.0}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": True}, "top_logprobs"),
        ({"top_logprobs": 3}, "top_logprobs"),  # without logprobs
        ({"logprobs": False, "top_logprobs": 3}, "top_logprobs"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
        ({"logprobs": "yes"}, "logprobs"),
        ({"logprobs": 1.5}, "logprobs"),
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
        ({"logit_bias": {"-1": 1}}, "logit_bias"),
        ({"logit_bias": {"1.5": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"logit_bias": {"5": -100.5}}, "logit_bias"),
        ({"logit_bias": {"5": "1"}}, "logit_bias"),
        ({"logit_bias": {"5": True}}, "logit_bias"),
        ({"logit_bias": [[5, 1]]}, "logit_bias"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 1.5}, "min_tokens"),
        ({"min_tokens": True}, "min_tokens"),
        ({"min_tokens": "3"}, "min_tokens"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
        ({"ignore_eos": 1}, "ignore_eos"),
    ],
)
def test_bad_new_params_are_bad_requests_naming_the_field(params: dict, param: str) -> None:
    with pytest.raises(BadRequestError) as info:
        _params(**params)
    assert info.value.param == param


# -- Sampler ----------------------------------------------------------------------------


def test_logit_bias_changes_the_greedy_choice() -> None:
    logits = torch.tensor([1.0, 3.0, 2.0, 0.0])
    plain = Sampler(_params(temperature=0), 4, CPU)
    assert plain.sample(logits) == 1
    up = Sampler(_params(temperature=0, logit_bias={"3": 5}), 4, CPU)
    assert up.sample(logits) == 3
    down = Sampler(_params(temperature=0, logit_bias={"1": -100}), 4, CPU)
    assert down.sample(logits) == 2


def test_logit_bias_of_a_token_outside_the_vocabulary_is_a_bad_request() -> None:
    with pytest.raises(BadRequestError) as info:
        Sampler(_params(logit_bias={"4": 1}), 4, CPU)
    assert info.value.param == "logit_bias"


def test_min_tokens_bans_eos_until_reached() -> None:
    eos = 2
    logits = torch.tensor([0.0, 1.0, 5.0, 0.5])  # eos is the argmax
    s = Sampler(_params(temperature=0, min_tokens=3), 4, CPU, eos_ids=frozenset({eos}))
    assert [s.sample(logits, generated=g) for g in range(3)] == [1, 1, 1]
    assert s.sample(logits, generated=3) == eos
    assert s.sample(logits, generated=10) == eos


def test_min_tokens_bans_every_eos_id_when_sampling() -> None:
    logits = torch.tensor([0.0, 4.0, 4.0, 0.0, 4.0])
    params = _params(temperature=1.0, seed=3, min_tokens=100)
    s = Sampler(params, 5, CPU, eos_ids=frozenset({1, 4, 99}))  # 99: outside the vocab
    draws = [s.sample(logits, generated=g) for g in range(60)]
    assert 1 not in draws and 4 not in draws
    assert set(draws) <= {0, 2, 3}


def test_ignore_eos_never_picks_eos_even_as_the_argmax() -> None:
    logits = torch.tensor([0.0, 1.0, 9.0])
    greedy = Sampler(_params(temperature=0, ignore_eos=True), 3, CPU, eos_ids=frozenset({2}))
    assert all(greedy.sample(logits, generated=g) == 1 for g in range(0, 200, 7))
    sampled = Sampler(
        _params(temperature=1.0, seed=0, ignore_eos=True), 3, CPU, eos_ids=frozenset({2})
    )
    assert 2 not in [sampled.sample(logits, generated=g) for g in range(100)]


def test_without_eos_ids_min_tokens_changes_nothing() -> None:
    logits = torch.tensor([0.0, 1.0, 9.0])
    s = Sampler(_params(temperature=0, min_tokens=5, ignore_eos=True), 3, CPU)
    assert s.sample(logits) == 2


def test_no_logprobs_unless_asked() -> None:
    s = Sampler(_params(temperature=0), 3, CPU)
    s.sample(torch.tensor([0.0, 1.0, 2.0]))
    assert s.last_logprobs is None


@pytest.mark.parametrize(
    "params",
    [
        {"temperature": 0, "logprobs": True, "top_logprobs": 3},
        {"temperature": 0.3, "seed": 1, "logprobs": True, "top_logprobs": 3},
        {
            "temperature": 1.7,
            "seed": 2,
            "logit_bias": {"0": 100, "5": -40},
            "presence_penalty": 1.5,
            "logprobs": 3,
        },
    ],
)
def test_logprobs_are_the_raw_models_whatever_the_processing(params: dict) -> None:
    g = torch.Generator().manual_seed(7)
    s = Sampler(_params(**params), 8, CPU)
    for _ in range(20):
        logits = torch.randn(8, generator=g) * 3
        raw = torch.log_softmax(logits, dim=-1)
        token = s.sample(logits)
        assert s.last_logprobs is not None
        chosen, top = s.last_logprobs
        assert math.isclose(chosen, float(raw[token]), rel_tol=1e-5, abs_tol=1e-6)
        assert len(top) == 3
        values = [lp for _, lp in top]
        assert values == sorted(values, reverse=True)
        expected = torch.topk(raw, 3)
        assert [t for t, _ in top] == expected.indices.tolist()
        for (t, lp), want in zip(top, expected.values.tolist(), strict=True):
            assert math.isclose(lp, want, rel_tol=1e-5, abs_tol=1e-6)
            assert math.isclose(lp, float(raw[t]), rel_tol=1e-5, abs_tol=1e-6)
        assert all(lp <= 0 for lp in [chosen, *values])


def test_greedy_chosen_logprob_is_the_top_one() -> None:
    s = Sampler(_params(temperature=0, logprobs=True, top_logprobs=2), 4, CPU)
    token = s.sample(torch.tensor([0.5, 2.0, -1.0, 1.0]))
    assert s.last_logprobs is not None
    chosen, top = s.last_logprobs
    assert token == 1 and top[0][0] == 1 and top[0][1] == chosen and top[1][0] == 3


def test_logprobs_zero_reports_the_chosen_token_only() -> None:
    s = Sampler(_params(temperature=0, logprobs=0), 3, CPU)
    s.sample(torch.tensor([0.0, 0.0, 0.0]))
    assert s.last_logprobs is not None
    chosen, top = s.last_logprobs
    assert top == [] and math.isclose(chosen, math.log(1 / 3), rel_tol=1e-6)


class FakeConstraint:
    """Allows a fixed set of tokens; records what it is fed."""

    def __init__(self, vocab: int, allowed: set[int]) -> None:
        self.mask = torch.zeros(vocab, dtype=torch.bool)
        self.mask[sorted(allowed)] = True
        self.fed: list[int] = []
        self.calls = 0

    def allowed(self) -> torch.Tensor:
        self.calls += 1
        return self.mask

    def advance(self, token: int) -> None:
        self.fed.append(token)

    @property
    def complete(self) -> bool:
        return False


def test_a_constraint_restricts_the_greedy_choice_and_is_fed_it() -> None:
    c = FakeConstraint(5, {0, 3})
    s = Sampler(_params(temperature=0), 5, CPU, constraint=c)
    logits = torch.tensor([1.0, 9.0, 8.0, 2.0, 7.0])
    assert s.sample(logits) == 3
    assert s.sample(torch.tensor([5.0, 9.0, 8.0, 2.0, 7.0])) == 0
    assert c.fed == [3, 0] and c.calls == 2


def test_a_constraint_restricts_sampled_choices_and_gets_every_token() -> None:
    c = FakeConstraint(6, {1, 4, 5})
    s = Sampler(_params(temperature=1.5, seed=11, top_p=0.95), 6, CPU, constraint=c)
    logits = torch.tensor([3.0, 0.0, 3.0, 3.0, 0.5, 0.2])
    draws = [s.sample(logits, generated=g) for g in range(80)]
    assert set(draws) <= {1, 4, 5}
    assert len(set(draws)) > 1  # still sampling, not collapsed to one token
    assert c.fed == draws


def test_a_constraint_owns_the_end_min_tokens_and_ignore_eos_do_not_apply() -> None:
    # With a grammar, the grammar decides where the text may end.
    c = FakeConstraint(3, {2})
    s = Sampler(
        _params(temperature=0, min_tokens=10, ignore_eos=True),
        3,
        CPU,
        constraint=c,
        eos_ids=frozenset({2}),
    )
    assert s.sample(torch.tensor([5.0, 4.0, 0.0]), generated=0) == 2


def test_logit_bias_cannot_unmask_a_constrained_token() -> None:
    c = FakeConstraint(4, {0, 1})
    s = Sampler(_params(temperature=0, logit_bias={"3": 100}), 4, CPU, constraint=c)
    assert s.sample(torch.tensor([1.0, 2.0, 0.0, 0.0])) == 1


def test_logprobs_with_a_constraint_are_still_the_raw_models() -> None:
    c = FakeConstraint(4, {2})
    s = Sampler(_params(temperature=0, logprobs=True, top_logprobs=1), 4, CPU, constraint=c)
    logits = torch.tensor([4.0, 3.0, 1.0, 0.0])
    assert s.sample(logits) == 2
    assert s.last_logprobs is not None
    chosen, top = s.last_logprobs
    raw = torch.log_softmax(logits, dim=-1)
    assert math.isclose(chosen, float(raw[2]), rel_tol=1e-6)
    assert top[0][0] == 0


# -- tools: plans -----------------------------------------------------------------------

WEATHER_PARAMS = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
    "required": ["city"],
}


def _tool(name: str, parameters: dict | None = None, description: str = "") -> dict:
    fn: dict[str, Any] = {"name": name}
    if parameters is not None:
        fn["parameters"] = parameters
    if description:
        fn["description"] = description
    return {"type": "function", "function": fn}


TOOLS = [_tool("get_weather", WEATHER_PARAMS, "Weather in a city"), _tool("get_time")]


def _named(name: str) -> dict:
    return {"type": "function", "function": {"name": name}}


@pytest.mark.parametrize(
    ("params", "param"),
    [
        ({"tools": {"get_weather": {}}}, "tools"),
        ({"tools": "get_weather"}, "tools"),
        ({"tools": [_tool("has space")]}, "tools"),
        ({"tools": [_tool("")]}, "tools"),
        ({"tools": [_tool("x" * 65)]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": 3}}]}, "tools"),
        ({"tools": ["get_weather"]}, "tools"),
        ({"tools": [{"type": "retrieval", "function": {"name": "a"}}]}, "tools"),
        ({"tools": [{"type": "function"}]}, "tools"),
        ({"tools": [_tool("a", parameters=["x"])]}, "tools"),  # type: ignore[arg-type]
        ({"tools": [_tool("a"), _tool("b"), _tool("a")]}, "tools"),
        ({"tools": TOOLS, "tool_choice": _named("get_stock")}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [], "tool_choice": "required"}, "tool_choice"),
        ({"tool_choice": _named("get_weather")}, "tool_choice"),
    ],
)
def test_bad_tools_and_tool_choice_are_bad_requests(params: dict, param: str) -> None:
    with pytest.raises(BadRequestError) as info:
        _plan(params)
    assert info.value.param == param


def test_tool_modes() -> None:
    assert _plan({}).mode == "none"
    assert _plan({"tool_choice": "none"}) == ToolPlan()
    assert _plan({"tool_choice": "auto"}).mode == "none"  # no tools: nothing to call
    auto = _plan({"tools": TOOLS})
    assert auto.mode == "auto" and auto.offered and auto.named is None
    assert [t.name for t in auto.tools] == ["get_weather", "get_time"]
    assert _plan({"tools": TOOLS, "tool_choice": "auto"}).mode == "auto"
    none = _plan({"tools": TOOLS, "tool_choice": "none"})
    assert none.mode == "none" and not none.offered and none.schema() is None
    assert _plan({"tools": TOOLS, "tool_choice": "required"}).mode == "required"
    named = _plan({"tools": TOOLS, "tool_choice": _named("get_time")})
    assert named.mode == "named" and named.named is not None
    assert named.named.name == "get_time"


def test_tool_fields_and_defaults() -> None:
    plan = _plan({"tools": TOOLS})
    weather, time = plan.tools
    assert weather.description == "Weather in a city" and weather.parameters == WEATHER_PARAMS
    # A function without parameters takes an empty object.
    assert time.parameters == {"type": "object", "properties": {}}
    assert time.description == ""
    assert weather.spec() == {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": WEATHER_PARAMS,
        },
    }
    # "type" may be left out.
    bare = _plan({"tools": [{"function": {"name": "f.x-1"}}]})
    assert bare.tools[0].name == "f.x-1"


def test_schema_of_a_named_plan_is_its_parameters() -> None:
    plan = _plan({"tools": TOOLS, "tool_choice": _named("get_weather")})
    assert plan.schema() == WEATHER_PARAMS
    assert _plan({"tools": TOOLS}).schema() is None


def test_schema_of_a_required_plan_is_any_one_call() -> None:
    schema = _plan({"tools": TOOLS, "tool_choice": "required"}).schema()
    assert schema is not None
    options = schema["anyOf"]
    assert len(options) == 2
    for option, (name, parameters) in zip(
        options,
        [("get_weather", WEATHER_PARAMS), ("get_time", {"type": "object", "properties": {}})],
        strict=True,
    ):
        assert option["type"] == "object"
        assert option["properties"] == {"name": {"const": name}, "arguments": parameters}
        assert sorted(option["required"]) == ["arguments", "name"]
        assert option["additionalProperties"] is False


# -- tools: prompts ---------------------------------------------------------------------

HISTORY = [
    ChatMessage("user", "Weather in Paris?"),
    ChatMessage(
        "assistant",
        "",
        tool_calls=[ToolCall("call_1", "get_weather", '{"city": "Paris"}')],
    ),
    ChatMessage("tool", '{"temp": 21}', tool_call_id="call_1"),
]


def test_hermes_prompt_puts_tools_in_a_new_system_turn() -> None:
    plan = _plan({"tools": TOOLS})
    out = chat_messages([ChatMessage("user", "hi")], plan, template_knows_tools=False)
    assert [m["role"] for m in out] == ["system", "user"]
    system = out[0]["content"]
    assert "<tools>" in system and "</tools>" in system
    assert "<tool_call>" in system and "</tool_call>" in system
    block = system.split("<tools>\n", 1)[1].split("\n</tools>", 1)[0]
    specs = [json.loads(line) for line in block.splitlines()]
    assert specs == [t.spec() for t in plan.tools]
    assert out[1] == {"role": "user", "content": "hi"}


@pytest.mark.parametrize("role", ["system", "developer"])
def test_hermes_prompt_merges_the_tools_into_an_existing_system_turn(role: str) -> None:
    plan = _plan({"tools": TOOLS, "tool_choice": "required"})
    messages = [ChatMessage(role, "Be terse."), ChatMessage("user", "hi")]
    out = chat_messages(messages, plan, template_knows_tools=False)
    assert [m["role"] for m in out] == ["system", "user"]
    assert out[0]["content"].startswith("Be terse.\n\n")
    assert "<tools>" in out[0]["content"]
    assert out[0]["content"].count("<tools>\n") == 1  # one tools block


def test_hermes_prompt_renders_calls_and_tool_answers() -> None:
    plan = _plan({"tools": TOOLS})
    out = chat_messages(HISTORY, plan, template_knows_tools=False)
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert out[1] == {"role": "user", "content": "Weather in Paris?"}
    call = out[2]["content"]
    assert call.startswith("<tool_call>\n") and call.endswith("\n</tool_call>")
    body = call.removeprefix("<tool_call>\n").removesuffix("\n</tool_call>")
    assert json.loads(body) == {"name": "get_weather", "arguments": {"city": "Paris"}}
    assert out[3] == {
        "role": "user",
        "content": '<tool_response>\n{"temp": 21}\n</tool_response>',
    }
    assert all(set(m) == {"role", "content"} for m in out)


def test_hermes_prompt_keeps_assistant_text_before_its_calls() -> None:
    msg = ChatMessage(
        "assistant",
        "Checking both.",
        tool_calls=[
            ToolCall("a", "get_weather", '{"city": "Oslo"}'),
            ToolCall("b", "get_time", "not json"),
        ],
    )
    (out,) = chat_messages([msg], ToolPlan(), template_knows_tools=False)
    lines = out["content"].split("\n")
    assert lines[0] == "Checking both."
    assert out["content"].count("<tool_call>") == 2
    bodies = [lines[i + 1] for i, line in enumerate(lines) if line == "<tool_call>"]
    assert json.loads(bodies[0]) == {"name": "get_weather", "arguments": {"city": "Oslo"}}
    # Arguments that are not JSON are kept as the string they were.
    assert json.loads(bodies[1]) == {"name": "get_time", "arguments": "not json"}


def test_no_tools_block_when_tools_are_not_offered() -> None:
    plan = _plan({"tools": TOOLS, "tool_choice": "none"})
    out = chat_messages([ChatMessage("user", "hi")], plan, template_knows_tools=False)
    assert out == [{"role": "user", "content": "hi"}]


def test_a_template_that_knows_tools_gets_native_messages() -> None:
    plan = _plan({"tools": TOOLS})
    out = chat_messages(HISTORY, plan, template_knows_tools=True)
    assert out[0] == {"role": "user", "content": "Weather in Paris?"}
    assert out[1] == {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
            }
        ],
    }
    assert out[2] == {"role": "tool", "content": '{"temp": 21}', "tool_call_id": "call_1"}
    assert len(out) == 3  # no system turn added: the template renders the tools


# -- CallShaper -------------------------------------------------------------------------


def _lp(token: str) -> TokenLogprob:
    return TokenLogprob(token, -0.5, list(token.encode()), [])


def _chunks(pieces: list[str], finish: str = "stop", logprobs: bool = False) -> list[EngineChunk]:
    out = [
        EngineChunk("text", text=p, logprobs=[_lp(p)] if logprobs and p else None) for p in pieces
    ]
    out[-1].finished, out[-1].finish_reason = True, finish
    out[-1].usage = Usage(prompt_tokens=3, completion_tokens=len(pieces))
    return out


def _shape(shaper: CallShaper, chunks: list[EngineChunk]) -> list[list[EngineChunk]]:
    return [shaper.shape(c) for c in chunks]


def _flat(steps: list[list[EngineChunk]]) -> list[EngineChunk]:
    return [c for step in steps for c in step]


def _logprob_tokens(chunks: list[EngineChunk]) -> list[str]:
    return [lp.token for c in chunks for lp in (c.logprobs or [])]


def test_named_mode_streams_every_chunk_as_a_call_piece() -> None:
    plan = _plan({"tools": TOOLS, "tool_choice": _named("get_weather")})
    pieces = ['{"city"', ':"Par', 'is"}', ""]
    steps = _shape(CallShaper(plan), _chunks(pieces, logprobs=True))
    assert all(len(step) == 1 for step in steps)  # nothing held back
    out = _flat(steps)
    assert all(c.modality == "tool_call" for c in out)
    assert all(c.meta == ToolCallMeta(index=0, name="get_weather") for c in out)
    assert json.loads("".join(c.text for c in out)) == {"city": "Paris"}
    assert [c.finished for c in out] == [False, False, False, True]
    assert out[-1].finish_reason == "tool_calls"
    assert out[-1].usage == Usage(prompt_tokens=3, completion_tokens=4)
    assert _logprob_tokens(out) == pieces[:3]


def test_named_mode_keeps_a_length_finish() -> None:
    plan = _plan({"tools": TOOLS, "tool_choice": _named("get_weather")})
    out = _flat(_shape(CallShaper(plan), _chunks(['{"ci', "ty"], finish="length")))
    assert out[-1].finish_reason == "length" and out[-1].modality == "tool_call"


def test_required_mode_emits_one_compact_call_at_the_end() -> None:
    plan = _plan({"tools": TOOLS, "tool_choice": "required"})
    pieces = ['{"name":"get_we', 'ather","arguments":', '{"city": "Paris",  "unit":"c"}}']
    steps = _shape(CallShaper(plan), _chunks(pieces, logprobs=True))
    assert steps[:-1] == [[], []]
    (call,) = steps[-1]
    assert call.modality == "tool_call" and call.meta == ToolCallMeta(index=0, name="get_weather")
    assert call.text == '{"city":"Paris","unit":"c"}'
    assert call.finished and call.finish_reason == "tool_calls"
    assert call.usage == Usage(prompt_tokens=3, completion_tokens=3)
    assert _logprob_tokens([call]) == pieces


def test_auto_mode_passes_plain_text_through() -> None:
    plan = _plan({"tools": TOOLS})
    steps = _shape(CallShaper(plan), _chunks(["Hello", " there", ""], logprobs=True))
    assert [[c.text for c in step] for step in steps] == [["Hello"], [" there"], [""]]
    out = _flat(steps)
    assert all(c.modality == "text" for c in out)
    assert out[-1].finish_reason == "stop"
    assert _logprob_tokens(out) == ["Hello", " there"]


def test_auto_mode_holds_what_may_still_be_a_tool_call_tag() -> None:
    plan = _plan({"tools": TOOLS})
    shaper = CallShaper(plan)
    steps = _shape(shaper, _chunks(["  ", "<t", "ool", "s are", " fun"], logprobs=True))
    # "  <tool" could still become "<tool_call>"; "  <tools are" cannot.
    assert steps[:3] == [[], [], []]
    assert [c.text for c in steps[3]] == ["  <tools are"]
    assert _logprob_tokens(steps[3]) == ["  ", "<t", "ool", "s are"]
    assert [c.text for c in steps[4]] == [" fun"]
    assert steps[4][0].finish_reason == "stop" and steps[4][0].modality == "text"


def test_auto_mode_parses_a_call_whose_tag_arrives_split() -> None:
    plan = _plan({"tools": TOOLS})
    pieces = ["<to", "ol_call>", '\n{"name": "get_weather", ', '"arguments": {"city": "Oslo"}}\n']
    pieces.append("</tool_call>")
    steps = _shape(CallShaper(plan), _chunks(pieces, logprobs=True))
    assert steps[:-1] == [[], [], [], []]
    (call,) = steps[-1]
    assert call.modality == "tool_call"
    assert call.meta == ToolCallMeta(index=0, name="get_weather")
    assert call.text == '{"city":"Oslo"}'
    assert call.finished and call.finish_reason == "tool_calls"
    assert call.usage == Usage(prompt_tokens=3, completion_tokens=5)
    assert _logprob_tokens([call]) == pieces


def test_auto_mode_parses_two_calls() -> None:
    plan = _plan({"tools": TOOLS})
    text = (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": "{}"}\n</tool_call>'
    )
    steps = _shape(CallShaper(plan), _chunks([text[:30], text[30:]], logprobs=True))
    assert steps[0] == []
    first, second = steps[1]
    assert [c.modality for c in (first, second)] == ["tool_call", "tool_call"]
    assert first.meta == ToolCallMeta(index=0, name="get_weather")
    assert second.meta == ToolCallMeta(index=1, name="get_time")
    assert first.text == '{"city":"Rome"}'
    assert second.text == "{}"  # arguments written as a JSON string are parsed
    assert not first.finished and first.finish_reason is None
    assert second.finished and second.finish_reason == "tool_calls"
    assert second.usage is not None
    assert _logprob_tokens([first, second]) == [text[:30], text[30:]]


def test_auto_mode_parses_a_call_cut_off_before_its_closing_tag() -> None:
    plan = _plan({"tools": TOOLS})
    text = '<tool_call>\n{"name": "get_time", "arguments": {}}'
    (call,) = _flat(_shape(CallShaper(plan), _chunks([text], finish="length")))
    assert call.modality == "tool_call" and call.meta == ToolCallMeta(index=0, name="get_time")
    assert call.finish_reason == "length"


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": \n</tool_call>',
        '<tool_call>\n{"name": "get_stock", "arguments": {}}\n</tool_call>',
        "<tool_call>\n[1, 2]\n</tool_call>",
        "<tool_",
    ],
)
def test_auto_mode_falls_back_to_text_when_no_call_parses(text: str) -> None:
    plan = _plan({"tools": TOOLS})
    pieces = [text[:5], text[5:]] if len(text) > 5 else [text]
    out = _flat(_shape(CallShaper(plan), _chunks(pieces, logprobs=True)))
    (last,) = out
    assert last.modality == "text" and last.text == text
    assert last.finished and last.finish_reason == "stop"
    assert last.usage is not None
    assert _logprob_tokens(out) == pieces


def test_auto_mode_with_resumed_text_passes_through_from_the_start() -> None:
    plan = _plan({"tools": TOOLS})
    shaper = CallShaper(plan, resumed="The weather is")
    steps = _shape(shaper, _chunks(["<t", "ool_call>", " fine"]))
    assert [[c.text for c in step] for step in steps] == [["<t"], ["ool_call>"], [" fine"]]
    assert all(c.modality == "text" for c in _flat(steps))


def test_no_tools_passes_everything_through() -> None:
    steps = _shape(CallShaper(ToolPlan()), _chunks(["<tool_call>", "{}"]))
    assert [[c.text for c in step] for step in steps] == [["<tool_call>"], ["{}"]]


# -- response_format --------------------------------------------------------------------


def test_response_format_schemas() -> None:
    assert schema_of_response_format(None) is None
    assert schema_of_response_format({"type": "text"}) is None
    assert schema_of_response_format({"type": "json_object"}) == {"type": "object"}
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    spec = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
    assert schema_of_response_format(spec) == schema
    # OpenAI allows a json_schema with a name only.
    named_only = {"type": "json_schema", "json_schema": {"name": "x"}}
    assert schema_of_response_format(named_only) == {"type": "object"}


@pytest.mark.parametrize(
    "value",
    [
        "json_object",
        {},
        {"type": 3},
        {"type": "xml"},
        {"type": "json_schema"},
        {"type": "json_schema", "json_schema": "x"},
        {"type": "json_schema", "json_schema": {"name": "x", "schema": "object"}},
        {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}},
    ],
)
def test_bad_response_formats_are_bad_requests(value: Any) -> None:
    with pytest.raises(BadRequestError) as info:
        schema_of_response_format(value)
    assert info.value.param == "response_format"
