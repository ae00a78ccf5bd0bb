"""The echo engine: deterministic chunks derived from its input."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator
from typing import Any

import pytest

from omnistage.config.schema import StageConfig
from omnistage.engines import build_engine, echo_tensors
from omnistage.engines.base import EngineChunk, EngineRequest, StageInput, stage_input
from omnistage.engines.echo import EchoEngine, split_even
from omnistage.protocol.errors import EngineError
from omnistage.protocol.messages import ChatMessage, Prompt, Usage
from tests import params as P


def stage(name: str = "talker", **engine_args: Any) -> StageConfig:
    return StageConfig(stage_id=1, name=name, engine="echo", engine_args=engine_args)


async def no_inputs() -> AsyncIterator[StageInput]:
    return
    yield  # pragma: no cover - makes this an async generator


async def inputs_of(*texts: str) -> AsyncIterator[StageInput]:
    for text in texts:
        yield stage_input(0, text)


def source_request(text: str) -> EngineRequest:
    return EngineRequest("req-1", Prompt(text=text), P.text(), no_inputs())


def downstream_request(*texts: str) -> EngineRequest:
    return EngineRequest("req-2", None, P.text(), inputs_of(*texts))


async def collect(engine: EchoEngine, request: EngineRequest) -> list[EngineChunk]:
    return [chunk async for chunk in engine.generate(request)]


async def test_source_request_yields_num_chunks_the_last_one_finished():
    engine = EchoEngine(stage("talker", num_chunks=3))
    chunks = await collect(engine, source_request("hello there world"))
    body, last = chunks[:-1], chunks[-1]
    assert len(chunks) == 3
    assert all(c.text for c in chunks)
    assert not any(c.finished for c in body)
    assert "".join(c.text for c in chunks) == "hello there world [talker]"
    assert last.finished is True
    assert last.finish_reason == "stop"
    assert last.usage == Usage(prompt_tokens=3, completion_tokens=4)


async def test_source_request_reads_last_user_message_from_chat():
    engine = EchoEngine(stage("thinker", num_chunks=2))
    prompt = Prompt(
        messages=[
            ChatMessage("user", "first"),
            ChatMessage("assistant", "reply"),
            ChatMessage("user", "second"),
        ]
    )
    chunks = await collect(engine, EngineRequest("r", prompt, P.text(), no_inputs()))
    assert "".join(c.text for c in chunks) == "second [thinker]"


async def test_custom_suffix_replaces_stage_name():
    engine = EchoEngine(stage("talker", num_chunks=1, suffix="!"))
    chunks = await collect(engine, source_request("hi"))
    assert [c.text for c in chunks] == ["hi!"]
    assert chunks[0].finished


async def test_chunks_carry_stage_output_modality():
    config = StageConfig(
        stage_id=0, name="voice", engine="echo", output_modality="audio", engine_args={}
    )
    chunks = await collect(EchoEngine(config), source_request("x"))
    assert {c.modality for c in chunks} == {"audio"}


async def test_downstream_request_passes_inputs_through_in_order_then_suffix():
    engine = EchoEngine(stage("vocoder"))
    chunks = await collect(engine, downstream_request("alpha ", "beta ", "gamma"))
    assert [c.text for c in chunks] == ["alpha ", "beta ", "gamma", " [vocoder]"]
    assert not any(c.finished for c in chunks[:-1])
    last = chunks[-1]
    assert last.finished and last.finish_reason == "stop"
    assert last.usage == Usage(prompt_tokens=3, completion_tokens=4)


async def test_downstream_request_skips_empty_input_chunks():
    engine = EchoEngine(stage("vocoder"))
    chunks = await collect(engine, downstream_request("a", "", "b"))
    assert [c.text for c in chunks] == ["a", "b", " [vocoder]"]


async def test_downstream_request_with_no_inputs_yields_only_suffix():
    engine = EchoEngine(stage("vocoder"))
    chunks = await collect(engine, EngineRequest("r", None, P.text(), no_inputs()))
    assert [c.text for c in chunks] == [" [vocoder]"]
    assert chunks[0].finished
    assert chunks[-1].usage == Usage(prompt_tokens=0, completion_tokens=1)


async def test_fail_on_marker_in_prompt_raises_engine_error():
    engine = EchoEngine(stage("talker", fail_on="BOOM"))
    with pytest.raises(EngineError, match="talker"):
        await collect(engine, source_request("please BOOM now"))


async def test_fail_on_marker_in_upstream_input_raises_after_earlier_chunks():
    engine = EchoEngine(stage("talker", fail_on="BOOM"))
    seen: list[str] = []
    with pytest.raises(EngineError):
        async for chunk in engine.generate(downstream_request("ok ", "BOOM", "never")):
            seen.append(chunk.text)
    assert seen == ["ok "]


async def test_fail_on_does_not_trigger_without_the_marker():
    engine = EchoEngine(stage("talker", fail_on="BOOM"))
    chunks = await collect(engine, source_request("boom in lower case"))
    assert chunks[-1].finished


async def test_progress_increases_with_each_chunk_of_work():
    engine = EchoEngine(stage("talker", num_chunks=4))
    assert engine.progress == 0
    await collect(engine, source_request("some longer text"))
    assert engine.progress == 4
    await collect(engine, downstream_request("a", "b"))
    assert engine.progress == 4 + 3  # two inputs plus the suffix


def test_build_engine_returns_echo_engine_with_validated_args():
    engine = build_engine(stage("talker", num_chunks=7))
    assert isinstance(engine, EchoEngine)
    assert engine.args.num_chunks == 7
    assert engine.suffix == " [talker]"
    assert engine.name == "echo"


# -- split_even --------------------------------------------------------------------------


def test_split_even_examples():
    assert split_even("abcdefghij", 3) == ["abcd", "efg", "hij"]
    assert split_even("abc", 5) == ["a", "b", "c"]
    assert split_even("abc", 1) == ["abc"]
    assert split_even("", 4) == [""]


def test_split_even_properties_over_random_inputs():
    rng = random.Random(17)
    for _ in range(500):
        text = "".join(rng.choice("ab c") for _ in range(rng.randrange(1, 60)))
        n = rng.randrange(1, 20)
        pieces = split_even(text, n)
        assert "".join(pieces) == text
        assert 1 <= len(pieces) <= n
        assert all(pieces)
        lengths = [len(p) for p in pieces]
        assert max(lengths) - min(lengths) <= 1
        assert len(pieces) == min(n, len(text))


def test_split_even_treats_non_positive_parts_as_one():
    assert split_even("abc", 0) == ["abc"]


async def test_a_source_with_tensor_bytes_sends_a_tensor_before_each_text_chunk():
    engine = EchoEngine(stage("thinker", num_chunks=3, tensor_bytes=100))
    chunks = await collect(engine, source_request("hello there world"))
    assert [bool(c.data) for c in chunks] == [True, False] * 3
    assert [c.meta.shape for c in chunks if c.data] == [(100,)] * 3
    assert chunks[-1].finished and not chunks[-1].data


async def test_a_stage_that_checks_tensors_says_what_it_read():
    source = EchoEngine(stage("thinker", num_chunks=5, tensor_bytes=300))
    made = await collect(source, source_request("hello there world"))

    async def upstream() -> AsyncIterator[StageInput]:
        for chunk in made:
            yield stage_input(0, chunk.text, data=chunk.data, meta=chunk.meta)

    sink = EchoEngine(stage("talker", check_tensors=True))
    text = "".join(
        c.text for c in await collect(sink, EngineRequest("r", None, P.text(), upstream()))
    )
    found = echo_tensors.parse(text)
    assert found is not None and found["ordered"] == "yes"
    assert (found["n"], found["bytes"], found["crc"]) == echo_tensors.expected(5, 300)
    assert text.startswith("hello there world [thinker] [talker] [tensors n=5")


def test_tensor_bytes_leave_room_for_the_header():
    with pytest.raises(ValueError, match="at least 16"):
        stage(tensor_bytes=8)
