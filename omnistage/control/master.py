"""The master: answers registrations on the ROUTER at -oma:-omp, and head probes.

A registration is one frame (the seed's msgpack map); a ``HeadProbe`` is a tagged
message (``[tag, body(, stamp)]``), answered with this head's instance id so that a
replica whose heartbeats go unanswered learns at once that a new head took the address.
Another head's ``HeadAnnounce`` (a fleet of heads) is answered by ``head.gossip``.

Handles one message at a time on the control thread, which makes slot allocation
race-free under concurrent registrations. Bad input gets an ``{"error": ...}`` reply and
a log line; nothing a peer sends can stop the master.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

from omnistage.control.slots import Slot, SlotTable
from omnistage.logs import Throttled
from omnistage.net import tcp_url
from omnistage.protocol import codec
from omnistage.protocol.auth import Signer, Verifier
from omnistage.protocol.errors import IdConflict, ProtocolError, RegistrationError
from omnistage.protocol.messages import PROTOCOL_VERSION, HeadAnnounce, HeadProbe, HeadProbeReply
from omnistage.protocol.registration import (
    ErrorReply,
    RegisterRedirect,
    RegisterReply,
    RegisterRequest,
)
from omnistage.protocol.tags import TAGS

log = logging.getLogger(__name__)
_bad_input = Throttled(log)


@dataclass(frozen=True)
class HeadAddresses:
    """Where replicas connect on the head (connect-side URLs)."""

    handshake: str
    input: str
    output: str
    coordinator: str


_PROBE = TAGS[HeadProbe]
_ANNOUNCE = TAGS[HeadAnnounce]

OnRegister = Callable[[Slot, RegisterRequest], None]
# (stage, replica id, epoch) of a slot its replica left by registering under another id.
OnMoved = Callable[[int, int, int], None]


class Master:
    def __init__(
        self,
        slots: SlotTable,
        addresses: HeadAddresses,
        on_register: OnRegister,
        lock: threading.Lock,
        verifier: Verifier | None = None,
        signer: Signer | None = None,
        announce: Callable[[list[bytes]], list[bytes] | None] | None = None,
        on_moved: OnMoved | None = None,
        id_owner: Callable[[], str | None] | None = None,
    ) -> None:
        """``announce`` answers another head's ``HeadAnnounce`` (``head.gossip``);
        ``on_moved``: a replica registered again under another id, and its old slot is
        to be let go at once rather than after a heartbeat timeout; ``id_owner``: the
        master URL of the fleet's head that hands out ids, None when this one."""
        self._announce = announce
        self._id_owner = id_owner
        self._on_moved = on_moved
        self._verifier = verifier
        self._signer = signer
        self._slots = slots
        self._addresses = addresses
        self._on_register = on_register
        self._lock = lock
        # Set while the head shuts down: replicas must not rejoin a head that is leaving.
        self.closing = False

    def handle(self, frames: list[bytes]) -> list[bytes] | None:
        """Answer one ROUTER message; returns the reply frames."""
        if len(frames) < 2:
            _bad_input.warning("registration with %d frame(s) dropped", len(frames))
            return None
        if len(frames) >= 3 and frames[1] == _PROBE:
            return self._probe(frames)
        if len(frames) >= 3 and frames[1] == _ANNOUNCE and self._announce is not None:
            return self._announce(frames)
        identity, body = frames[0], frames[-1]
        # A REQ client puts an empty delimiter first; echo it back so REQ works too.
        envelope = [identity, b""] if len(frames) >= 3 and frames[1] == b"" else [identity]
        try:
            reply = self._register(body)
        except (ProtocolError, RegistrationError) as exc:
            _bad_input.warning("registration refused: %s", exc)
            held_by = exc.held_by if isinstance(exc, IdConflict) else None
            return [*envelope, codec.encode_register_reply(ErrorReply(str(exc), held_by))]
        return [*envelope, codec.encode_register_reply(reply)]

    def _probe(self, frames: list[bytes]) -> list[bytes] | None:
        try:
            codec.decode_signed(frames[1:], self._verifier, HeadProbe)
        except ProtocolError as exc:
            _bad_input.warning("head probe dropped: %s", exc)
            return None
        reply = HeadProbeReply(head_instance=self._slots.instance)
        return [frames[0], *codec.sign(codec.encode(reply), self._signer)]

    def _register(self, body: bytes) -> RegisterReply | RegisterRedirect:
        req = codec.decode_register_request(body, self._verifier)
        if self.closing:
            raise RegistrationError("the head is shutting down; register with the next one")
        # A seed client states no version: the registration map is still the seed's.
        version = req.protocol_version
        if version is not None and version != PROTOCOL_VERSION:
            raise RegistrationError(
                f"protocol_version {version} is not supported; this head speaks "
                f"{PROTOCOL_VERSION} (upgrade the replica or the head so they match)"
            )
        owner = self._redirect_to(req)
        if owner is not None:
            return RegisterRedirect(redirect=owner, head_instance=self._slots.instance)
        with self._lock:
            old = self._slots.held(req.stage_id, req.replica_instance)
            moved = (old.replica_id, old.epoch) if old is not None else None
            slot = self._slots.register(req)
        self._on_register(slot, req)
        if moved and moved[0] != slot.replica_id and self._on_moved is not None:
            log.info(
                "stage %d replica %d registered again as replica %d",
                slot.stage_id,
                moved[0],
                slot.replica_id,
            )
            self._on_moved(slot.stage_id, *moved)
        log.info(
            "stage %d replica %d registered (epoch %d, from %s)",
            slot.stage_id,
            slot.replica_id,
            slot.epoch,
            req.replica_bind_address or "?",
        )
        return self._reply(slot)

    def _redirect_to(self, req: RegisterRequest) -> str | None:
        """Where an auto-assign registration gets its id instead, if not here: the
        fleet's id owner, for a replica that follows redirects. A replica rejoining
        this head instance gets its old id back here, and the head's own replicas
        register only here."""
        if not req.follows_redirect or req.replica_id >= 0 or self._id_owner is None:
            return None
        if req.local_key or (req.previous_head and req.previous_head == self._slots.instance):
            return None
        return self._id_owner()

    def _reply(self, slot: Slot) -> RegisterReply:
        a = self._addresses
        handshake, inp, out = a.handshake, a.input, a.output
        if slot.binds_sockets and slot.replica_ports and slot.bind_address:
            hs_port, in_port, out_port = slot.replica_ports
            handshake = tcp_url(slot.bind_address, hs_port)
            inp = tcp_url(slot.bind_address, in_port)
            out = tcp_url(slot.bind_address, out_port)
        return RegisterReply(
            handshake_address=handshake,
            input_address=inp,
            output_address=out,
            replica_id=slot.replica_id,
            coordinator_router_address=a.coordinator,
            stage_id=slot.stage_id,
            epoch=slot.epoch,
            head_instance=self._slots.instance,
        )
