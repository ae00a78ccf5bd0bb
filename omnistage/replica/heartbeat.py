"""The replica's heartbeat thread.

It has its own socket and thread so a replica whose engine holds the event loop (or the
CPU) still reports in: the head must not mistake busy for dead.

The head answers every heartbeat with a HeartbeatAck. The replica decides the head is
lost, and calls ``on_lost`` once, when the head says it does not know this incarnation
(a restarted head, or a newer registration took the slot), says it is ERROR for a
reason heartbeats do not cure, or has not answered for ``HeartbeatSpec.lost_after_s``,
or when a *new* head answers at the master's address. A head killed and started again
listens on the same -oma:-omp but on new coordinator ports, so beats go nowhere; once
acks are overdue the thread asks the master which head is there (``HeadProbe``, every
half interval while they stay overdue), and a new instance id means register again now:
the replica is back with a restarted head within a second of its start, not after
``lost_after_s``. A head that is only slow answers with the instance we know, and the
replica waits as before. A head whose process died closed our heartbeat connection: a
socket monitor sees that, and once the connection has stayed closed for an interval and
acks are overdue, the head is lost (a dead head's requests are dropped within about two
seconds, not ``lost_after_s``); a slow head keeps its connections, and a network blip
is reconnected within that interval.

A beat carries the prefix keys the engine's cache holds (``Engine.cached_prefixes``)
when they changed since the last beat that carried them, on the first beat of a
registration (a new or restarted head knows nothing), and every ``FULL_EVERY`` beats
regardless: beats go out without blocking and may be dropped, so a change can be lost.
The other beats carry None ("as before") and stay a few dozen bytes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import zmq

from omnistage.protocol import codec
from omnistage.protocol.auth import Signer, Verifier
from omnistage.protocol.errors import ProtocolError
from omnistage.protocol.messages import (
    HandshakeInit,
    HeadProbe,
    HeadProbeReply,
    Heartbeat,
    HeartbeatAck,
    ReplicaState,
)
from omnistage.protocol.prefix import MAX_REPORTED
from omnistage.protocol.registration import RegisterReply
from omnistage.zmqio import monitor_event

log = logging.getLogger(__name__)

# Beats between two that carry the cached prefix keys even if unchanged: at the default
# 1 s interval, a head that missed a change (a dropped beat) catches up within 10 s.
FULL_EVERY = 10

# Acks this many intervals overdue: ask the master which head is there. Acks come
# milliseconds after each beat, so 1.5 intervals of silence is already unusual.
PROBE_AFTER_INTERVALS = 1.5


@dataclass(frozen=True)
class LoadReport:
    queue_length: int
    in_flight: int
    progress: int
    others: int = 0  # requests held for the fleet's other heads


@dataclass(frozen=True)
class HeartbeatSpec:
    """Where one registration (incarnation) of a replica reports in, and how often."""

    address: str  # the head's coordinator
    stage_id: int
    replica_id: int
    epoch: int
    interval_s: float
    # No answer from the head for this long: it is lost.
    lost_after_s: float = 10.0
    # The master we registered with, and the instance id of the head that took us
    # (None / "": no probing while acks are overdue).
    master: str | None = None
    head_instance: str = ""

    @classmethod
    def of(
        cls,
        stage_id: int,
        reply: RegisterReply,
        init: HandshakeInit,
        lost_after_s: float = 10.0,
        master: str | None = None,
    ) -> HeartbeatSpec:
        """For the registration ``reply`` whose handshake answered ``init``."""
        return cls(
            address=init.coordinator_address,
            stage_id=stage_id,
            replica_id=reply.replica_id,
            epoch=reply.epoch,
            interval_s=init.heartbeat_interval_s,
            lost_after_s=lost_after_s,
            master=master,
            head_instance=reply.head_instance or "",
        )


def _up() -> ReplicaState:
    return ReplicaState.UP


def _no_detail() -> str:
    return ""


def _no_prefixes() -> tuple[int, tuple[int, ...]] | None:
    return None


@dataclass(frozen=True)
class Reports:
    """What each heartbeat carries, asked for on the heartbeat thread."""

    load: Callable[[], LoadReport]
    status: Callable[[], ReplicaState] = _up
    # Sent while STARTING only: what the engine is doing (shown by /v1/omni/stages).
    detail: Callable[[], str] = _no_detail
    # The engine's (version, prefix keys) snapshot, or None: see ``Engine.cached_prefixes``.
    cached_prefixes: Callable[[], tuple[int, tuple[int, ...]] | None] = _no_prefixes


def beat(
    spec: HeartbeatSpec, seq: int, status: ReplicaState, load: LoadReport, detail: str = ""
) -> Heartbeat:
    """Heartbeat number ``seq`` of the registration ``spec`` (``detail``: STARTING's)."""
    return Heartbeat(
        stage_id=spec.stage_id,
        replica_id=spec.replica_id,
        epoch=spec.epoch,
        status=status,
        queue_length=load.queue_length,
        in_flight=load.in_flight,
        progress=load.progress,
        seq=seq,
        others=load.others,
        detail=detail,
    )


def ack_verdict(ack: HeartbeatAck) -> tuple[str, bool] | None:
    """Why the head that sent ``ack`` is lost to this registration, and whether the
    replica failed (the ``on_lost`` arguments); None while the head keeps it."""
    if ack.state == ReplicaState.UNKNOWN:
        return "the head does not know this replica (it restarted or replaced us)", False
    if ack.state == ReplicaState.ERROR:
        return "the head marked this replica ERROR and will not route to it", True
    return None


class HeartbeatThread:
    def __init__(
        self,
        ctx: zmq.Context,
        spec: HeartbeatSpec,
        reports: Reports,
        *,
        signer: Signer | None = None,
        verifier: Verifier | None = None,
        on_lost: Callable[[str, bool], None] | None = None,
        on_heads: Callable[[list[str]], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``on_heads``: the fleet's heads, each time an ack's list differs from the
        last one (``HeartbeatAck.heads``)."""
        self._on_heads = on_heads
        self._heads: list[str] = []
        self._ctx = ctx
        self._spec = spec
        self._reports = reports
        self._signer = signer
        self._verifier = verifier
        self._on_lost = on_lost
        self._clock = clock
        self._lost = False
        self.head_instance = ""
        self._kick = threading.Event()
        self._seq = 0
        self._stop = threading.Event()
        self._send_down = True
        # The prefix keys' version the last beat that went out carried, and how many
        # beats ago (None: none yet, so the first beat carries them).
        self._prefixes_sent: int | None = None
        self._beats_since_prefixes = 0
        self._probe: zmq.Socket | None = None  # to the master, once acks are overdue
        # When the heartbeat connection closed and has not come back (None: connected).
        self._closed_at: float | None = None
        self._next_probe = 0.0
        self._poller = zmq.Poller()
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
        monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        self._poller.register(monitor, zmq.POLLIN)
        sock.connect(self._spec.address)
        self._poller.register(sock, zmq.POLLIN)
        self._monitor = monitor
        self._last_ack = self._clock()
        try:
            while True:
                self._beat(sock, self._reports.status())
                self._wait_acks(sock)
                if self._stop.is_set():
                    break
            if self._send_down:
                self._beat(sock, ReplicaState.DOWN)
        finally:
            sock.disable_monitor()
            monitor.close(linger=0)
            # Without a goodbye (leaving a lost head), queued beats must not reach the
            # head later and revive the incarnation we abandoned.
            sock.close(linger=500 if self._send_down else 0)
            if self._probe is not None:
                self._probe.close(linger=0)

    def _wait_acks(self, sock: zmq.Socket) -> None:
        """Until the next beat is due (or a kick): read acks, judge the head."""
        deadline = self._clock() + self._spec.interval_s
        while not self._kick.is_set():
            left = deadline - self._clock()
            if left <= 0:
                break
            self._probe_if_due()
            ready = dict(self._poller.poll(int(min(left, 0.05) * 1000) or 1))
            if sock in ready:
                self._read_ack(sock.recv_multipart())
            if self._monitor in ready:
                self._read_monitor(self._monitor.recv_multipart())
            if self._probe is not None and self._probe in ready:
                self._read_probe_reply(self._probe.recv_multipart())
        self._kick.clear()
        now = self._clock()
        silent = now - self._last_ack
        if silent > self._spec.lost_after_s:
            self._lose(f"no answer from the head for {silent:.1f}s")
        closed = self._closed_at
        if closed is not None and now - closed >= self._spec.interval_s and self._overdue():
            self._lose(f"the head closed its connection {now - closed:.1f}s ago (it died)")

    def _read_monitor(self, frames: list[bytes]) -> None:
        event = monitor_event(frames)
        if event == zmq.EVENT_DISCONNECTED:
            if self._closed_at is None:
                self._closed_at = self._clock()
        elif event == zmq.EVENT_CONNECTED:
            self._closed_at = None

    def _read_ack(self, frames: list[bytes]) -> None:
        try:
            ack = codec.decode_signed(frames, self._verifier, HeartbeatAck)
        except ProtocolError as exc:
            log.warning("ignored a bad heartbeat answer: %s", exc)
            return
        self._last_ack = self._clock()
        self.head_instance = ack.head_instance
        if ack.heads != self._heads:
            self._heads = ack.heads
            if self._on_heads is not None:
                self._on_heads(list(ack.heads))
        if (lost := ack_verdict(ack)) is not None:
            self._lose(*lost)

    def _overdue(self) -> bool:
        silent = self._clock() - self._last_ack
        return silent > PROBE_AFTER_INTERVALS * self._spec.interval_s

    def _probe_if_due(self) -> None:
        spec = self._spec
        if spec.master is None or not spec.head_instance or not self._overdue():
            return
        now = self._clock()
        if now < self._next_probe:
            return
        self._next_probe = now + spec.interval_s / 2
        if self._probe is None:
            self._probe = self._ctx.socket(zmq.DEALER)
            self._probe.setsockopt(zmq.LINGER, 0)
            # Probes to a head that is down queue here; a few are enough.
            self._probe.setsockopt(zmq.SNDHWM, 4)
            self._probe.connect(spec.master)
            self._poller.register(self._probe, zmq.POLLIN)
        probe = HeadProbe(stage_id=spec.stage_id, replica_id=spec.replica_id)
        try:
            self._probe.send_multipart(codec.sign(codec.encode(probe), self._signer), zmq.NOBLOCK)
        except zmq.Again:
            pass  # not connected yet: the next probe tries again

    def _read_probe_reply(self, frames: list[bytes]) -> None:
        try:
            reply = codec.decode_signed(frames, self._verifier, HeadProbeReply)
        except ProtocolError as exc:
            log.warning("ignored a bad head probe answer: %s", exc)
            return
        # A late answer after the acks came back says nothing about the head now.
        if reply.head_instance != self._spec.head_instance and self._overdue():
            self._lose("a new head answers at the master (the head restarted)")

    def _lose(self, why: str, failed: bool = False) -> None:
        if not self._lost and not self._stop.is_set():
            self._lost = True
            if self._on_lost is not None:
                self._on_lost(why, failed)

    def _beat(self, sock: zmq.Socket, status: ReplicaState) -> None:
        try:
            load = self._reports.load()
        except Exception:  # a report must never kill the heartbeat
            log.exception("load report failed")
            load = LoadReport(0, 0, 0)
        self._seq += 1
        detail = self._reports.detail() if status == ReplicaState.STARTING else ""
        msg = beat(self._spec, self._seq, status, load, detail)
        version = None
        if status != ReplicaState.DOWN:
            version, msg.cached_prefixes = self._prefixes_due()
        try:
            sock.send_multipart(codec.sign(codec.encode(msg), self._signer), zmq.NOBLOCK)
        except zmq.Again:
            return  # the head is unreachable right now; the next beat tries again
        if msg.cached_prefixes is not None:
            self._prefixes_sent, self._beats_since_prefixes = version, 0
        else:
            self._beats_since_prefixes += 1

    def _prefixes_due(self) -> tuple[int | None, list[int] | None]:
        """The engine's prefix-key version, and its keys if this beat is to carry them."""
        try:
            snapshot = self._reports.cached_prefixes()
        except Exception:  # a report must never kill the heartbeat
            log.exception("cached prefixes report failed")
            return None, None
        if snapshot is None:
            return None, None
        version, keys = snapshot
        due = (
            self._prefixes_sent is None
            or version != self._prefixes_sent
            or self._beats_since_prefixes + 1 >= FULL_EVERY
        )
        return version, list(keys[:MAX_REPORTED]) if due else None
