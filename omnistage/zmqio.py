"""ZMQ sockets driven from an asyncio loop, without a future per message.

A ``Pump`` watches a plain (sync) socket's FD with ``loop.add_reader`` and drains every
queued message in one callback; an ``Outbox`` collects the messages bound for each peer
during one loop tick and sends them as one frame of records (``codec.pack``). Together
they turn a burst of N chunks into one wake-up and one send instead of N of each, which
is most of the per-message cost in Python.

ZMQ's FD is edge-triggered and shared by reads and writes: after any send, or when a
drain stops early, readable messages may be pending with no new edge. ``kick`` re-checks
ZMQ_EVENTS so no message waits for an edge that will not come.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Hashable
from typing import Any

import msgspec
import zmq
from zmq.utils.monitor import parse_monitor_message

from omnistage.protocol import codec

log = logging.getLogger(__name__)

# Messages handled per callback before yielding the loop to other work.
_DRAIN_BUDGET = 512

# Plain ints: pyzmq's flags are IntFlag members, and combining them per frame (as
# ``send_multipart`` does) builds a new enum member each time, a measurable cost on the
# data plane's hot path.
NOBLOCK = int(zmq.NOBLOCK)
_SNDMORE = int(zmq.SNDMORE)
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)


def send_frames(sock: zmq.Socket, frames: list[bytes], flags: int = 0) -> None:
    """``send_multipart`` for the hot path: one multipart message of ``frames``."""
    more = flags | _SNDMORE
    last = len(frames) - 1
    for i, frame in enumerate(frames):
        sock.send(frame, more if i < last else flags)


def monitor_event(frames: list[bytes]) -> int:
    """The event number of a socket monitor's message (0 for a malformed one)."""
    try:
        return int(parse_monitor_message(frames)["event"])
    except (ValueError, KeyError, TypeError):
        return 0


class Pump:
    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        sock: zmq.Socket,
        on_frames: Callable[[list[Any]], None],
        copy: bool = True,
    ) -> None:
        """``on_frames`` gets each message's frames: bytes, or with ``copy=False``
        ``zmq.Frame``s (which also say which connection they came in on)."""
        self._loop = loop
        self._sock = sock
        self._on_frames = on_frames
        self._copy = copy
        self._fd = sock.getsockopt(zmq.FD)
        self._scheduled = False
        self._closed = False
        loop.add_reader(self._fd, self._drain)
        self.kick()

    def kick(self) -> None:
        """Schedule a drain if messages are waiting (call after sending on the socket)."""
        if self._scheduled or self._closed:
            return
        if self._sock.getsockopt(_EVENTS) & _POLLIN:
            self._scheduled = True
            self._loop.call_soon(self._drain)

    def close(self) -> None:
        self._closed = True
        self._loop.remove_reader(self._fd)

    def _drain(self) -> None:
        self._scheduled = False
        if self._closed:
            return
        sock = self._sock
        for _ in range(_DRAIN_BUDGET):
            # Asking ZMQ_EVENTS first costs a C call; finding the queue empty by a
            # failed receive costs a raised zmq.Again (~10 us), once per wake-up, which
            # at one message per wake-up (a stream at low load) is a tenth of the work.
            # Reading EVENTS also re-arms the edge-triggered FD: when it says nothing
            # is waiting, the next message wakes the reader, so no kick is needed.
            if self._closed or not sock.getsockopt(_EVENTS) & _POLLIN:
                return
            try:
                frames = sock.recv_multipart(NOBLOCK, copy=self._copy)
            except zmq.Again:
                break
            except zmq.ZMQError as exc:
                if self._closed:
                    return
                log.warning("receive failed: %s", exc)
                break
            try:
                self._on_frames(frames)
            except Exception:
                log.exception("message handler failed")
        self.kick()  # the budget ran out (or a receive failed): look again


class Outbox:
    """Per-destination batches, flushed at the end of the current loop tick."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        send: Callable[[Hashable, bytes], None],
    ) -> None:
        self._loop = loop
        self._send = send
        self._pending: dict[Hashable, list[bytes]] = {}
        self._scheduled = False
        self.closed = False

    def close(self) -> None:
        """Send what is queued, then drop anything posted later (the socket is going)."""
        self.flush()
        self.closed = True

    def put(self, dest: Hashable, msg: msgspec.Struct) -> None:
        if self.closed:
            return
        self._pending.setdefault(dest, []).append(codec.pack(msg))
        if not self._scheduled:
            self._scheduled = True
            self._loop.call_soon(self.flush)

    def flush(self) -> None:
        self._scheduled = False
        if self.closed:
            return
        pending, self._pending = self._pending, {}
        for dest, records in pending.items():
            try:
                self._send(dest, b"".join(records))
            except Exception:
                log.exception("batched send failed")
