"""The head's data sockets: requests out (ROUTER), outputs in (PULL).

Replicas connect a DEALER (routing id = stage.replica.epoch) to the input ROUTER and a
PUSH to the output PULL. ROUTER_MANDATORY turns a send to a vanished replica into an
immediate error instead of a silent drop, so the orchestrator can re-route at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

import msgspec
import zmq
import zmq.asyncio

from omnistage.protocol import codec
from omnistage.protocol.errors import ProtocolError
from omnistage.protocol.messages import OutputChunk, Ready

log = logging.getLogger(__name__)


class ReplicaUnreachableError(Exception):
    """The input ROUTER has no connection to this replica identity."""


class DataChannels:
    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        bind_host: str,
        on_output: Callable[[OutputChunk], None],
        on_ready: Callable[[bytes, Ready], None],
    ) -> None:
        self._on_output = on_output
        self._on_ready = on_ready
        self.input = ctx.socket(zmq.ROUTER)
        self.input.setsockopt(zmq.ROUTER_MANDATORY, 1)
        # A re-registered replica that reuses an identity takes over the connection.
        self.input.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self.input.setsockopt(zmq.LINGER, 0)
        # Deep enough that only a replica that stopped reading fills it.
        self.input.setsockopt(zmq.SNDHWM, 100_000)
        self.input.setsockopt(zmq.MAXMSGSIZE, codec.MAX_MESSAGE_BYTES)
        self.output = ctx.socket(zmq.PULL)
        self.output.setsockopt(zmq.LINGER, 0)
        self.output.setsockopt(zmq.MAXMSGSIZE, codec.MAX_MESSAGE_BYTES)
        in_port = self.input.bind_to_random_port(f"tcp://{bind_host}")
        out_port = self.output.bind_to_random_port(f"tcp://{bind_host}")
        self.input_url = f"tcp://{bind_host}:{in_port}"
        self.output_url = f"tcp://{bind_host}:{out_port}"
        self._tasks: list[asyncio.Task[None]] = []
        self._output_decoder = msgspec.msgpack.Decoder(OutputChunk)

    def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._read_outputs(), name="omni-outputs"),
            asyncio.create_task(self._read_inputs(), name="omni-ready"),
        ]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self.input.close()
        self.output.close()

    def send(self, identity: bytes, msg: msgspec.Struct) -> None:
        """Queue a message for one replica; raises ReplicaUnreachableError if it is gone."""
        # With NOBLOCK the asyncio socket tries the send at once and returns a future
        # that is already resolved, so the outcome is known here, synchronously.
        fut = self.input.send_multipart([identity, *codec.encode(msg)], zmq.NOBLOCK)
        exc = fut.exception() if fut.done() else None
        if exc is None:
            return
        if isinstance(exc, zmq.ZMQError) and exc.errno in (zmq.EHOSTUNREACH, zmq.EAGAIN):
            raise ReplicaUnreachableError(identity.decode(errors="replace"))
        raise exc

    def connect_replica(self, input_url: str, output_url: str) -> None:
        """For replicas that bind their own sockets: dial them from the shared sockets."""
        self.input.connect(input_url)
        self.output.connect(output_url)

    async def _read_outputs(self) -> None:
        tag = codec.TAGS[OutputChunk]
        while True:
            frames = await self.output.recv_multipart()
            # The hot path: check the tag, decode with the bound OutputChunk decoder.
            if len(frames) != 2 or frames[0] != tag:
                log.warning("dropped a non-output message on the output channel")
                continue
            try:
                chunk = self._output_decoder.decode(frames[1])
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                log.warning("dropped a bad output chunk: %s", exc)
                continue
            try:
                self._on_output(chunk)
            except Exception:
                log.exception("output handler failed")

    async def _read_inputs(self) -> None:
        while True:
            frames = await self.input.recv_multipart()
            if len(frames) != 3:
                continue
            try:
                msg = codec.decode_frames(frames[1:])
            except ProtocolError as exc:
                log.warning("dropped a bad message on the input channel: %s", exc)
                continue
            if isinstance(msg, Ready):
                try:
                    self._on_ready(frames[0], msg)
                except Exception:
                    log.exception("ready handler failed")
