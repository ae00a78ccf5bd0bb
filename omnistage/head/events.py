"""Replica events as the head handles them: registrations (and dialling replicas that bind
their own sockets), handshakes, READY, state transitions, and lost connections.

Control-thread callbacks (registration, handshake) hand loop work over with
``call_soon_threadsafe``; everything else runs on the head's loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable

import zmq

from omnistage.config.schema import DeployConfig
from omnistage.control.coordinator import PrefixReport
from omnistage.control.replica_table import Transition, routing_id
from omnistage.control.slots import Slot
from omnistage.dataplane.channels import DataChannels
from omnistage.dataplane.connections import Connections
from omnistage.dataplane.orchestrator import Orchestrator
from omnistage.head.history import History
from omnistage.head.options import HeadOptions
from omnistage.head.sockets import HeadSockets
from omnistage.head.state import ControlState
from omnistage.net import tcp_url
from omnistage.protocol.messages import (
    HandshakeInit,
    OutputChunk,
    Ping,
    Ready,
    Reason,
    ReplicaState,
    Shutdown,
)
from omnistage.protocol.registration import RegisterRequest

log = logging.getLogger(__name__)

# When a lost connection's replicas are probed, in seconds after its event, until the
# one whose connection closed is found. ZMQ drops the peer's pipe some steps after the
# event, and the socket takes each step only when the head touches it (a send, a read):
# on a busy host three probes in 0.5 s were not always enough. A replica's READY may
# also come in after the event. Each probe costs a message to one or two replicas.
PROBE_AFTER_S = (0.0, 0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.7, 1.0, 1.5, 2.0, 3.0)


class DialIns:
    """Replicas that bind their own sockets, which the head dials: (stage, replica) ->
    the handshake, input and output endpoints. Shared by the control thread and loop."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._urls: dict[tuple[int, int], tuple[str, str, str]] = {}

    def replace(
        self, key: tuple[int, int], urls: tuple[str, str, str] | None
    ) -> tuple[str, str, str] | None:
        """Record the slot's new endpoints (None: it dials in itself); return the old."""
        with self._lock:
            old = self._urls.pop(key, None)
            if urls is not None:
                self._urls[key] = urls
            return old

    def get(self, key: tuple[int, int]) -> tuple[str, str, str] | None:
        with self._lock:
            return self._urls.get(key)


