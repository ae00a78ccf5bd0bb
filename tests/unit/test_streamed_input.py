"""Streamed input, the pure parts: the head's buffer and its replay on a retry (a real
Orchestrator, messages recorded instead of sent, as in test_orchestrator_retry), the
replica's in-order intake, and joining pieces for engines that read whole prompts."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from omnistage.dataplane.streamed import StreamedInput
from omnistage.engines.base import joined_prompt
from omnistage.protocol.front import PipelineRequest
from omnistage.protocol.messages import Abort, InputChunk, Prompt, Resume
from omnistage.replica.streamed import InputPieces, prompt_piece
from tests.unit.test_orchestrator_retry import Head, add, ident

FIRST = Prompt(text="he")


def test_the_buffer_numbers_pieces_and_marks_only_the_last() -> None:
    buf = StreamedInput("r1")
    assert buf.append(b"a", False) == 0
    assert buf.append(b"b", False) == 1
    assert buf.chunk(1, 0) == InputChunk("r1", 0, 1, b"b", False)
    assert buf.append(b"", True) == 2
    assert buf.append(b"late", True) is None  # after the last: ignored
    assert buf.replay(3) == [
        InputChunk("r1", 3, 0, b"a", False),
        InputChunk("r1", 3, 1, b"b", False),
        InputChunk("r1", 3, 2, b"", True),
    ]
    assert buf.held_bytes == 2


async def test_pieces_go_to_the_source_replica_and_all_of_them_to_its_replacement() -> None:
    head = Head("echo-1stage", {0: 2})
    request = PipelineRequest("r1", FIRST, [0], input_streaming=True)
    stream = await head.orch.open(request)
    first = head.replica_of(0)
    other = 1 - first
    assert head.channels.take() == [(ident(0, first), add([], None, FIRST, input_streaming=True))]
    stream.feed(b"l")
    stream.feed(b"l")
    assert head.channels.take() == [
        (ident(0, first), InputChunk("r1", 0, 0, b"l")),
        (ident(0, first), InputChunk("r1", 0, 1, b"l")),
    ]

    head.fail(0, first)
    # The replacement gets the request and every piece so far, as the new attempt.
    assert head.channels.take() == [
        (ident(0, first), Abort("r1")),
        (ident(0, other), add([], Resume("", 0, 0), FIRST, attempt=1, input_streaming=True)),
        (ident(0, other), InputChunk("r1", 1, 0, b"l")),
        (ident(0, other), InputChunk("r1", 1, 1, b"l")),
    ]
    # Then the rest, to it alone.
    stream.feed(b"o", last=True)
    stream.feed(b"ignored")
    assert head.channels.take() == [(ident(0, other), InputChunk("r1", 1, 2, b"o", True))]

    stream.close()
    assert head.channels.take() == [(ident(0, other), Abort("r1"))]
    stream.feed(b"after close")
    assert head.channels.take() == []
    assert head.slots_in_use() == 0


async def test_a_retry_waiting_for_a_replica_gets_what_was_fed_meanwhile() -> None:
    head = Head("echo-1stage", {0: 1}, no_replica_wait_s=5.0)
    stream = await head.orch.open(PipelineRequest("r1", FIRST, [0], input_streaming=True))
    stream.feed(b"a")
    head.fail(0, 0)
    head.channels.take()
    stream.feed(b"b")  # no replica: held
    stream.feed(b"c", last=True)
    assert head.channels.take() == []
    head.up(0, 1)
    for _ in range(5):
        await asyncio.sleep(0)
    sent = [msg for _, msg in head.channels.take() if isinstance(msg, InputChunk)]
    assert [(c.seq, c.data, c.last, c.attempt) for c in sent] == [
        (0, b"a", False, 1),
        (1, b"b", False, 1),
        (2, b"c", True, 1),
    ]
    stream.close()


async def test_feeding_a_request_that_does_not_stream_its_input_is_an_error() -> None:
    head = Head("echo-1stage", {0: 1})
    stream = await head.orch.open(PipelineRequest("r1", FIRST, [0]))
    with pytest.raises(ValueError, match="input_streaming"):
        stream.feed(b"x")
    stream.close()


async def _read(pieces: InputPieces) -> list[bytes]:
    return [p async for p in pieces.read()]


async def test_the_replica_takes_each_next_piece_once_and_ends_at_the_last() -> None:
    pieces = InputPieces(b"first")
    pieces.take(InputChunk("r1", 0, 0, b"a"))
    pieces.take(InputChunk("r1", 0, 0, b"a"))  # a repeat
    pieces.take(InputChunk("r1", 0, 2, b"c"))  # a gap: dropped, never out of order
    pieces.take(InputChunk("r1", 0, 1, b"b"))
    pieces.take(InputChunk("r1", 0, 2, b"", last=True))
    pieces.take(InputChunk("r1", 0, 3, b"late"))
    assert await asyncio.wait_for(_read(pieces), 1) == [b"first", b"a", b"b"]


async def _of(*pieces: bytes) -> AsyncIterator[bytes]:
    for piece in pieces:
        yield piece


async def test_pieces_are_joined_into_the_prompt_for_engines_that_read_it_whole() -> None:
    audio = Prompt(audio=b"", audio_format="pcm16", sample_rate=24000)
    assert prompt_piece(audio) == b""
    joined = await joined_prompt(audio, _of(b"\x01\x00", b"\x02\x00"))
    assert joined == Prompt(audio=b"\x01\x00\x02\x00", audio_format="pcm16", sample_rate=24000)
    text = Prompt(text="hé")
    assert prompt_piece(text) == "hé".encode()
    word = "wörld".encode()
    assert (await joined_prompt(text, _of(b"h\xc3\xa9 ", word[:2], word[2:]))).text == "hé wörld"


async def test_only_stages_that_hear_the_streamed_audio_get_its_pieces() -> None:
    # voice: listener (2) -> thinker (0); the thinker is given the prompt (it reads text
    # itself) but not the streamed audio, which only the listener hears.
    head = Head("voice", {0: 1, 1: 1, 2: 1})
    first = Prompt(audio=b"", audio_format="pcm16", sample_rate=24000)
    request = PipelineRequest("r1", first, [0], input_streaming=True)
    stream = await head.orch.open(request)
    adds = {ident_: msg for ident_, msg in head.channels.take()}
    assert adds[ident(2, 0)].input_streaming and adds[ident(2, 0)].prompt == first
    assert not adds[ident(0, 0)].input_streaming
    stream.feed(b"\x01\x00", last=True)
    assert head.channels.take() == [(ident(2, 0), InputChunk("r1", 0, 0, b"\x01\x00", True))]
    stream.close()
