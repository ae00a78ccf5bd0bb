"""Resuming an llm request on the real SmolLM2-135M-Instruct weights, in-process.

A retry after a replica failure hands the engine what the client already has
(``resume_text``); with greedy sampling the resumed run must produce exactly the rest of
what an uninterrupted run produces, and account its usage as if nothing had happened.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator

import pytest

from omnistage.config.schema import StageConfig
from omnistage.engines.base import EngineChunk, EngineRequest, StageInput
from omnistage.engines.llm.engine import LlmEngine
from omnistage.protocol.messages import ChatMessage, Prompt

pytestmark = pytest.mark.slow

N = 24
GREEDY = {"temperature": 0, "max_tokens": N}
PROMPT = "Write a short story about a robot who learns to paint."


async def _no_inputs() -> AsyncIterator[StageInput]:
    return
    yield  # pragma: no cover


def _request(resume_text: str = "", **params: object) -> EngineRequest:
    prompt = Prompt(messages=[ChatMessage("user", PROMPT)])
    return EngineRequest("r", prompt, {**GREEDY, **params}, _no_inputs(), resume_text)


def _run(engine: LlmEngine, request: EngineRequest) -> list[EngineChunk]:
    async def main() -> list[EngineChunk]:
        return [c async for c in engine.generate(request)]

    return asyncio.run(main())


def _text(chunks: list[EngineChunk]) -> str:
    return "".join(c.text for c in chunks)


@pytest.fixture(scope="module")
def engine() -> Iterator[LlmEngine]:
    # One engine for the module: loading the weights is most of the cost. Its worker
    # is a thread and each generate call binds to the running loop, so separate
    # asyncio.run calls can share it.
    eng = LlmEngine(StageConfig(stage_id=0, name="thinker", engine="llm", engine_args={}))
    asyncio.run(eng.start())
    yield eng
    asyncio.run(eng.shutdown())


@pytest.fixture(scope="module")
def original(engine: LlmEngine) -> list[EngineChunk]:
    chunks = _run(engine, _request())
    last = chunks[-1]
    # The prompt asks for a story: 24 tokens end by length, not by EOS, so every
    # resumed run below has tokens left to generate.
    assert last.finished and last.finish_reason == "length"
    assert last.usage is not None and last.usage["completion_tokens"] == N
    return chunks


def _cut_at_word(text: str, fraction: float) -> int:
    """The index of the space nearest below ``fraction`` of ``text``: the delivered
    part ends before a space, as a token boundary of byte-level BPE does (a token
    carries its leading space, so "... the" + " robot" re-encodes to the same tokens,
    while a trailing space would encode as a token of its own)."""
    cut = text.rfind(" ", 0, int(len(text) * fraction))
    assert cut > 0, text
    return cut


@pytest.mark.parametrize("fraction", [0.2, 0.5, 0.8])
def test_greedy_resume_continues_with_exactly_the_rest_of_the_output(
    engine: LlmEngine, original: list[EngineChunk], fraction: float
) -> None:
    full = _text(original)
    cut = _cut_at_word(full, fraction)
    delivered, rest = full[:cut], full[cut:]
    resumed = _run(engine, _request(resume_text=delivered))
    # Greedy decoding from prompt + the re-encoded delivered tokens is the same
    # computation as the uninterrupted run (the re-encoding gives back the same tokens),
    # so the continuation is exact, not merely similar.
    assert _text(resumed) == rest
    last, first_usage = resumed[-1], original[-1].usage
    assert last.finished and last.finish_reason == "length"
    # Usage as if no replica had failed: the client's prompt (not prompt + delivered
    # text), and every completion token, the earlier replica's included.
    assert last.usage == first_usage
    assert last.usage is not None
    assert last.usage["prompt_tokens"] == first_usage["prompt_tokens"]  # type: ignore[index]
    assert last.usage["completion_tokens"] == N


def test_delivered_tokens_count_against_max_tokens(
    engine: LlmEngine, original: list[EngineChunk]
) -> None:
    full = _text(original)
    delivered = full[: _cut_at_word(full, 0.5)]
    prior = len(engine.tokenizer.encode(delivered, add_special_tokens=False))
    steps = engine.progress
    resumed = _run(engine, _request(resume_text=delivered))
    new_tokens = len(engine.tokenizer.encode(_text(resumed), add_special_tokens=False))
    assert prior + new_tokens == N
    # Only the new tokens were decoded (one step each), not the whole answer again.
    assert engine.progress - steps == N - prior


def test_resume_with_every_token_already_delivered_ends_at_once_by_length(
    engine: LlmEngine, original: list[EngineChunk]
) -> None:
    # The failed replica generated all max_tokens but its final message was lost.
    full = _text(original)
    steps = engine.progress
    chunks = _run(engine, _request(resume_text=full))
    assert engine.progress == steps  # nothing was submitted to the model
    (last,) = chunks
    assert (last.text, last.finished, last.finish_reason) == ("", True, "length")
    assert last.usage == original[-1].usage


def test_resume_past_a_smaller_max_tokens_also_ends_at_once(
    engine: LlmEngine, original: list[EngineChunk]
) -> None:
    full = _text(original)
    chunks = _run(engine, _request(resume_text=full, max_tokens=N // 2))
    (last,) = chunks
    assert (last.text, last.finish_reason) == ("", "length")
