"""The control-plane thread: registration, handshake and heartbeat sockets.

It runs apart from the head's asyncio loop so that HTTP and request load never delay
heartbeat processing (a starved coordinator would declare healthy replicas dead).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import zmq

log = logging.getLogger(__name__)

Handler = Callable[[list[bytes]], list[bytes] | None]

# Control traffic is small and slow (a heartbeat per replica per second), so each peer
# gets a short queue of small messages: a flood is dropped at the socket, and memory
# stays bounded by peers x _RCVHWM x _MAX_CONTROL_BYTES.
_RCVHWM = 1_000
_MAX_CONTROL_BYTES = 1024 * 1024
# Connections waiting to be accepted on each listening socket (the kernel caps it at
# net.core.somaxconn). libzmq's default of 100 overflows when thousands of replicas
# (re)connect at once, and each dropped connection retries after 1, 3, 7, 15 s.
LISTEN_BACKLOG = 4096


def bind_router(ctx: zmq.Context, url: str) -> tuple[zmq.Socket, str]:
    """Bind a ROUTER (port 0 picks a free one); returns it with its actual endpoint."""
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, _RCVHWM)
    sock.setsockopt(zmq.MAXMSGSIZE, _MAX_CONTROL_BYTES)
    sock.setsockopt(zmq.BACKLOG, LISTEN_BACKLOG)
    if url.endswith(":0"):
        port = sock.bind_to_random_port(url[: -len(":0")])
        return sock, f"{url[: -len(':0')]}:{port}"
    sock.bind(url)
    return sock, url


class ControlPlane:
    def __init__(self, tick: Callable[[], None], tick_interval_s: float = 0.1) -> None:
        self._handlers: list[tuple[zmq.Socket, Handler, int]] = []
        self._tick = tick
        self._tick_interval_s = tick_interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="omni-control", daemon=True)

    def add(self, sock: zmq.Socket, handler: Handler, batch: int = 256) -> None:
        """Attach a bound socket; must be called before ``start``. ``batch``: messages
        served from it before the others get a turn."""
        self._handlers.append((sock, handler, batch))

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        for sock, _, _ in self._handlers:
            sock.close(linger=0)

    def _run(self) -> None:
        poller = zmq.Poller()
        by_socket = {}
        for sock, handler, batch in self._handlers:
            poller.register(sock, zmq.POLLIN)
            by_socket[sock] = (handler, batch)
        timeout_ms = int(self._tick_interval_s * 1000)
        next_tick = time.monotonic()
        while not self._stop.is_set():
            try:
                events = dict(poller.poll(timeout_ms))
            except zmq.ZMQError:
                if self._stop.is_set():
                    return
                raise
            for sock in events:
                self._serve_one(sock, *by_socket[sock])
            if time.monotonic() >= next_tick:
                next_tick = time.monotonic() + self._tick_interval_s
                try:
                    self._tick()
                except Exception:
                    log.exception("control tick failed")

    def _serve_one(self, sock: zmq.Socket, handler: Handler, batch: int) -> None:
        # Drain what is queued, bounded so one busy socket cannot starve the others.
        for _ in range(batch):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                reply = handler(frames)
            except Exception:
                log.exception("control handler failed; message dropped")
                continue
            if reply is not None:
                try:
                    sock.send_multipart(reply, zmq.NOBLOCK)
                except zmq.ZMQError as exc:
                    log.warning("control reply not sent: %s", exc)
