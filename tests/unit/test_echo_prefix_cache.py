"""The echo engine's simulated prefix cache: what it keeps and reports, the usage it
writes (characters, the head's unit), the prefill CPU it spends on what it lacks; and
the head's side of a report (the coordinator hands a heartbeat's keys on)."""

from __future__ import annotations

import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from omnistage.config.load import ConfigError, load_config
from omnistage.config.schema import StageConfig
from omnistage.control.coordinator import Coordinator, PrefixReport
from omnistage.control.replica_table import ReplicaTable
from omnistage.engines.base import EngineChunk, EngineRequest, StageInput
from omnistage.engines.echo import EchoEngine, SimulatedPrefixCache
from omnistage.protocol import codec
from omnistage.protocol.messages import ChatMessage, Heartbeat, Prompt, ReplicaState, Usage
from omnistage.protocol.prefix import MAX_REPORTED, prefix_keys, prefix_weights
from tests import params as P
from tests.unit.fakes import FakeClock


def _engine(**engine_args: Any) -> EchoEngine:
    return EchoEngine(
        StageConfig(stage_id=0, name="thinker", engine="echo", engine_args=engine_args)
    )


async def _no_inputs() -> AsyncIterator[StageInput]:
    return
    yield  # pragma: no cover - makes this an async generator


def _chat(*contents: str) -> list[ChatMessage]:
    roles = ["user", "assistant"]
    return [ChatMessage(role=roles[i % 2], content=c) for i, c in enumerate(contents)]


async def _usage(engine: EchoEngine, messages: list[ChatMessage]) -> Usage:
    request = EngineRequest("r", Prompt(messages=messages), P.text(), _no_inputs())
    chunks: list[EngineChunk] = [c async for c in engine.generate(request)]
    assert chunks[-1].usage is not None
    return chunks[-1].usage


async def test_a_later_turn_reads_its_history_from_the_cache():
    engine = _engine(prefix_cache_entries=64)
    first = _chat("hello there")
    assert await _usage(engine, first) == Usage(
        prompt_tokens=prefix_weights(first)[-1], completion_tokens=3, cached_tokens=0
    )
    second = _chat("hello there", "hi! how can I help?", "tell me a joke")
    usage = await _usage(engine, second)
    # The first turn's prompt is cached; the answer is not (an llm engine caches prompts).
    assert usage.prompt_tokens == prefix_weights(second)[-1]
    assert usage.cached_tokens == prefix_weights(first)[-1]


async def test_cached_prefixes_reports_every_prefix_most_recent_first_with_a_version():
    engine = _engine(prefix_cache_entries=64)
    assert engine.cached_prefixes() == (0, ())
    msgs = _chat("a", "b", "c")
    await _usage(engine, msgs)
    version, keys = engine.cached_prefixes() or (0, ())
    assert version == 1
    assert keys == tuple(reversed(prefix_keys(msgs)))
    await _usage(engine, msgs)  # the same prompt again: nothing changed
    assert engine.cached_prefixes() == (1, keys)


def test_the_cache_evicts_least_recently_used_and_reports_at_most_max_reported():
    cache = SimulatedPrefixCache(3)
    cache.add([1, 2])
    cache.add([3])
    cache.add([1])  # 1 used again
    cache.add([4])  # evicts 2, the least recently used
    assert cache.snapshot[1] == (4, 1, 3)
    assert cache.longest([1, 2, 9]) == 0 and cache.longest([7, 8]) == -1
    big = SimulatedPrefixCache(10_000)
    big.add(list(range(2_000)))
    assert len(big.snapshot[1]) == MAX_REPORTED and big.snapshot[1][0] == 1_999


async def test_without_the_cache_an_engine_reports_none_and_usage_counts_words():
    engine = _engine()
    assert engine.cached_prefixes() is None
    usage = await _usage(engine, _chat("three little words"))
    assert usage == Usage(prompt_tokens=3, completion_tokens=4)


async def test_prefill_spends_cpu_only_on_what_the_cache_lacks():
    engine = _engine(prefix_cache_entries=64, prefill_ms_per_char=0.5)
    history = _chat("x" * 400)
    start = time.perf_counter()
    await _usage(engine, history)
    cold = time.perf_counter() - start
    start = time.perf_counter()
    await _usage(engine, history)  # all of it cached
    warm = time.perf_counter() - start
    assert cold >= 0.5 * prefix_weights(history)[-1] / 1000  # burn_cpu waits wall time
    assert warm < cold / 4


async def test_a_prompt_without_messages_is_untouched_by_the_cache():
    engine = _engine(prefix_cache_entries=64, prefill_ms_per_char=1.0)
    request = EngineRequest("r", Prompt(text="plain words here"), P.text(), _no_inputs())
    chunks = [c async for c in engine.generate(request)]
    assert chunks[-1].usage == Usage(prompt_tokens=3, completion_tokens=4)
    assert engine.cached_prefixes() == (0, ())


# -- the head's side -----------------------------------------------------------------------


def _beat(seq: int, keys: list[int] | None, epoch: int = 7) -> list[bytes]:
    hb = Heartbeat(0, 1, epoch, ReplicaState.UP, 0, 0, seq, seq, cached_prefixes=keys)
    return [b"identity", *codec.sign(codec.encode(hb), None)]


def test_the_coordinator_hands_on_a_heartbeats_prefixes_only_when_it_carries_them():
    reports: list[PrefixReport] = []
    table = ReplicaTable(FakeClock(), 5.0)
    coordinator = Coordinator(table, threading.Lock(), lambda t: None, on_prefixes=reports.append)
    coordinator.register((0, 1), 7, "127.0.0.1", True, 60)
    coordinator.ready((0, 1), 7, 4, 1234)
    coordinator.handle(_beat(1, [5, 6]))
    coordinator.handle(_beat(2, None))  # unchanged: nothing to hand on
    coordinator.handle(_beat(3, [], epoch=99))  # no such incarnation
    assert reports == [PrefixReport(0, 1, 7, 1, [5, 6])]


def test_lb_policy_per_stage_is_validated_at_load():
    config = load_config("echo-1stage", '{"0": {"lb_policy": "cache-aware"}}')
    assert config.stages[0].lb_policy == "cache-aware"
    assert load_config("echo-1stage").stages[0].lb_policy is None
    with pytest.raises(ConfigError) as info:
        load_config("echo-1stage", '{"0": {"lb_policy": "fastest"}}')
    assert "stages[0].lb_policy" in str(info.value)
    assert "cache-aware" in str(info.value)
