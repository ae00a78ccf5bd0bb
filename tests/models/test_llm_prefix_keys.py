"""The llm engine reports the prefix keys of what its prefix cache really holds (the
real SmolLM2 weights and chat template, in-process): after each turn of a chat, the
keys published are exactly those of the cached entries that end after a client
message, and each such entry holds the tokens of those messages."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

from omnistage.config.schema import StageConfig
from omnistage.engines.base import EngineRequest, StageInput
from omnistage.engines.llm.engine import LlmEngine
from omnistage.engines.llm.prefix_cache import PrefixCache
from omnistage.engines.llm.prompts import token_ids
from omnistage.protocol.messages import ChatMessage, Prompt, Usage
from omnistage.protocol.prefix import prefix_keys
from tests import params as P

pytestmark = pytest.mark.slow


async def _no_inputs() -> AsyncIterator[StageInput]:
    return
    yield  # pragma: no cover


@pytest.fixture(scope="module")
def engine() -> Iterator[LlmEngine]:
    eng = LlmEngine(StageConfig(stage_id=0, name="thinker", engine="llm", engine_args={}))
    asyncio.run(eng.start())
    if eng.backend != "fast":
        asyncio.run(eng.shutdown())
        pytest.skip("only the fast thinker keeps a prefix cache")
    yield eng
    asyncio.run(eng.shutdown())


def _answer(engine: LlmEngine, prompt: Prompt, rid: str) -> str:
    return _answer_usage(engine, prompt, rid, max_tokens=16)[0]


def _answer_usage(
    engine: LlmEngine, prompt: Prompt, rid: str, max_tokens: int
) -> tuple[str, str | None, Usage]:
    """The greedy answer's text, finish reason and usage."""

    async def run() -> tuple[str, str | None, Usage]:
        params = P.text({"temperature": 0, "max_tokens": max_tokens})
        chunks = [
            c async for c in engine.generate(EngineRequest(rid, prompt, params, _no_inputs()))
        ]
        last = chunks[-1]
        reason = last.finish_reason.value if last.finish_reason else None
        return "".join(c.text for c in chunks), reason, last.usage or Usage()

    return asyncio.run(run())


def _cache(engine: LlmEngine) -> PrefixCache:
    assert engine._prefixes is not None
    return engine._prefixes


def _prefix(engine: LlmEngine, turns: list[dict[str, str]]) -> tuple[int, ...]:
    """The chat template's tokens of ``turns``, up to their last end of turn."""
    out = engine.tokenizer.apply_chat_template(turns, tokenize=True, add_generation_prompt=False)
    ids = token_ids(out)
    return tuple(ids[: max(i for i, t in enumerate(ids) if t in engine._eos_ids) + 1])


def _turns(messages: list[ChatMessage]) -> list[dict[str, str]]:
    return [{"role": m.role, "content": m.content} for m in messages]


def _held(engine: LlmEngine, messages: list[ChatMessage]) -> list[int]:
    """The keys of ``messages``' prefixes (the first k) whose exact tokens the cache
    holds (in an entry of their own or a longer one that extends them), checked against
    its entries."""
    covers = _cache(engine)._covers
    keys = prefix_keys(messages)
    return [
        key for k, key in enumerate(keys) if _prefix(engine, _turns(messages[: k + 1])) in covers
    ]


@pytest.fixture
def turns_only(engine: LlmEngine) -> Iterator[PrefixCache]:
    """The engine's cache, cleared, keeping prompts' turns but not answers."""
    cache = _cache(engine)
    cache.clear()
    cache.answers = False
    yield cache
    cache.answers = True


