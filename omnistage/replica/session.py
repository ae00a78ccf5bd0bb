"""A replica's connection to one head: the data sockets, the peer sockets, the heartbeat.

Opened once the engine is loaded (it sends READY), closed when the replica stops or
leaves that head to look for another. Inbound messages go to the request runner;
outbound chunks come from it through the ``Outlet`` methods.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable

import msgspec
import zmq

from omnistage.connectors.registry import Connectors
from omnistage.connectors.shm import host_key
from omnistage.logs import Throttled
from omnistage.net import tcp_url
from omnistage.protocol import codec
from omnistage.protocol.auth import Signer, Verifier
from omnistage.protocol.errors import ProtocolError
from omnistage.protocol.messages import (
    HandshakeInit,
    OutputChunk,
    PeerConnector,
    Ready,
    ReplicaState,
    routing_id,
)
from omnistage.protocol.registration import RegisterReply
from omnistage.replica.heartbeat import HeartbeatSpec, HeartbeatThread, LoadReport, Reports
from omnistage.replica.options import ReplicaOptions
from omnistage.replica.requests import RequestRunner
from omnistage.zmqio import NOBLOCK, Pump

log = logging.getLogger(__name__)
_bad_input = Throttled(log)

# A peer that stopped reading gets this many messages queued, then ours are dropped:
# the head notices that replica's failure and runs the request again elsewhere.
_PEER_HWM = 10_000
# A socket to a peer we have not pushed to for this long is closed.
_PEER_IDLE_S = 60.0
# How often what the connectors hold for replicas that died is looked for.
_CONNECTOR_PRUNE_S = 2.0


class HeadSession:
    def __init__(
        self,
        ctx: zmq.Context,
        opts: ReplicaOptions,
        runner: RequestRunner,
        reply: RegisterReply,
        init: HandshakeInit,
        address: str,
        master: str | None = None,
    ) -> None:
        """``reply`` and ``init``: this head's registration and handshake answers;
        ``address``: the host this replica advertised to it; ``master``: that head's
        master URL (default: -oma/-omp)."""
        self._ctx = ctx
        self._runner = runner
        self._reply = reply
        self._init = init
        self._address = address
        self._binds_sockets = opts.binds_sockets
        self._master = master or tcp_url(opts.master_host, opts.master_port)
        # Peers need their own CURVE server keys, which replicas do not hold: with CURVE
        # on, every input comes through the head.
        self._peers_enabled = not opts.curve_keys
        self._peer_in: zmq.Socket | None = None
        # Downstream replicas we push to: address -> (socket, when last used).
        self._peer_out: dict[str, tuple[zmq.Socket, float]] = {}
        self._peers_pruned = time.monotonic()
        # Tensor payloads to and from peers that do not travel inline (shared memory).
        self._connectors = Connectors()
        self._prune_timer: asyncio.TimerHandle | None = None
        self._output_tag = codec.TAGS[OutputChunk]
        self._output_decoder = msgspec.msgpack.Decoder(OutputChunk)
        self.heartbeat: HeartbeatThread | None = None

    def open(
        self,
        loop: asyncio.AbstractEventLoop,
        status: Callable[[], ReplicaState],
        on_lost: Callable[[str, bool], None],
        *,
        signer: Signer | None = None,
        verifier: Verifier | None = None,
        on_heads: Callable[[list[str]], None] | None = None,
    ) -> None:
        """Connect (or bind), say READY, start reading and heartbeating; ``on_heads``
        (heartbeat thread) hears the fleet's heads when this head's list changes."""
        reply, init, runner = self._reply, self._init, self._runner
        stage_id = runner.stage_id
        self._in, self._out = data_sockets(self._ctx, stage_id, reply, init, self._binds_sockets)
        peer_address = self._listen_for_peers() if self._peers_enabled else ""
        runner.bind(reply.replica_id, reply.epoch, self)
        self.heartbeat = HeartbeatThread(
            self._ctx,
            HeartbeatSpec.of(
                stage_id,
                reply,
                init,
                lost_after_s=2 * init.heartbeat_timeout_s,
                master=self._master,
            ),
            Reports(
                load=lambda: load_report(runner),
                status=status,
                cached_prefixes=runner.engine.cached_prefixes,
            ),
            signer=signer,
            verifier=verifier,
            on_lost=on_lost,
            on_heads=on_heads,
        )
        self._in.send(codec.pack(ready(runner, reply, self._address, peer_address)))
        self._pump = Pump(loop, self._in, self._on_frames)
        self._peer_pump = Pump(loop, self._peer_in, self._on_peer_frames) if self._peer_in else None
        self.heartbeat.start()
        if self._peers_enabled:
            self._prune_timer = loop.call_later(_CONNECTOR_PRUNE_S, self._prune_connectors, loop)

    def _prune_connectors(self, loop: asyncio.AbstractEventLoop) -> None:
        self._connectors.prune()
        self._prune_timer = loop.call_later(_CONNECTOR_PRUNE_S, self._prune_connectors, loop)

    def _listen_for_peers(self) -> str:
        """Bind the PULL that upstream replicas push to; "" (inputs only through the head)
        when the advertised address is not one of this host's (behind NAT, say)."""
        sock = self._ctx.socket(zmq.PULL)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 100_000)
        sock.setsockopt(zmq.MAXMSGSIZE, codec.MAX_MESSAGE_BYTES)
        try:
            port = sock.bind_to_random_port(f"tcp://{self._address}")
        except zmq.ZMQError as exc:
            log.warning(
                "cannot listen for other replicas on %s (%s); inputs will come through the head",
                self._address,
                exc,
            )
            sock.close(linger=0)
            return ""
        self._peer_in = sock
        return f"tcp://{self._address}:{port}"

    def close(self, say_down: bool) -> None:
        """Stop reading and heartbeating; ``say_down`` tells the head we leave for good."""
        self._pump.close()
        if self._prune_timer is not None:
            self._prune_timer.cancel()
        if self._peer_pump is not None:
            self._peer_pump.close()
        if self.heartbeat is not None:
            self.heartbeat.stop(send_down=say_down)
        self._in.close()
        # Queued outputs still leave when we stop for good; not when leaving a lost head.
        self._out.close(linger=1000 if say_down else 0)
        for sock in (self._peer_in, *(s for s, _ in self._peer_out.values())):
            if sock is not None:
                sock.close(linger=1000 if say_down else 0)
        self._peer_out.clear()
        # After the sockets: a payload still queued by reference stays readable as long
        # as the receiver maps its ring (the name goes, the memory stays mapped there).
        self._connectors.close()

    # -- Outlet ----------------------------------------------------------------------

    def to_head(self, chunks: list[OutputChunk]) -> None:
        batch = _batch(chunks)
        try:
            self._out.send(batch, NOBLOCK)
        except zmq.Again:
            # 100k messages queued: the head stopped reading. Keep them rather than drop.
            self._out.send(batch)

    def to_peer(self, address: str, chunks: list[OutputChunk], connector: PeerConnector) -> None:
        now = time.monotonic()
        if now - self._peers_pruned > _PEER_IDLE_S:
            self._prune_peers(now)
        kept = self._peer_out.get(address)
        if kept is None:
            sock = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, _PEER_HWM)
            sock.setsockopt(zmq.RECONNECT_IVL_MAX, 5000)
            sock.connect(address)
        else:
            sock = kept[0]
        self._peer_out[address] = (sock, now)
        chunks = self._connectors.outbound(address, connector, chunks)
        try:
            sock.send(_batch(chunks), NOBLOCK)
        except zmq.Again:
            _bad_input.warning("peer %s is not reading; dropped %d chunk(s)", address, len(chunks))

    def _prune_peers(self, now: float) -> None:
        """Close sockets to peers not used for a while: replicas come and go (each
        incarnation listens on a new port), and ZMQ keeps redialling a vanished one."""
        self._peers_pruned = now
        for address, (sock, used) in list(self._peer_out.items()):
            if now - used > _PEER_IDLE_S:
                sock.close(linger=0)
                del self._peer_out[address]
                self._connectors.forget_peer(address)

    # -- inbound ---------------------------------------------------------------------

    def _on_frames(self, frames: list[bytes]) -> None:
        for msg in codec.decode_batch_or_drop(frames, _bad_input, "from the head"):
            self._runner.handle(msg)

    def _on_peer_frames(self, frames: list[bytes]) -> None:
        # The hot path between replicas: one frame of OutputChunk records.
        if len(frames) != 1:
            _bad_input.warning("dropped a peer message of %d frames", len(frames))
            return
        try:
            chunks = codec.decode_records(frames[0], self._output_tag, self._output_decoder)
        except ProtocolError as exc:
            _bad_input.warning("dropped a bad peer batch: %s", exc)
            return
        connectors = self._connectors
        for chunk in chunks:
            if chunk.ref is None or connectors.inbound(chunk):
                self._runner.feed(chunk)


