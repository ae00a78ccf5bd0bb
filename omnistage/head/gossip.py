"""This head's part in a fleet of heads: announcing itself, answering announcements.

Every heartbeat interval a thread sends a ``HeadAnnounce`` to every head the view knows
(and to --omni-join until it answers), and reads their answers; the master answers the
announcements other heads send here (``answer``). Both update one ``FleetView`` under
one lock. A head alone (no --omni-join, nobody announcing to it) sends nothing.

The announcements are signed with --omni-auth-token and, with --omni-curve-keys, travel
over CURVE as a replica's would (this thread's sockets are CURVE clients of the other
heads' masters): a head without the fleet's secrets is not heard.
"""

from __future__ import annotations

import logging
import threading
import time

import zmq

from omnistage import curve
from omnistage.control.head_peers import FleetView, PeerChange
from omnistage.logs import Throttled
from omnistage.protocol import codec
from omnistage.protocol.auth import Signer, Verifier
from omnistage.protocol.errors import ProtocolError
from omnistage.protocol.messages import HeadAnnounce, HeadAnnounceReply

log = logging.getLogger(__name__)
_bad_input = Throttled(log)


class HeadFleet:
    def __init__(
        self,
        view: FleetView,
        interval_s: float,
        join: str | None = None,
        *,
        signer: Signer | None = None,
        verifier: Verifier | None = None,
        curve_keys: str | None = None,
    ) -> None:
        self.view = view
        self.lock = threading.Lock()
        self._interval_s = interval_s
        self._join = join
        self._signer = signer
        self._verifier = verifier
        self._curve_keys = curve_keys
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._heads: list[str] = []
        self._heads_version = -1

    # -- what others read --------------------------------------------------------------

    def heads(self) -> list[str]:
        """The fleet's heads for replicas (``FleetView.heads``), rebuilt only on change:
        read for every heartbeat ack."""
        with self.lock:
            if self._heads_version != self.view.version:
                self._heads, self._heads_version = self.view.heads(), self.view.version
            return self._heads

    def id_owner(self) -> str | None:
        """The master URL of the head that hands out replica ids, None when this one."""
        with self.lock:
            return self.view.id_owner()

    def snapshot(self) -> list[dict[str, object]]:
        with self.lock:
            return self.view.snapshot()

    # -- the master's side -------------------------------------------------------------

    def answer(self, frames: list[bytes]) -> list[bytes] | None:
        """A ``HeadAnnounce`` on the master's ROUTER (``[identity, tag, body(, stamp)]``)."""
        try:
            msg = codec.decode_signed(frames[1:], self._verifier, HeadAnnounce)
        except ProtocolError as exc:
            _bad_input.warning("head announcement dropped: %s", exc)
            return None
        reply = self._heard(msg.master, msg.instance, msg.heads)
        return [frames[0], *codec.sign(codec.encode(reply), self._signer)]

    def _heard(self, address: str, instance: str, heads: list[str]) -> HeadAnnounceReply:
        with self.lock:
            change = self.view.heard(address, instance, heads)
            reply = HeadAnnounceReply(
                master=self.view.me, instance=self.view.instance, heads=self.view.peers()
            )
        if change is not None:
            self._changed(change)
        return reply

    # -- the announcing thread ---------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="omni-fleet", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        ctx = zmq.Context()
        if self._curve_keys:
            curve.secure_replica(ctx, self._curve_keys)
        sockets: dict[str, zmq.Socket] = {}
        poller = zmq.Poller()
        try:
            while not self._stop.is_set():
                targets = self._targets()
                for address in set(sockets) - set(targets):
                    poller.unregister(sockets[address])
                    sockets.pop(address).close(linger=0)
                for address in targets:
                    sock = sockets.get(address) or self._connect(ctx, address, poller)
                    sockets[address] = sock
                    self._announce(sock)
                self._read_answers(poller, time.monotonic() + self._interval_s)
                with self.lock:
                    changes = self.view.expire()
                for change in changes:
                    self._changed(change)
        finally:
            for sock in sockets.values():
                sock.close(linger=0)
            ctx.term()

    def _targets(self) -> list[str]:
        with self.lock:
            peers = self.view.peers()
        if self._join and self._join not in peers:
            # Keep asking the head we were told to join until it is a peer, even when
            # another head found us first: that one may be of another fleet, which the
            # join merges with ours. (Named otherwise than it names itself, say a host
            # name for an address, it is asked every round: one message more.)
            return [*peers, self._join]
        return peers

    def _connect(self, ctx: zmq.Context, address: str, poller: zmq.Poller) -> zmq.Socket:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        # Announcements to a head that is down queue here; one is as good as many.
        sock.setsockopt(zmq.SNDHWM, 2)
        sock.connect(address)
        poller.register(sock, zmq.POLLIN)
        return sock

    def _announce(self, sock: zmq.Socket) -> None:
        with self.lock:
            msg = HeadAnnounce(
                master=self.view.me, instance=self.view.instance, heads=self.view.peers()
            )
        try:
            sock.send_multipart(codec.sign(codec.encode(msg), self._signer), zmq.NOBLOCK)
        except zmq.Again:
            pass  # not connected (the head is down): the next round tries again

    def _read_answers(self, poller: zmq.Poller, deadline: float) -> None:
        while not self._stop.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                return
            if not poller.sockets:
                # Alone: nothing to read. (zmq's poll of no sockets returns at once: it
                # would spin a core.)
                self._stop.wait(left)
                return
            for sock, _ in poller.poll(int(min(left, 0.1) * 1000) or 1):
                try:
                    reply = codec.decode_signed(
                        sock.recv_multipart(), self._verifier, HeadAnnounceReply
                    )
                except ProtocolError as exc:
                    _bad_input.warning("head announcement answer dropped: %s", exc)
                    continue
                self._heard(reply.master, reply.instance, reply.heads)

    def _changed(self, change: PeerChange) -> None:
        if change.forgotten:
            log.info("head %s forgotten (down too long)", change.address)
        elif change.up:
            log.info("head %s (instance %s) is UP in the fleet", change.address, change.instance)
        else:
            log.warning("head %s is DOWN (not heard from)", change.address)
