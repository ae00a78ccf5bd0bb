"""The head's data sockets: requests out (ROUTER), outputs in (PULL).

Replicas connect a DEALER (routing id = stage.replica.epoch) to the input ROUTER and a
PUSH to the output PULL. ROUTER_MANDATORY turns a send to a vanished replica into an
immediate error instead of a silent drop, so the head learns of a dead peer at once.
Messages travel in batches (see ``zmqio``): one multipart message per peer and tick.
"""

from __future__ import annotations

import asyncio
import logging
import struct
from collections.abc import Hashable
from typing import Protocol

import msgspec
import zmq

from omnistage.control.plane import LISTEN_BACKLOG
from omnistage.logs import Throttled
from omnistage.protocol import codec
from omnistage.protocol.errors import ProtocolError
from omnistage.protocol.messages import OutputChunk, Ready
from omnistage.zmqio import NOBLOCK, Outbox, Pump, send_frames

log = logging.getLogger(__name__)
_bad_input = Throttled(log)
_EVENT = struct.Struct("=hi")  # a monitor event's first frame (zmq_socket_monitor)


class DataEvents(Protocol):
    """What the channels report, on the head's loop."""

    def on_outputs(self, chunks: list[OutputChunk]) -> None: ...

    def on_ready(self, identity: bytes, ready: Ready, fd: int) -> None:
        """``fd``: the descriptor of the connection it came in on (``ZMQ_SRCFD``)."""
        ...

    def on_unreachable(self, identity: bytes) -> None:
        """A send to this routing id failed: its connection is gone."""
        ...

    def on_disconnect(self, fd: int) -> None:
        """The connection on descriptor ``fd`` closed (the event names no peer)."""
        ...


class DataChannels:
    def __init__(self, ctx: zmq.Context, bind_host: str) -> None:
        self.input = ctx.socket(zmq.ROUTER)
        self.input.setsockopt(zmq.ROUTER_MANDATORY, 1)
        # A re-registered replica that reuses an identity takes over the connection.
        self.input.setsockopt(zmq.ROUTER_HANDOVER, 1)
        # A closed connection (a crashed remote replica) shows up as a monitor event;
        # the event names only the connection's descriptor, so the head then probes the
        # replicas it saw on that descriptor (see Ping, dataplane/connections.py).
        self._monitor = self.input.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.input.setsockopt(zmq.LINGER, 0)
        # Deep enough that only a replica that stopped reading fills it.
        self.input.setsockopt(zmq.SNDHWM, 100_000)
        self.input.setsockopt(zmq.MAXMSGSIZE, codec.MAX_MESSAGE_BYTES)
        self.output = ctx.socket(zmq.PULL)
        self.output.setsockopt(zmq.LINGER, 0)
        self.output.setsockopt(zmq.RCVHWM, 100_000)
        self.output.setsockopt(zmq.MAXMSGSIZE, codec.MAX_MESSAGE_BYTES)
        for sock in (self.input, self.output):
            sock.setsockopt(zmq.BACKLOG, LISTEN_BACKLOG)
        in_port = self.input.bind_to_random_port(f"tcp://{bind_host}")
        out_port = self.output.bind_to_random_port(f"tcp://{bind_host}")
        self.input_url = f"tcp://{bind_host}:{in_port}"
        self.output_url = f"tcp://{bind_host}:{out_port}"
        self._output_tag = codec.TAGS[OutputChunk]
        self._output_decoder = msgspec.msgpack.Decoder(OutputChunk)

    def start(self, events: DataEvents) -> None:
        """Start reading and sending on the running loop, reporting to ``events``."""
        loop = asyncio.get_running_loop()
        self._events = events
        self.outbox = Outbox(loop, self._send_batch)
        self._out_pump = Pump(loop, self.output, self._read_outputs)
        # Frames, not bytes: a Ready's says which connection it came in on. (Replicas
        # send nothing else on this socket: no hot path to keep.)
        self._in_pump = Pump(loop, self.input, self._read_inputs, copy=False)
        self._monitor_pump = Pump(loop, self._monitor, self._read_monitor)

    async def stop(self) -> None:
        self.outbox.close()
        self._out_pump.close()
        self._in_pump.close()
        self._monitor_pump.close()
        self.input.disable_monitor()
        self._monitor.close()
        self.input.close()
        self.output.close()

    def post(self, identity: bytes, msg: msgspec.Struct) -> None:
        """Queue a message for one replica; it leaves with this tick's batch."""
        self.outbox.put(identity, msg)

    def connect_replica(self, input_url: str, output_url: str) -> None:
        """For replicas that bind their own sockets: dial them from the shared sockets."""
        self.input.connect(input_url)
        self.output.connect(output_url)

    def disconnect_replica(self, input_url: str, output_url: str) -> None:
        """Stop dialling a replica that bound its own sockets (it is gone or replaced)."""
        for sock, url in ((self.input, input_url), (self.output, output_url)):
            try:
                sock.disconnect(url)
            except zmq.ZMQError:
                pass  # already disconnected

    def _send_batch(self, identity: Hashable, batch: bytes) -> None:
        assert isinstance(identity, bytes)
        try:
            send_frames(self.input, [identity, batch], NOBLOCK)
        except zmq.ZMQError as exc:
            if exc.errno not in (zmq.EHOSTUNREACH, zmq.EAGAIN):
                raise
            # Nobody waits on a flush: report it.
            self._events.on_unreachable(identity)
        finally:
            self._in_pump.kick()

    def _read_outputs(self, frames: list[bytes]) -> None:
        # The hot path: one frame of OutputChunk records, decoded by the bound decoder.
        if len(frames) != 1:
            _bad_input.warning("dropped an output message of %d frames", len(frames))
            return
        try:
            chunks = codec.decode_records(frames[0], self._output_tag, self._output_decoder)
        except ProtocolError as exc:
            _bad_input.warning("dropped a bad output batch: %s", exc)
            return
        self._events.on_outputs(chunks)

    def _read_inputs(self, frames: list[zmq.Frame]) -> None:
        if len(frames) < 2:
            return
        fd = frames[0].get(zmq.SRCFD)
        body = [f.bytes for f in frames[1:]]
        for msg in codec.decode_batch_or_drop(body, _bad_input, "on the input channel"):
            if isinstance(msg, Ready):
                self._events.on_ready(frames[0].bytes, msg, fd)

    def _read_monitor(self, frames: list[bytes]) -> None:
        # The first frame: the event (16 bits) and its value (32 bits: the descriptor).
        if not frames or len(frames[0]) != _EVENT.size:
            _bad_input.warning("dropped a monitor event of an unknown format")
            return
        _event, fd = _EVENT.unpack(frames[0])
        self._events.on_disconnect(fd)
