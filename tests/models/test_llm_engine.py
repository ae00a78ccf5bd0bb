"""The llm engine on the real SmolLM2-135M-Instruct weights, in-process."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from omnistage.config.schema import StageConfig
from omnistage.engines.base import EngineChunk, EngineRequest, StageInput
from omnistage.engines.llm.engine import LlmEngine
from omnistage.protocol.errors import BadRequestError
from omnistage.protocol.messages import ChatMessage, Prompt
from tests import params as P

pytestmark = pytest.mark.slow

GREEDY = {"temperature": 0}


async def _no_inputs() -> AsyncIterator[StageInput]:
    return
    yield  # pragma: no cover


def _request(text: str, rid: str = "r", **params: object) -> EngineRequest:
    prompt = Prompt(messages=[ChatMessage("user", text)])
    return EngineRequest(rid, prompt, P.text(params), _no_inputs())


async def _started(**engine_args: object) -> LlmEngine:
    engine = LlmEngine(
        StageConfig(stage_id=0, name="thinker", engine="llm", engine_args=engine_args)
    )
    await engine.start()
    return engine


async def _run(engine: LlmEngine, request: EngineRequest) -> list[EngineChunk]:
    return [c async for c in engine.generate(request)]


def _text(chunks: list[EngineChunk]) -> str:
    return "".join(c.text for c in chunks)


def test_answers_the_capital_of_france_with_exact_usage() -> None:
    async def main() -> None:
        engine = await _started()
        try:
            chunks = await _run(engine, _request("What is the capital of France?", **GREEDY))
            text = _text(chunks)
            assert "Paris" in text
            last = chunks[-1]
            assert last.finished and last.finish_reason == "stop"
            tok = engine.tokenizer
            expected_prompt = tok.apply_chat_template(
                [{"role": "user", "content": "What is the capital of France?"}],
                add_generation_prompt=True,
                tokenize=True,
            )
            if hasattr(expected_prompt, "keys"):
                expected_prompt = expected_prompt["input_ids"]
            assert last.usage.prompt_tokens == len(expected_prompt)
            assert last.usage.completion_tokens == len(tok.encode(text))
        finally:
            await engine.shutdown()

    asyncio.run(main())


def test_max_tokens_and_stop_are_honoured() -> None:
    async def main() -> None:
        engine = await _started()
        try:
            capped = await _run(engine, _request("Count from 1 to 30.", max_tokens=7, **GREEDY))
            assert capped[-1].finish_reason == "length"
            assert capped[-1].usage.completion_tokens == 7
            stopped = await _run(
                engine, _request("Count from 1 to 30.", max_tokens=80, stop=["7"], **GREEDY)
            )
            text = _text(stopped)
            assert stopped[-1].finish_reason == "stop"
            assert "7" not in text and "6" in text
        finally:
            await engine.shutdown()

    asyncio.run(main())


def test_eight_concurrent_streams_match_their_solo_runs() -> None:
    prompts = [f"Name one animal that lives in habitat number {i}." for i in range(8)]

    async def main() -> None:
        engine = await _started()
        try:
            solo = [
                _text(await _run(engine, _request(p, max_tokens=20, **GREEDY))) for p in prompts
            ]
            steps_before = engine.progress
            together = await asyncio.gather(
                *(
                    _run(engine, _request(p, rid=f"c{i}", max_tokens=20, **GREEDY))
                    for i, p in enumerate(prompts)
                )
            )
            batched_steps = engine.progress - steps_before
            assert [_text(c) for c in together] == solo
            # Continuous batching: far fewer steps than 8 sequences x 20 tokens.
            assert batched_steps < 8 * 20 / 2
        finally:
            await engine.shutdown()

    asyncio.run(main())


def test_an_aborted_request_stops_consuming_decode_steps() -> None:
    async def main() -> None:
        engine = await _started()
        try:
            stream = engine.generate(_request("Write a very long story.", max_tokens=400))
            seen = 0
            async for _ in stream:
                seen += 1
                if seen == 3:
                    break
            await stream.aclose()  # what cancellation of the request's task does
            worker = engine._worker
            assert worker is not None
            for _ in range(50):
                if worker.running == 0:
                    break
                await asyncio.sleep(0.02)
            assert worker.running == 0
            steps = engine.progress
            await asyncio.sleep(0.5)
            assert engine.progress == steps  # nothing is decoding any more
        finally:
            await engine.shutdown()

    asyncio.run(main())


def test_streamed_deltas_never_split_a_character() -> None:
    async def main() -> None:
        engine = await _started()
        try:
            chunks = await _run(
                engine,
                _request(
                    "Write three French words with accents, like café, and an emoji.",
                    max_tokens=40,
                    **GREEDY,
                ),
            )
            assert all("\ufffd" not in c.text for c in chunks)
            text = _text(chunks)
            assert any(ord(ch) > 127 for ch in text)
        finally:
            await engine.shutdown()

    asyncio.run(main())


def test_prompt_longer_than_the_window_is_a_bad_request() -> None:
    async def main() -> None:
        engine = await _started(max_model_len=64)
        try:
            with pytest.raises(BadRequestError, match="maximum context length is 64 tokens"):
                await _run(engine, _request("word " * 200))
        finally:
            await engine.shutdown()

    asyncio.run(main())


def _long_conversation(exchanges: int, question: str) -> Prompt:
    messages = []
    for i in range(exchanges):
        messages.append(ChatMessage("user", f"Tell me something about the number {i}, please."))
        messages.append(ChatMessage("assistant", f"The number {i} comes after {i - 1}."))
    messages.append(ChatMessage("user", question))
    return Prompt(messages=messages)


def test_truncation_auto_drops_the_oldest_exchanges_instead_of_refusing() -> None:
    async def main() -> None:
        engine = await _started(max_model_len=256)
        try:
            prompt = _long_conversation(40, "What is the capital of France?")
            refused = EngineRequest("whole", prompt, P.text(GREEDY), _no_inputs())
            with pytest.raises(BadRequestError, match="maximum context length is 256"):
                await _run(engine, refused)
            params = P.text({**GREEDY, "truncation": "auto", "max_tokens": 16})
            chunks = await _run(engine, EngineRequest("cut", prompt, params, _no_inputs()))
            usage = chunks[-1].usage
            assert usage is not None and usage.prompt_tokens + 16 <= 256
            assert "Paris" in _text(chunks)  # the newest turn is the one answered
            # The conversation grows an exchange at a time: its head is mostly kept (the cut
            # moves by a block, about three of these exchanges, now and then), and then
            # read from the prefix cache.
            cached = []
            for exchanges in (41, 42):
                longer = _long_conversation(exchanges, "What is the capital of France?")
                rid = f"grown-{exchanges}"
                again = await _run(engine, EngineRequest(rid, longer, params, _no_inputs()))
                usage = again[-1].usage
                assert usage is not None and usage.cached_tokens is not None
                cached.append(usage.cached_tokens / usage.prompt_tokens)
            assert max(cached) > 0.5, cached
        finally:
            await engine.shutdown()

    asyncio.run(main())