def data_sockets(
    ctx: zmq.Context, stage_id: int, reply: RegisterReply, init: HandshakeInit, bind: bool
) -> tuple[zmq.Socket, zmq.Socket]:
    """The input DEALER (routing id: this registration) and the output PUSH to a head,
    bound on the registration's ports with ``bind``, else dialled to the init's."""
    inp = ctx.socket(zmq.DEALER)
    inp.setsockopt(zmq.ROUTING_ID, routing_id(stage_id, reply.replica_id, reply.epoch))
    inp.setsockopt(zmq.LINGER, 0)
    inp.setsockopt(zmq.RCVHWM, 100_000)
    out = ctx.socket(zmq.PUSH)
    out.setsockopt(zmq.LINGER, 1000)
    out.setsockopt(zmq.SNDHWM, 100_000)
    if bind:
        inp.bind(reply.input_address)
        out.bind(reply.output_address)
    else:
        inp.connect(init.input_address)
        out.connect(init.output_address)
    return inp, out


def ready(runner: RequestRunner, reply: RegisterReply, address: str, peer_address: str) -> Ready:
    """READY for the registration ``reply``, from ``address`` (the advertised host)."""
    return Ready(
        stage_id=runner.stage_id,
        replica_id=reply.replica_id,
        epoch=reply.epoch,
        capacity=runner.engine.capacity,
        engine=runner.engine.name,
        pid=os.getpid(),
        address=address,
        peer_address=peer_address,
        kernel=runner.engine.kernel,
        host_key=host_key() if peer_address else "",
    )


def load_report(runner: RequestRunner) -> LoadReport:
    """What a heartbeat says of the load of ``runner`` and its engine."""
    engine = runner.engine
    return LoadReport(
        queue_length=engine.queue_length,
        in_flight=len(runner.requests),
        others=runner.admission.others(runner) if runner.admission is not None else 0,
        # Pieces of streamed input count: a request listening is not a stalled one.
        progress=engine.progress + runner.chunks_sent + runner.pieces_taken,
    )


def _batch(chunks: list[OutputChunk]) -> bytes:
    return b"".join([codec.pack(chunk) for chunk in chunks])
