"""The loop's ZMQ pump on real sockets: every message arrives, in order, whether it comes
in a burst, after the pump found the queue empty (ZMQ's FD is edge-triggered: a drain
that stops without re-arming it would wait forever), beyond one callback's budget, or
while the handler itself sends on the same socket."""

from __future__ import annotations

import asyncio

import pytest
import zmq

from omnistage.zmqio import _DRAIN_BUDGET, Pump


@pytest.fixture
def pair():  # type: ignore[no-untyped-def]
    ctx = zmq.Context()
    a, b = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
    a.bind("inproc://pump")
    b.connect("inproc://pump")
    yield a, b
    a.close(0)
    b.close(0)
    ctx.term()


async def _until(cond, timeout: float = 2.0) -> None:  # type: ignore[no-untyped-def]
    async with asyncio.timeout(timeout):
        while not cond():
            await asyncio.sleep(0.001)


async def test_bursts_and_single_messages_after_an_empty_queue_all_arrive(pair) -> None:  # type: ignore[no-untyped-def]
    a, b = pair
    got: list[bytes] = []
    pump = Pump(asyncio.get_running_loop(), a, lambda frames: got.extend(frames))
    try:
        for i in range(10):
            b.send(b"burst-%d" % i)
        await _until(lambda: len(got) == 10)
        # One at a time, each after the pump has found the queue empty: each must wake it.
        for i in range(20):
            b.send(b"one-%d" % i)
            await _until(lambda i=i: len(got) == 11 + i)
        assert got == [b"burst-%d" % i for i in range(10)] + [b"one-%d" % i for i in range(20)]
    finally:
        pump.close()


async def test_more_than_one_callbacks_budget_is_drained_without_a_new_message(pair) -> None:  # type: ignore[no-untyped-def]
    a, b = pair
    got: list[bytes] = []
    n = 3 * _DRAIN_BUDGET + 7
    for i in range(n):  # all queued before the pump exists: one edge, if any
        b.send(b"%d" % i)
    pump = Pump(asyncio.get_running_loop(), a, lambda frames: got.extend(frames))
    try:
        await _until(lambda: len(got) == n)
        assert got == [b"%d" % i for i in range(n)]
    finally:
        pump.close()


async def test_a_handler_that_answers_on_the_same_socket_misses_nothing(pair) -> None:  # type: ignore[no-untyped-def]
    # A send on a socket can take in its pending input without an FD edge; the pump must
    # still see what came in meanwhile.
    a, b = pair
    got: list[bytes] = []

    def answer(frames: list[bytes]) -> None:
        got.extend(frames)
        a.send(b"ack-" + frames[0])

    pump = Pump(asyncio.get_running_loop(), a, answer)
    try:
        for i in range(200):
            b.send(b"%d" % i)
            if i % 7 == 0:
                await asyncio.sleep(0)
        await _until(lambda: len(got) == 200)
        acks = []
        while b.poll(100):
            acks.append(b.recv())
        assert got == [b"%d" % i for i in range(200)]
        assert acks == [b"ack-%d" % i for i in range(200)]
    finally:
        pump.close()
