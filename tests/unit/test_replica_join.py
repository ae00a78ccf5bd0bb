"""Joining again after the head was lost: registration retried with backoff (an injected
sleep records the delays), the loaded engine kept unless the head's config changed or
the head failed the replica."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import zmq

from omnistage.config.load import load_config
from omnistage.engines import build_engine
from omnistage.engines.base import Engine
from omnistage.protocol import codec
from omnistage.protocol.messages import HandshakeInit
from omnistage.protocol.registration import ErrorReply, RegisterReply
from omnistage.replica.join import Joiner
from omnistage.replica.options import ReplicaOptions
from tests.unit.test_replica_register import FakeRouter


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


class FakeHead:
    """A master that refuses the first ``refusals`` registrations, and a handshake
    server that answers HELLO with the stage config ``stage``."""

    def __init__(self, ctx: zmq.Context, refusals: int, stage: dict[str, Any]) -> None:
        self.refusals = refusals
        self.registrations = 0
        self._stage = stage
        self._lock = threading.Lock()
        self.handshake = FakeRouter(ctx, self._hello)
        self.master = FakeRouter(ctx, self._register)

    def _register(self, frames: list[bytes]) -> list[bytes]:
        with self._lock:
            self.registrations += 1
            refuse = self.registrations <= self.refusals
        if refuse:
            return [frames[0], codec.encode_register_reply(ErrorReply(error="not yet"))]
        hs = f"tcp://127.0.0.1:{self.handshake.port}"
        reply = RegisterReply(hs, "tcp://127.0.0.1:1", "tcp://127.0.0.1:2", 6, None, 0, 42)
        return [frames[0], codec.encode_register_reply(reply)]

    def _hello(self, frames: list[bytes]) -> list[bytes]:
        init = HandshakeInit(self._stage, "tcp://h:1", "tcp://h:2", "tcp://h:3", 1.0, 10.0)
        return [frames[0], *codec.encode(init)]

    def close(self) -> None:
        self.master.close()
        self.handshake.close()


def _rejoin(ctx: zmq.Context, head: FakeHead, engine: Engine, failed: bool) -> tuple[Any, ...]:
    opts = ReplicaOptions(
        stage_id=0,
        master_host="127.0.0.1",
        master_port=head.master.port,
        advertise_address="127.0.0.1",
        rejoin=True,
        rejoin_backoff_s=(0.5, 1.5),
    )
    delays: list[float] = []

    async def sleep(delay: float) -> None:
        delays.append(delay)

    async def scenario() -> tuple[HandshakeInit, Engine]:
        await engine.start()
        return await Joiner(ctx, opts, None, sleep=sleep).rejoin(engine, failed)

    init, new_engine = asyncio.run(scenario())
    asyncio.run(new_engine.shutdown())
    return init, new_engine, delays


def _stage() -> dict[str, Any]:
    return load_config("echo-1stage").stage(0).model_dump(mode="json")


def test_rejoin_backs_off_and_keeps_the_loaded_engine(ctx: zmq.Context) -> None:
    stage = _stage()
    head = FakeHead(ctx, refusals=3, stage=stage)
    engine = build_engine(load_config("echo-1stage").stage(0))
    try:
        init, again, delays = _rejoin(ctx, head, engine, failed=False)
    finally:
        head.close()
    assert delays == [0.5, 1.0, 1.5]  # doubling, capped at the backoff's upper bound
    assert head.registrations == 4
    assert again is engine and init.stage_config == stage


def test_rejoin_reloads_the_engine_when_the_head_failed_it(ctx: zmq.Context) -> None:
    head = FakeHead(ctx, refusals=0, stage=_stage())
    engine = build_engine(load_config("echo-1stage").stage(0))
    try:
        _, again, delays = _rejoin(ctx, head, engine, failed=True)
    finally:
        head.close()
    assert delays == [] and again is not engine


def test_rejoin_reloads_the_engine_when_the_stage_config_changed(ctx: zmq.Context) -> None:
    stage = _stage()
    changed = {**stage, "engine_args": {**stage["engine_args"], "num_chunks": 7}}
    head = FakeHead(ctx, refusals=0, stage=changed)
    engine = build_engine(load_config("echo-1stage").stage(0))
    try:
        _, again, _ = _rejoin(ctx, head, engine, failed=False)
    finally:
        head.close()
    assert again is not engine and again.stage.engine_args["num_chunks"] == 7
