"""The replica's side of registration and the HELLO/init handshake (blocking, zmq)."""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec
import zmq

from omnistage.net import connectable_url, split_tcp_url, tcp_url
from omnistage.protocol import codec
from omnistage.protocol.auth import Signer
from omnistage.protocol.errors import (
    HandshakeError,
    IdConflict,
    OmniError,
    ProtocolError,
    Redirected,
    RegistrationError,
)
from omnistage.protocol.messages import PROTOCOL_VERSION, HandshakeInit, Hello
from omnistage.protocol.registration import RegisterReply, RegisterRequest
from omnistage.replica.options import ReplicaOptions

_Msg = TypeVar("_Msg", bound=msgspec.Struct)

log = logging.getLogger(__name__)

# How long a replica waits for the fleet's id owner (a redirect's target) to answer
# before it takes an id from its first head instead.
CLAIM_WAIT_S = 5.0

# This replica process, as the heads of a fleet tell replicas apart (registration's
# ``replica_instance``). Hex, so two instances compare as strings: when two replicas
# were given the same id by two heads, the greater one registers again for a new id.
INSTANCE = secrets.token_hex(8)


@dataclass(frozen=True)
class MasterLink:
    """How a replica reaches one head's control plane, for registration and HELLO."""

    ctx: zmq.Context
    host: str
    port: int
    signer: Signer | None = None
    # Set to abandon a wait in progress (a signal): HandshakeError "cancelled".
    cancel: threading.Event | None = None


def registration(
    opts: ReplicaOptions,
    address: str,
    bind_ports: tuple[int, int, int] | None = None,
    previous: tuple[str, int] | None = None,
) -> RegisterRequest:
    """The registration a replica sends from ``address`` (its advertised host).

    With ``bind_ports`` (handshake, input, output) the replica will bind its own sockets
    on ``address`` and the head dials them (the seed's replica_binds_sockets).
    ``previous`` (head instance, replica id) asks a head we were registered with before
    for our old id back.
    """
    hs_port, in_port, out_port = bind_ports if bind_ports is not None else (None, None, None)
    previous_head, previous_id = previous if previous is not None else (None, None)
    return RegisterRequest(
        stage_id=opts.stage_id,
        replica_id=opts.replica_id,
        stage_config=opts.stage_overrides or None,
        replica_bind_address=address,
        replica_handshake_port=hs_port,
        replica_input_port=in_port,
        replica_output_port=out_port,
        replica_binds_sockets=bind_ports is not None,
        protocol_version=PROTOCOL_VERSION,
        previous_head=previous_head,
        previous_replica_id=previous_id,
        local_key=opts.local_key,
        replica_instance=INSTANCE,
    )


def gives_way(opts: ReplicaOptions, conflict: IdConflict) -> bool:
    """Whether this replica registers again for a new id, given that ``conflict.
    held_by`` holds its id at some head: a head's own replica always keeps its id; of
    two replicas, the one with the greater instance moves (both see the conflict, so
    exactly one of them does). An operator's id (--replica-id) never moves: it waits
    for the other to go."""
    return opts.replica_id < 0 and (not conflict.held_by or conflict.held_by < INSTANCE)


def with_fleet_id(opts: ReplicaOptions, req: RegisterRequest, replica_id: int) -> RegisterRequest:
    """``req`` asking for the id this replica has in the fleet: refused where another
    live replica holds it (``IdConflict``), as an operator's id (--replica-id) is."""
    assigned = opts.replica_id < 0 or None
    return msgspec.structs.replace(req, replica_id=replica_id, assigned_id=assigned)


def wire_map(req: RegisterRequest) -> dict[str, Any]:
    """The registration as the seed's msgpack map: the Struct leaves out fields at their
    defaults, but the seed's client always sends replica_id and stage_config (nil too)."""
    return {
        "stage_id": req.stage_id,
        "replica_id": req.replica_id,
        "stage_config": req.stage_config,
        **msgspec.to_builtins(req),
    }


Send = Callable[[MasterLink, RegisterRequest, float], RegisterReply]


def register_in_fleet(
    opts: ReplicaOptions,
    link: MasterLink,
    req: RegisterRequest,
    timeout_s: float,
    send: Send | None = None,
) -> RegisterReply:
    """Register at ``link`` (the first head); an auto-assigned id comes from the fleet's
    id owner when the first head redirects there: register there first, then here with
    that id (``with_fleet_id``). One hop only (the owner is asked without following
    another redirect); an owner that does not answer or refuses leaves the id to the
    first head, and a clash with another head's id is then settled by ``gives_way``.
    ``send``: ``register`` (tests pass a fake)."""
    send = send or register
    if req.replica_id >= 0:
        return send(link, req, timeout_s)
    try:
        return send(link, msgspec.structs.replace(req, follows_redirect=True), timeout_s)
    except Redirected as redirect:
        host, port = split_tcp_url(redirect.master)
        owner = dataclasses.replace(link, host=host, port=port)
        claim = _claim(req)
        try:
            fleet_id = send(owner, claim, min(timeout_s, CLAIM_WAIT_S)).replica_id
        except OmniError as exc:
            log.warning("the fleet's id owner at %s: %s; taking an id here", redirect.master, exc)
            return send(link, req, timeout_s)
        log.info("replica id %d from the fleet's id owner at %s", fleet_id, redirect.master)
    return send(link, with_fleet_id(opts, req, fleet_id), timeout_s)


