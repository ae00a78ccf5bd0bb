"""The replica's side of registration and the HELLO/init handshake (blocking, zmq)."""

from __future__ import annotations

import os
import socket
import threading
import time
from typing import Any

import zmq

from omnistage.net import connectable_url, tcp_url
from omnistage.protocol import codec
from omnistage.protocol.auth import Signer
from omnistage.protocol.errors import HandshakeError, ProtocolError, RegistrationError
from omnistage.protocol.messages import (
    PROTOCOL_VERSION,
    HandshakeInit,
    Hello,
    RegisterReply,
)


def register(
    ctx: zmq.Context,
    master_host: str,
    master_port: int,
    stage_id: int,
    replica_id: int,
    advertise_address: str,
    timeout_s: float,
    stage_config: Any = None,
    cancel: threading.Event | None = None,
    bind_ports: tuple[int, int, int] | None = None,
    signer: Signer | None = None,
    previous: tuple[str, int] | None = None,
    local_key: str | None = None,
) -> RegisterReply:
    """Register with the master; raises RegistrationError on refusal or timeout.

    With ``bind_ports`` (handshake, input, output) the replica will bind its own sockets
    on ``advertise_address`` and the head dials them (the seed's replica_binds_sockets).
    ``previous`` (head instance, replica id) asks a head we were registered with before
    for our old id back.
    """
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(tcp_url(master_host, master_port))
        payload = {
            "stage_id": stage_id,
            "replica_id": replica_id,
            "stage_config": stage_config,
            "replica_bind_address": advertise_address,
            "replica_binds_sockets": bind_ports is not None,
            "protocol_version": PROTOCOL_VERSION,
        }
        if local_key is not None:
            payload["local_key"] = local_key
        if previous is not None:
            payload["previous_head"], payload["previous_replica_id"] = previous
        if bind_ports is not None:
            payload["replica_handshake_port"] = bind_ports[0]
            payload["replica_input_port"] = bind_ports[1]
            payload["replica_output_port"] = bind_ports[2]
        sock.send(codec.encode_register_request(payload, signer))
        if not _poll(sock, timeout_s, cancel):
            raise RegistrationError(
                f"no answer from the master at {master_host}:{master_port} within "
                f"{timeout_s:g}s (raise --stage-init-timeout, or check -oma/-omp; with "
                "--omni-curve-keys, check this host has the head's keys)"
            )
        try:
            reply = codec.decode_register_reply(sock.recv())
        except ProtocolError as exc:
            raise RegistrationError(f"master refused the registration: {exc}") from None
    finally:
        sock.close()
    # The head may bind on a wildcard address; dial the host we reached the master on.
    return RegisterReply(
        handshake_address=connectable_url(reply.handshake_address, master_host),
        input_address=connectable_url(reply.input_address, master_host),
        output_address=connectable_url(reply.output_address, master_host),
        replica_id=reply.replica_id,
        coordinator_router_address=(
            connectable_url(reply.coordinator_router_address, master_host)
            if reply.coordinator_router_address
            else None
        ),
        stage_id=reply.stage_id,
        epoch=reply.epoch,
        protocol_version=reply.protocol_version,
        head_instance=reply.head_instance,
    )


def handshake(
    ctx: zmq.Context,
    reply: RegisterReply,
    stage_id: int,
    timeout_s: float,
    master_host: str,
    cancel: threading.Event | None = None,
    bind: bool = False,
    signer: Signer | None = None,
) -> HandshakeInit:
    """Send HELLO and wait for the head's init message (binding the handshake socket
    when the replica binds its own sockets: HELLO then waits for the head to dial)."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        if bind:
            sock.bind(reply.handshake_address)
        else:
            sock.connect(reply.handshake_address)
        hello = Hello(
            stage_id=stage_id,
            replica_id=reply.replica_id,
            epoch=reply.epoch,
            pid=os.getpid(),
            host=socket.gethostname(),
        )
        sock.send_multipart(codec.sign(codec.encode(hello), signer))
        if not _poll(sock, timeout_s, cancel):
            raise HandshakeError(
                f"no handshake answer from the head at {reply.handshake_address} within "
                f"{timeout_s:g}s (raise --stage-init-timeout)"
            )
        try:
            init = codec.decode_frames(sock.recv_multipart())
        except ProtocolError as exc:
            raise HandshakeError(f"bad handshake answer: {exc}") from None
    finally:
        sock.close()
    if not isinstance(init, HandshakeInit):
        raise HandshakeError(f"expected the head's init message, got {type(init).__name__}")
    if init.error:
        raise HandshakeError(f"head refused the handshake: {init.error}")
    init.input_address = connectable_url(init.input_address, master_host)
    init.output_address = connectable_url(init.output_address, master_host)
    init.coordinator_address = connectable_url(init.coordinator_address, master_host)
    return init


def _poll(sock: zmq.Socket, timeout_s: float, cancel: threading.Event | None) -> bool:
    """Wait for a reply in short slices so a shutdown request is honoured quickly."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        if sock.poll(int(min(left, 0.1) * 1000) or 1):
            return True
        if cancel is not None and cancel.is_set():
            raise HandshakeError("cancelled by shutdown")
