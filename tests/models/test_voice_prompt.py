"""The default pipeline's thinker on the real SmolLM2 weights: its voice system prompt
comes first unless the client brings its own, and its sampling is the model's own
generation_config.json under the stage's defaults under the request's fields.

Whether the answers are right is a benchmark (bench/bench_answers.py), not a test."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import openai
import pytest

from omnistage.config.load import load_config
from omnistage.dataplane.graph import StageGraph
from omnistage.engines.base import EngineRequest, StageInput
from omnistage.engines.llm.engine import LlmEngine
from omnistage.engines.llm.weights import DEFAULT_MODEL, local_model_dir
from omnistage.protocol.front import PipelineRequest
from omnistage.protocol.messages import ChatMessage, Prompt
from tests import params as P

pytestmark = pytest.mark.slow

QUESTION = "What is the capital of France?"
# The model's own sampling, as a generation_config.json would carry it.
MODEL_SAMPLING = {"temperature": 1.3, "top_p": 0.95, "top_k": 30, "repetition_penalty": 1.2}


async def _no_inputs() -> AsyncIterator[StageInput]:
    return
    yield  # pragma: no cover


def _voice_prompt() -> str:
    thinker = next(s for s in load_config("voice").stages if s.name == "thinker")
    return str(thinker.engine_args["system_prompt"])


def _template(tokenizer: Any, messages: list[dict[str, str]], **kw: Any) -> list[int]:
    out = tokenizer.apply_chat_template(messages, tokenize=True, **kw)
    if hasattr(out, "keys"):
        out = out["input_ids"]
    return [int(i) for i in out]


def _model_dir_with_sampling(tmp_path: Path) -> Path:
    """The default model's converted files, with a generation_config.json of our own."""
    source = local_model_dir(DEFAULT_MODEL)
    target = tmp_path / "model"
    target.mkdir()
    for f in source.iterdir():
        if f.name != "generation_config.json":
            (target / f.name).symlink_to(f)
    config = {"bos_token_id": 1, "eos_token_id": 2, "do_sample": True, **MODEL_SAMPLING}
    (target / "generation_config.json").write_text(json.dumps(config))
    return target


def test_the_thinker_reads_its_voice_prompt_first_and_layers_its_sampling(
    tmp_path: Path,
) -> None:
    model = str(_model_dir_with_sampling(tmp_path))
    config = load_config("voice", {"0": {"engine_args": {"model": model}}})
    graph = StageGraph(config)
    thinker = next(s for s in config.stages if s.name == "thinker")
    system = _voice_prompt()

    async def main() -> None:
        engine = LlmEngine(thinker)
        await engine.start()
        try:
            inputs, tok = engine._started()[1], engine.tokenizer

            def process(messages: list[ChatMessage], **request: Any) -> Any:
                prompt = Prompt(messages=messages)
                asked = PipelineRequest("r", prompt, [0], params=P.text(**request))
                params = graph.params_for(thinker.stage_id, asked)
                return inputs.process(EngineRequest("r", prompt, params, _no_inputs()), "")

            user = ChatMessage("user", QUESTION)
            plain = process([user], top_p=0.5)
            first = _template(tok, [{"role": "system", "content": system}])
            assert plain.prompt_ids[: len(first)] == first
            assert plain.prompt_ids == _template(
                tok,
                [{"role": "system", "content": system}, {"role": "user", "content": QUESTION}],
                add_generation_prompt=True,
            )
            # The request's top_p, the stage's temperature and max_tokens, the model's
            # top_k and repetition penalty.
            stage = thinker.default_sampling_params
            s = plain.sampling
            assert s.top_p == 0.5
            assert s.temperature == stage["temperature"] != MODEL_SAMPLING["temperature"]
            assert s.max_tokens == stage["max_tokens"]
            assert s.top_k == MODEL_SAMPLING["top_k"]
            assert s.repetition_penalty == MODEL_SAMPLING["repetition_penalty"]
            hot = process([user], temperature=1.1, repetition_penalty=1.0).sampling
            assert hot.temperature == 1.1 and hot.repetition_penalty == 1.0

            # A client's system message replaces the stage's prompt.
            own = process([ChatMessage("system", "Answer like a pirate."), user])
            assert own.prompt_ids == _template(
                tok,
                [
                    {"role": "system", "content": "Answer like a pirate."},
                    {"role": "user", "content": QUESTION},
                ],
                add_generation_prompt=True,
            )
            assert system not in tok.decode(own.prompt_ids)

            # The layered sampling runs (the repetition penalty included).
            prompt = Prompt(messages=[user])
            params = graph.params_for(0, PipelineRequest("a", prompt, [0], params=P.text()))
            request = EngineRequest("a", prompt, params.merged(P.text(max_tokens=12)), _no_inputs())
            chunks = [c async for c in engine.generate(request)]
            assert chunks[-1].finished and "".join(c.text for c in chunks).strip()
        finally:
            await engine.shutdown()

    asyncio.run(main())


def test_the_served_pipeline_prompts_its_thinker_unless_the_client_does(
    voice_client: openai.OpenAI,
) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(local_model_dir(DEFAULT_MODEL))

    def prompt_tokens(messages: list[dict[str, str]]) -> int:
        out = voice_client.chat.completions.create(
            model="voice", messages=messages, temperature=0, max_tokens=1
        )
        assert out.usage is not None
        return out.usage.prompt_tokens

    user = {"role": "user", "content": QUESTION}
    stage = {"role": "system", "content": _voice_prompt()}
    assert prompt_tokens([user]) == len(_template(tok, [stage, user], add_generation_prompt=True))
    pirate = {"role": "system", "content": "Answer like a pirate."}
    assert prompt_tokens([pirate, user]) == len(
        _template(tok, [pirate, user], add_generation_prompt=True)
    )