def _claim(req: RegisterRequest) -> RegisterRequest:
    """``req`` as sent to the id owner for an id only: without our own ports (that head
    must not dial the sockets we bind for the first head: it would take HELLOs meant
    for it); we register there for service later, with the id (``other_heads``)."""
    return msgspec.structs.replace(
        req,
        previous_head=None,
        previous_replica_id=None,
        replica_binds_sockets=None,
        replica_handshake_port=None,
        replica_input_port=None,
        replica_output_port=None,
    )


def register(link: MasterLink, req: RegisterRequest, timeout_s: float) -> RegisterReply:
    """Register with the master; raises RegistrationError on refusal or timeout."""
    sock = link.ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(tcp_url(link.host, link.port))
        body = [codec.encode_register_request(wire_map(req), link.signer)]
        if not _exchange(sock, body, timeout_s, link.cancel):
            raise RegistrationError(
                f"no answer from the master at {link.host}:{link.port} within "
                f"{timeout_s:g}s (raise --stage-init-timeout, or check -oma/-omp; with "
                "--omni-curve-keys, check this host has the head's keys)"
            )
        reply = read_register_reply(sock.recv(), link.host)
    finally:
        sock.close()
    return reply


def read_register_reply(data: bytes, host: str) -> RegisterReply:
    """The master's answer to a registration, its addresses dialable from ``host`` (the
    master's); raises RegistrationError on a refusal."""
    try:
        reply = codec.decode_register_reply(data)
    except ProtocolError as exc:
        raise RegistrationError(f"master refused the registration: {exc}") from None
    addresses = ["handshake_address", "input_address", "output_address"]
    if reply.coordinator_router_address:
        addresses.append("coordinator_router_address")
    return _dialable(reply, host, addresses)


def handshake(
    link: MasterLink, reply: RegisterReply, stage_id: int, timeout_s: float, bind: bool = False
) -> HandshakeInit:
    """Send HELLO and wait for the head's init message (binding the handshake socket
    when the replica binds its own sockets: HELLO then waits for the head to dial)."""
    sock = link.ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        if bind:
            sock.bind(reply.handshake_address)
        else:
            sock.connect(reply.handshake_address)
        frames = codec.sign(codec.encode(hello(stage_id, reply)), link.signer)
        if not _exchange(sock, frames, timeout_s, link.cancel):
            raise HandshakeError(
                f"no handshake answer from the head at {reply.handshake_address} within "
                f"{timeout_s:g}s (raise --stage-init-timeout)"
            )
        frames = sock.recv_multipart()
    finally:
        sock.close()
    return read_init(frames, link.host)


def hello(stage_id: int, reply: RegisterReply) -> Hello:
    """The HELLO of the registration ``reply``."""
    return Hello(
        stage_id=stage_id,
        replica_id=reply.replica_id,
        epoch=reply.epoch,
        pid=os.getpid(),
        host=socket.gethostname(),
    )


def read_init(frames: list[bytes], host: str) -> HandshakeInit:
    """The head's answer to HELLO, its addresses dialable from ``host`` (the master's);
    raises HandshakeError on a refusal or anything but the init message."""
    try:
        init = codec.decode_frames(frames)
    except ProtocolError as exc:
        raise HandshakeError(f"bad handshake answer: {exc}") from None
    if not isinstance(init, HandshakeInit):
        raise HandshakeError(f"expected the head's init message, got {type(init).__name__}")
    if init.error:
        raise HandshakeError(f"head refused the handshake: {init.error}")
    return _dialable(init, host, ["input_address", "output_address", "coordinator_address"])


def _dialable(msg: _Msg, host: str, fields: Iterable[str]) -> _Msg:
    """``msg`` with its addresses in ``fields`` dialable: the head may bind on a wildcard
    address, so dial the host we reached its master on."""
    return msgspec.structs.replace(
        msg, **{f: connectable_url(getattr(msg, f), host) for f in fields}
    )


def _exchange(
    sock: zmq.Socket, frames: list[bytes], timeout_s: float, cancel: threading.Event | None
) -> bool:
    """Send ``frames`` and wait for an answer, both within ``timeout_s``; False when
    either did not happen in time. A DEALER with no peer blocks on send, and a CURVE
    head drops a keyless replica's connection at its handshake: were that to happen
    between connect and send (a busy host), a plain send would wait forever and no
    --stage-init-timeout would fire."""
    deadline = time.monotonic() + timeout_s
    if not _poll(sock, deadline, cancel, zmq.POLLOUT):
        return False
    try:
        sock.send_multipart(frames, zmq.NOBLOCK)
    except zmq.Again:  # the peer went between the poll and the send
        return False
    return _poll(sock, deadline, cancel, zmq.POLLIN)


def _poll(sock: zmq.Socket, deadline: float, cancel: threading.Event | None, event: int) -> bool:
    """Wait for ``event`` until ``deadline`` (monotonic) in short slices, so a shutdown
    request is honoured quickly."""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        if sock.poll(int(min(left, 0.1) * 1000) or 1, event):
            return True
        if cancel is not None and cancel.is_set():
            raise HandshakeError("cancelled by shutdown")