class ReplicaEvents:
    def __init__(
        self,
        opts: HeadOptions,
        sockets: HeadSockets,
        state: ControlState,
        orchestrator: Orchestrator,
        *,
        history: History,
        on_serving: Callable[[], None],
        heads: Callable[[], list[str]] = list,
    ) -> None:
        """``on_serving``: called on the loop each time a replica comes UP; ``heads``:
        the fleet's heads, for the handshake (``HandshakeInit.heads``)."""
        self._heads = heads
        self._history = history
        self._opts = opts
        self._config: DeployConfig = opts.config
        self._addresses = sockets.addresses
        self._handshake_sock = sockets.handshake
        self._channels: DataChannels = sockets.channels
        self._slots = state.slots
        self._lock = state.lock
        self._coordinator = state.coordinator
        self._pools = orchestrator.pools
        self._orchestrator = orchestrator
        self._on_serving = on_serving
        self._dialled = DialIns()
        self.connections = Connections()  # the input ROUTER's, by descriptor
        self._loop: asyncio.AbstractEventLoop | None = None

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Bind to the head's loop before any event can arrive."""
        self._loop = loop

    def _call_soon(self, fn: Callable[..., object], *args: object) -> None:
        assert self._loop is not None
        self._loop.call_soon_threadsafe(fn, *args)

    # -- control thread --------------------------------------------------------------

    def on_register(self, slot: Slot, req: RegisterRequest) -> None:
        """A replica registered; it is STARTING until READY."""
        key = (slot.stage_id, slot.replica_id)
        self._coordinator.register(
            key,
            slot.epoch,
            req.replica_bind_address or "",
            slot.head_local,
            self._opts.stage_init_timeout_s,
        )
        urls = None
        if slot.binds_sockets and slot.replica_ports and slot.bind_address:
            a, b, c = (tcp_url(slot.bind_address, port) for port in slot.replica_ports)
            urls = (a, b, c)
        stale = self._dialled.replace(key, urls)
        if stale is not None:
            # The slot's previous incarnation bound its own sockets: stop redialling them.
            with contextlib.suppress(zmq.ZMQError):
                self._handshake_sock.disconnect(stale[0])
            self._call_soon(self._channels.disconnect_replica, stale[1], stale[2])
        if urls is not None:
            # The handshake socket belongs to this (control) thread; the data sockets
            # to the loop.
            self._handshake_sock.connect(urls[0])
            self._call_soon(self._channels.connect_replica, urls[1], urls[2])

    def on_moved(self, stage_id: int, replica_id: int, epoch: int) -> None:
        """Control thread: a replica registered again under another id (its id was
        another replica's at another head): its old slot is DOWN now, and what it held
        there is dispatched again."""
        self._coordinator.mark((stage_id, replica_id), epoch, ReplicaState.DOWN, Reason.MOVED)

    def init_for(self, stage_id: int) -> HandshakeInit:
        """What a replica of ``stage_id`` needs to serve."""
        return HandshakeInit(
            stage_config=self._config.stage(stage_id).model_dump(mode="json"),
            input_address=self._addresses.input,
            output_address=self._addresses.output,
            coordinator_address=self._addresses.coordinator,
            heartbeat_interval_s=self._opts.heartbeat_interval_s,
            stage_init_timeout_s=self._opts.stage_init_timeout_s,
            heartbeat_timeout_s=self._opts.heartbeat_timeout_s,
            heads=self._heads(),
        )

    def post_transition(self, t: Transition) -> None:
        """From the control thread, launcher threads or the loop itself."""
        self._call_soon(self._on_transition, t)

    def post_prefixes(self, report: PrefixReport) -> None:
        """From the control thread: a heartbeat's prefix cache contents, for the stage's
        pool (which keeps them only with the cache-aware policy)."""
        pool = self._pools.get(report.stage_id)
        if pool is not None and pool.prefixes is not None:
            self._call_soon(
                pool.report_prefixes, report.replica_id, report.epoch, report.seq, report.keys
            )

    # -- the loop (DataEvents) -------------------------------------------------------

    def on_outputs(self, chunks: list[OutputChunk]) -> None:
        self._orchestrator.on_outputs(chunks)

    def on_ready(self, identity: bytes, ready: Ready, fd: int) -> None:
        if identity != routing_id(ready.stage_id, ready.replica_id, ready.epoch):
            log.warning("READY with a mismatched routing id %r dropped", identity)
            return
        key = (ready.stage_id, ready.replica_id)
        ok = self._coordinator.ready(
            key,
            ready.epoch,
            ready.capacity,
            ready.pid,
            ready.peer_address,
            ready.kernel,
            ready.host_key,
        )
        if not ok:
            log.warning(
                "READY from stage %d replica %d epoch %d ignored (not a current registration)",
                ready.stage_id,
                ready.replica_id,
                ready.epoch,
            )
            self._channels.post(identity, Shutdown("stale registration"))
            return
        self.connections.seen(fd, identity, key)

    def on_unreachable(self, identity: bytes) -> None:
        try:
            stage_id, replica_id, epoch = (int(p) for p in identity.split(b"."))
        except ValueError:
            return
        self.connections.forget(identity)
        key = (stage_id, replica_id)
        self._coordinator.mark(key, epoch, ReplicaState.ERROR, Reason.UNREACHABLE)

    def on_disconnect(self, fd: int) -> None:
        """Find which replica's connection closed by probing those seen on its
        descriptor (``Connections``), now and again shortly."""
        self._probe(fd, 0)

    def _probe(self, fd: int, step: int) -> None:
        """A Ping to each suspect: the send to a vanished one fails (``on_unreachable``).
        Again at the next step while one seen on ``fd`` is still there."""
        assert self._loop is not None
        suspects = self.connections.suspects(fd)
        for identity in suspects:
            self._channels.post(identity, Ping())
        if suspects:
            self._channels.outbox.flush()
        # Through the first half second even with nobody placed on it: a READY read
        # after the event places its replica there.
        more = self.connections.placed_on(fd) or PROBE_AFTER_S[step] < 0.5
        if step + 1 < len(PROBE_AFTER_S) and more:
            delay = PROBE_AFTER_S[step + 1] - PROBE_AFTER_S[step]
            self._loop.call_later(delay, self._probe, fd, step + 1)
        else:
            self.connections.settled(fd)

    def _on_transition(self, t: Transition) -> None:
        self._history.changed(t)
        self._orchestrator.on_transition(t)
        e = t.entry
        if t.new == ReplicaState.ERROR:
            with self._lock:  # proven dead: its id may be taken over
                self._slots.fence(e.stage_id, e.replica_id, e.epoch)
        if t.new == ReplicaState.DOWN:
            self.connections.forget(e.identity)
            with self._lock:
                self._slots.release(e.stage_id, e.replica_id, e.epoch)
            gone = self._dialled.get((e.stage_id, e.replica_id))
            if gone is not None:
                # It left for good: stop redialling its data sockets. (Its handshake
                # endpoint, owned by the control thread, goes when the slot is reused.)
                self._channels.disconnect_replica(gone[1], gone[2])
        if t.new == ReplicaState.UP:
            self._on_serving()
