"""Where a thinker's sampling and system prompt come from, lowest first: the model's own
generation_config.json, the stage's ``default_sampling_params`` (and ``system_prompt``),
the request's own fields (and its system message)."""

from __future__ import annotations

import json
from pathlib import Path

from omnistage.config.load import load_config
from omnistage.dataplane.graph import StageGraph
from omnistage.engines.llm.model_defaults import (
    generation_defaults,
    read_generation_defaults,
    under_model,
)
from omnistage.engines.llm.prompts import with_system
from omnistage.protocol.front import PipelineRequest
from omnistage.protocol.messages import ChatMessage, Prompt
from omnistage.protocol.params import GenerationParams
from tests import params as P

LLAMA3 = {
    "bos_token_id": 128000,
    "do_sample": True,
    "eos_token_id": [128001, 128009],
    "temperature": 0.6,
    "top_p": 0.9,
    "top_k": 40,
    "repetition_penalty": 1.1,
    "max_new_tokens": 99,
    "transformers_version": "4.45.0",
}


def test_the_sampling_keys_of_a_generation_config_are_read() -> None:
    got = generation_defaults(LLAMA3)
    assert got == GenerationParams(temperature=0.6, top_p=0.9, top_k=40, repetition_penalty=1.1)


def test_a_config_without_sampling_values_gives_none(tmp_path: Path) -> None:
    # What the default model's converted copy holds.
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2})
    )
    assert read_generation_defaults(tmp_path) == GenerationParams()
    assert read_generation_defaults(tmp_path / "missing") == GenerationParams()


def test_bad_or_unreadable_values_are_left_out(tmp_path: Path) -> None:
    got = generation_defaults({"temperature": 5.0, "top_p": 0.0, "top_k": 20})
    assert got == GenerationParams(top_k=20)
    (tmp_path / "generation_config.json").write_text("{not json")
    assert read_generation_defaults(tmp_path) == GenerationParams()


def test_the_request_over_the_stage_over_the_model() -> None:
    model = GenerationParams(temperature=0.6, top_p=0.9, top_k=40, repetition_penalty=1.1)
    stage = P.text(temperature=0.3, max_tokens=64)
    request = P.text(top_p=0.5)
    # The head merges the stage's defaults under the request; the engine puts the
    # model's under both.
    got = under_model(model, stage.merged(request).generation)
    assert got.temperature == 0.3  # the stage's, over the model's
    assert got.top_p == 0.5  # the request's, over the model's
    assert got.top_k == 40 and got.repetition_penalty == 1.1  # the model's alone
    assert got.max_tokens == 64
    # A request that sets a field wins over both.
    hot = under_model(model, stage.merged(P.text(temperature=1.2)).generation)
    assert hot.temperature == 1.2


def test_no_model_defaults_leaves_the_request_as_it_is() -> None:
    request = P.text(temperature=0.2).generation
    assert under_model(GenerationParams(), request) is request


def test_the_default_pipeline_thinker_has_a_voice_prompt_and_chosen_sampling() -> None:
    config = load_config("voice")
    thinker = next(s for s in config.stages if s.name == "thinker")
    prompt = thinker.engine_args["system_prompt"]
    assert "voice assistant" in prompt and "English" in prompt
    # The head's merge: the stage's sampling under a request that sets nothing.
    graph = StageGraph(config)
    request = PipelineRequest("r", Prompt(text="hi"), [thinker.stage_id])
    got = graph.params_for(thinker.stage_id, request).generation
    assert got.temperature == thinker.default_sampling_params["temperature"]
    asked = PipelineRequest("r", Prompt(text="hi"), [0], params=P.text(temperature=1.0))
    assert graph.params_for(thinker.stage_id, asked).generation.temperature == 1.0


def test_the_vllm_voice_pipeline_matches_the_default_one() -> None:
    voice, vllm = (
        next(s for s in load_config(name).stages if s.name == "thinker")
        for name in ("voice", "voice-vllm")
    )
    assert vllm.engine_args["system_prompt"] == voice.engine_args["system_prompt"]
    assert vllm.default_sampling_params == voice.default_sampling_params


STAGE_PROMPT = "You are a voice assistant."


def _system_of(prompt: Prompt) -> list[str]:
    return [m.content for m in prompt.messages or [] if m.role in ("system", "developer")]


def test_the_stage_prompt_goes_first_when_the_client_sends_none() -> None:
    prompt = with_system(Prompt(messages=[ChatMessage("user", "hi")]), STAGE_PROMPT)
    assert prompt.messages == [ChatMessage("system", STAGE_PROMPT), ChatMessage("user", "hi")]


def test_a_client_system_or_developer_message_replaces_the_stage_prompt() -> None:
    # A chat's system message, a Responses request's instructions and a Realtime
    # session's instructions all reach the thinker as a system message.
    for role in ("system", "developer"):
        client = Prompt(messages=[ChatMessage(role, "Be a pirate."), ChatMessage("user", "hi")])
        assert with_system(client, STAGE_PROMPT) == client
        assert _system_of(with_system(client, STAGE_PROMPT)) == ["Be a pirate."]


def test_a_raw_text_prompt_gets_no_system_turn() -> None:
    assert with_system(Prompt(text="Once upon"), STAGE_PROMPT) == Prompt(text="Once upon")


def test_realtime_instructions_replace_the_stage_prompt_and_empty_ones_keep_it() -> None:
    from omnistage.realtime.conversation import chat_messages

    session = Prompt(messages=chat_messages("Speak like a pirate.", []))
    assert _system_of(with_system(session, STAGE_PROMPT)) == ["Speak like a pirate."]
    # ``instructions: ""``: the session brings none, and the stage's applies.
    silent = Prompt(messages=[*chat_messages("", []), ChatMessage("user", "hi")])
    assert _system_of(with_system(silent, STAGE_PROMPT)) == [STAGE_PROMPT]
