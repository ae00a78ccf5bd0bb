"""Streamed input through a real head and replica processes (echo pipeline): pieces reach
the source stage while the request runs, a replica killed mid-stream is replaced and the
new one gets all the input (nothing lost or repeated), closing frees the request, and the
API server twin (``RemoteService``) feeds through the head the same way."""

from __future__ import annotations

import asyncio

import pytest

from omnistage.api.remote import RemoteService
from omnistage.config.load import load_config
from omnistage.head.frontends import FrontendServer
from omnistage.head.process import Head
from omnistage.protocol.front import PipelineRequest
from omnistage.protocol.messages import OutputChunk, Prompt
from tests.integration.inproc_head import kill_replica, running_head, until


def _streamed(rid: str, first: str = "") -> PipelineRequest:
    return PipelineRequest(rid, Prompt(text=first), [0], input_streaming=True)


async def _next_text(it: object) -> str:
    chunk = await asyncio.wait_for(anext(it), 10)  # type: ignore[call-overload]
    assert isinstance(chunk, OutputChunk)
    return chunk.text


async def _rest(it: object) -> str:
    return "".join([c.text async for c in it])  # type: ignore[attr-defined]


def _holder(head: Head, rid: str) -> int:
    (handle,) = [h for h in head.pools[0].replicas.values() if rid in h.requests]
    return handle.replica_id


def test_pieces_reach_the_stage_as_they_are_fed() -> None:
    async def scenario() -> None:
        async with running_head(load_config("echo-1stage")) as head:
            stream = await head.service.open(_streamed("s1", "he"))
            it = aiter(stream)
            assert await _next_text(it) == "he"  # the prompt's piece, before any more
            stream.feed(b"llo ")
            assert await _next_text(it) == "llo "
            stream.feed("wörld".encode()[:2])  # a piece that ends inside a character
            stream.feed("wörld".encode()[2:], last=True)
            stream.feed(b"ignored", last=True)  # after the last: ignored
            assert await _rest(it) == "wörld [echo]"
            stream.close()
            stream.feed(b"after close")  # ignored too

            plain = await head.service.open(PipelineRequest("s2", Prompt(text="x"), [0]))
            with pytest.raises(ValueError, match="input_streaming"):
                plain.feed(b"y")
            assert await _rest(aiter(plain)) == "x [echo]"

    asyncio.run(scenario())


def test_a_replica_killed_mid_stream_is_replaced_and_gets_all_the_input() -> None:
    async def scenario() -> None:
        async with running_head(load_config("echo-1stage"), replicas=2) as head:
            stream = await head.service.open(_streamed("k1"))
            it = aiter(stream)
            fed = [f"piece{i} " for i in range(6)]
            for piece in fed[:3]:
                stream.feed(piece.encode())
            # The replica merges what one tick makes: some prefix of the pieces, at once.
            first = await _next_text(it)
            assert first and "".join(fed).startswith(first)
            kill_replica(head, 0, _holder(head, "k1"))
            # Fed while the head finds out and re-dispatches: held, then replayed.
            for piece in fed[3:]:
                stream.feed(piece.encode())
                await asyncio.sleep(0.05)
            stream.feed(b"", last=True)
            text = first + await asyncio.wait_for(_rest(it), 30)
            assert text == "".join(fed) + " [echo]"
            assert head.orchestrator.retried_total == 1

    asyncio.run(scenario())


def test_closing_a_stream_frees_the_request_and_its_input() -> None:
    async def scenario() -> None:
        async with running_head(load_config("echo-1stage")) as head:
            stream = await head.service.open(_streamed("c1", "a"))
            stream.feed(b"b" * 1000)
            it = aiter(stream)
            assert (await _next_text(it)).startswith("a")
            assert head.pools[0].live()[0].in_flight == 1
            await until(lambda: head.coordinator.snapshot()[0].in_flight == 1, 10)
            stream.close()
            assert head.orchestrator.in_flight == 0
            assert head.pools[0].live()[0].in_flight == 0
            # The replica dropped it too (its heartbeats count what it holds).
            await until(lambda: head.coordinator.snapshot()[0].in_flight == 0, 10)

    asyncio.run(scenario())


def test_an_api_server_feeds_through_the_head() -> None:
    async def scenario() -> None:
        config = load_config("echo-1stage")
        async with running_head(config) as head:
            frontends = FrontendServer(head.service)
            frontends.start(asyncio.get_running_loop())
            remote = RemoteService(config, frontends.address, server=1, started_at=0)
            try:
                await remote.start()
                stream = await remote.open(_streamed("r1", "one "))
                it = aiter(stream)
                assert await _next_text(it) == "one "
                stream.feed(b"two ")
                stream.feed(b"three", last=True)
                assert await _rest(it) == "two three [echo]"
                plain = await remote.open(PipelineRequest("r2", Prompt(text="x"), [0]))
                with pytest.raises(ValueError):
                    plain.feed(b"y")
                plain.close()
                await until(lambda: head.orchestrator.in_flight == 0, 5)
            finally:
                await remote.close()
                await frontends.stop()

    asyncio.run(scenario())
