"""The replica's heartbeat thread.

It has its own socket and thread so a replica whose engine holds the event loop (or the
CPU) still reports in: the head must not mistake busy for dead.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

import zmq

from omnistage.protocol import codec
from omnistage.protocol.auth import Signer
from omnistage.protocol.messages import Heartbeat

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadReport:
    queue_length: int
    in_flight: int
    progress: int


class HeartbeatThread:
    def __init__(
        self,
        ctx: zmq.Context,
        address: str,
        stage_id: int,
        replica_id: int,
        epoch: int,
        interval_s: float,
        report: Callable[[], LoadReport],
        status: Callable[[], str] = lambda: "UP",
        signer: Signer | None = None,
    ) -> None:
        self._signer = signer
        self._ctx = ctx
        self._address = address
        self._key = (stage_id, replica_id, epoch)
        self._interval_s = interval_s
        self._report = report
        self._status = status
        self._kick = threading.Event()
        self._seq = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="omni-heartbeat", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def beat_now(self) -> None:
        """Send a heartbeat at once (e.g. to announce DRAINING without delay)."""
        self._kick.set()

    def stop(self, send_down: bool = True) -> None:
        """Stop beating; with ``send_down`` the last message tells the head we left."""
        self._send_down = send_down
        self._stop.set()
        self._kick.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        sock = self._ctx.socket(zmq.DEALER)
        # A DOWN heartbeat queued at exit still gets a moment to leave.
        sock.setsockopt(zmq.LINGER, 500)
        sock.setsockopt(zmq.SNDHWM, 16)
        sock.connect(self._address)
        try:
            while True:
                self._beat(sock, self._status())
                self._kick.wait(self._interval_s)
                self._kick.clear()
                if self._stop.is_set():
                    break
            if getattr(self, "_send_down", True):
                self._beat(sock, "DOWN")
        finally:
            sock.close()

    def _beat(self, sock: zmq.Socket, status: str) -> None:
        try:
            load = self._report()
        except Exception:  # a report must never kill the heartbeat
            log.exception("load report failed")
            load = LoadReport(0, 0, 0)
        self._seq += 1
        stage_id, replica_id, epoch = self._key
        msg = Heartbeat(
            stage_id=stage_id,
            replica_id=replica_id,
            epoch=epoch,
            status=status,
            queue_length=load.queue_length,
            in_flight=load.in_flight,
            progress=load.progress,
            seq=self._seq,
        )
        try:
            sock.send_multipart(codec.sign(codec.encode(msg), self._signer), zmq.NOBLOCK)
        except zmq.Again:
            pass  # the head is unreachable right now; the next beat tries again