def test_a_chat_reports_the_keys_of_the_prefixes_it_cached(
    engine: LlmEngine, turns_only: PrefixCache
) -> None:
    cache = turns_only
    version, keys = engine.cached_prefixes()  # type: ignore[misc]
    assert keys == ()

    # One turn: only the template's system turn is cut (the question's end leaves too
    # short a tail), and it holds none of the client's messages: nothing to report.
    first = [ChatMessage("user", "What is the capital of France?")]
    reply = _answer(engine, Prompt(messages=first), "t1")
    assert len(cache._entries) == 1
    assert engine.cached_prefixes() == (version, ())

    # Two turns: the first question and the first answer are cut, cached and reported.
    second = [
        *first,
        ChatMessage("assistant", reply),
        ChatMessage("user", "And what is its most famous tower called?"),
    ]
    reply2 = _answer(engine, Prompt(messages=second), "t2")
    k = prefix_keys(second)
    v2, keys = engine.cached_prefixes()  # type: ignore[misc]
    assert v2 > version
    assert _held(engine, second) == [k[0], k[1]]
    assert set(keys) == {k[0], k[1]} and keys[0] == k[1]  # most recently stored first

    # A third turn restores the two-turn prefix and caches the next exchange: its keys
    # come first; a plain text prompt adds none.
    third = [*second, ChatMessage("assistant", reply2), ChatMessage("user", "How tall is it?")]
    _answer(engine, Prompt(messages=third), "t3")
    k = prefix_keys(third)
    _, keys = engine.cached_prefixes()  # type: ignore[misc]
    assert _held(engine, third) == k[:4]
    assert set(keys) == set(k[:4]) and keys[0] == k[3]
    _answer(engine, Prompt(text="Once upon a time"), "t4")
    assert set(engine.cached_prefixes()[1]) == set(k[:4])  # type: ignore[index]


def test_a_stage_system_prompt_holds_no_key(engine: LlmEngine, turns_only: PrefixCache) -> None:
    # The stage's own system prompt replaces the template's: the client's messages
    # still take the keys the head computes from them alone.
    cache = turns_only
    inputs = engine._inputs  # the input step puts the system prompt first
    assert inputs is not None
    args: Any = inputs.args
    inputs.args = args.model_copy(update={"system_prompt": "You answer in one sentence."})
    try:
        chat = [
            ChatMessage("user", "Name a primary color."),
            ChatMessage("assistant", "Red is a primary color."),
            ChatMessage("user", "Name another one, please."),
        ]
        _answer(engine, Prompt(messages=chat), "s1")
    finally:
        inputs.args = args
    k = prefix_keys(chat)
    _, keys = engine.cached_prefixes()  # type: ignore[misc]
    assert set(keys) == {k[0], k[1]}
    system = [{"role": "system", "content": "You answer in one sentence."}]
    for n, key in ((1, k[0]), (2, k[1])):
        ids = _prefix(engine, system + _turns(chat[:n]))
        owner = cache._covers[ids]
        assert owner[: len(ids)] == ids and key in cache._labels[owner]


def test_an_answer_is_kept_and_the_next_turn_starts_from_it(engine: LlmEngine) -> None:
    cache = _cache(engine)
    cache.clear()
    assert cache.answers  # the default
    first = [ChatMessage("user", "What is the capital of France?")]
    reply, reason, _ = _answer_usage(engine, Prompt(messages=first), "a1", max_tokens=64)
    assert reason == "stop", reply  # ended by its end of turn: the whole answer is there
    # The entry holds the prompt and the answer, up to (not with) its end of turn, and
    # takes the key the head computes for the messages with the answer.
    answered = [*first, ChatMessage("assistant", reply)]
    entry = _prefix(engine, _turns(answered))[:-1]
    assert entry in cache._entries and len(cache._entries) == 1  # the system turn inside
    key = prefix_keys(answered)[-1]
    assert cache._labels[entry] == [key]
    assert engine.cached_prefixes()[1][0] == key  # type: ignore[index]

    # The next turn takes all of that from the cache: only its own question is computed.
    second = [*answered, ChatMessage("user", "And what is its most famous tower called?")]
    _, _, usage = _answer_usage(engine, Prompt(messages=second), "a2", max_tokens=8)
    assert usage.cached_tokens == len(entry)

    # Without answers kept, the same turn gets only the turns its own prefill cut.
    cache.clear()
    cache.answers = False
    try:
        _answer_usage(engine, Prompt(messages=first), "a3", max_tokens=64)
        _, _, usage = _answer_usage(engine, Prompt(messages=second), "a4", max_tokens=8)
    finally:
        cache.answers = True
    assert usage.cached_tokens < len(_prefix(engine, _turns(first)))
