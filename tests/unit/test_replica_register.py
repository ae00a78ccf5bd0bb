"""The replica's registration and HELLO against a master ROUTER in this process: the map
on the wire, the reply's addresses made dialable, refusals, timeouts and cancelling."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator

import msgspec
import pytest
import zmq

from omnistage.control.master import HeadAddresses, Master
from omnistage.control.slots import SlotTable
from omnistage.protocol import codec
from omnistage.protocol.auth import Signer, Verifier
from omnistage.protocol.errors import HandshakeError, RegistrationError
from omnistage.protocol.messages import PROTOCOL_VERSION, HandshakeInit, Hello
from omnistage.protocol.registration import RegisterReply, RegisterRequest
from omnistage.replica.options import ReplicaOptions
from omnistage.replica.register import (
    INSTANCE,
    MasterLink,
    handshake,
    register,
    registration,
    wire_map,
)

Answer = Callable[[list[bytes]], list[bytes] | None]


class FakeRouter:
    """A ROUTER on loopback answering each message with ``answer`` on its own thread."""

    def __init__(self, ctx: zmq.Context, answer: Answer) -> None:
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.received: list[list[bytes]] = []
        self._answer = answer
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self.sock.poll(20):
                frames = self.sock.recv_multipart()
                self.received.append(frames)
                reply = self._answer(frames)
                if reply is not None:
                    self.sock.send_multipart(reply)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self.sock.close()


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    context = zmq.Context()
    yield context
    context.destroy(linger=0)  # a failed test may leave a socket open


def _opts(**kw: object) -> ReplicaOptions:
    return ReplicaOptions(stage_id=1, master_host="127.0.0.1", master_port=0, **kw)  # type: ignore[arg-type]


def _reply(**kw: object) -> RegisterReply:
    fields: dict[str, object] = {
        "handshake_address": "tcp://0.0.0.0:5001",
        "input_address": "tcp://0.0.0.0:5002",
        "output_address": "tcp://10.1.2.3:5003",
        "replica_id": 3,
        "coordinator_router_address": "tcp://*:5004",
        "stage_id": 1,
        "epoch": 7,
        "head_instance": "h1",
    }
    fields.update(kw)
    return RegisterReply(**fields)  # type: ignore[arg-type]


def test_a_plain_registration_sends_the_seed_keys_and_no_unset_extensions() -> None:
    body = wire_map(registration(_opts(), "10.0.0.5"))
    assert body == {
        "stage_id": 1,
        "replica_id": -1,
        "stage_config": None,
        "replica_bind_address": "10.0.0.5",
        "replica_binds_sockets": False,
        "protocol_version": PROTOCOL_VERSION,
        "replica_instance": INSTANCE,  # this process's, for a fleet of heads
    }


def test_replica_id_zero_and_a_nil_stage_config_are_still_sent() -> None:
    body = wire_map(registration(_opts(replica_id=0), "10.0.0.5"))
    assert body["replica_id"] == 0 and body["stage_config"] is None


def test_a_rejoining_binding_local_replica_sends_its_extensions() -> None:
    opts = _opts(local_key="k", stage_overrides={"devices": "1"})
    req = registration(opts, "10.0.0.5", bind_ports=(7001, 7002, 7003), previous=("h0", 4))
    body = wire_map(req)
    assert body["replica_binds_sockets"] is True
    ports = [body[f"replica_{k}_port"] for k in ("handshake", "input", "output")]
    assert ports == [7001, 7002, 7003]
    assert (body["previous_head"], body["previous_replica_id"]) == ("h0", 4)
    assert body["local_key"] == "k" and body["stage_config"] == {"devices": "1"}
    # What the master decodes is the request the replica built.
    assert codec.decode_register_request(msgspec.msgpack.encode(body)) == req


def test_register_through_a_real_master_gets_a_slot(ctx: zmq.Context) -> None:
    slots = SlotTable([0, 1], instance="head-a")
    seen: list[RegisterRequest] = []
    addresses = HeadAddresses("tcp://0.0.0.0:1", "tcp://0.0.0.0:2", "tcp://0.0.0.0:3", "tcp://*:4")
    master = Master(
        slots, addresses, lambda slot, req: seen.append(req), threading.Lock(), Verifier("t")
    )
    router = FakeRouter(ctx, master.handle)
    try:
        link = MasterLink(ctx, "127.0.0.1", router.port, Signer("t"))
        reply = register(link, registration(_opts(), "127.0.0.1"), timeout_s=2.0)
    finally:
        router.close()
    assert (reply.stage_id, reply.replica_id, reply.head_instance) == (1, 0, "head-a")
    # Wildcard binds become the host the replica reached the master on.
    assert reply.handshake_address == "tcp://127.0.0.1:1"
    assert reply.coordinator_router_address == "tcp://127.0.0.1:4"
    assert seen[0].replica_bind_address == "127.0.0.1"


def test_an_unsigned_registration_is_refused_by_a_head_with_a_token(ctx: zmq.Context) -> None:
    addresses = HeadAddresses("tcp://a:1", "tcp://a:2", "tcp://a:3", "tcp://a:4")
    master = Master(
        SlotTable([1]), addresses, lambda slot, req: None, threading.Lock(), Verifier("t")
    )
    router = FakeRouter(ctx, master.handle)
    try:
        with pytest.raises(RegistrationError, match="master refused"):
            register(MasterLink(ctx, "127.0.0.1", router.port), registration(_opts(), "h"), 2.0)
    finally:
        router.close()


def test_register_keeps_a_routable_address_and_a_missing_coordinator(
    ctx: zmq.Context,
) -> None:
    reply = _reply(coordinator_router_address=None)
    router = FakeRouter(ctx, lambda f: [f[0], codec.encode_register_reply(reply)])
    try:
        got = register(MasterLink(ctx, "127.0.0.1", router.port), registration(_opts(), "h"), 2.0)
    finally:
        router.close()
    assert got.output_address == "tcp://10.1.2.3:5003"
    assert got.coordinator_router_address is None


def test_register_times_out_naming_the_flag(ctx: zmq.Context) -> None:
    router = FakeRouter(ctx, lambda frames: None)
    try:
        with pytest.raises(RegistrationError, match="--stage-init-timeout"):
            register(MasterLink(ctx, "127.0.0.1", router.port), registration(_opts(), "h"), 0.2)
    finally:
        router.close()


def test_a_set_cancel_event_abandons_the_wait(ctx: zmq.Context) -> None:
    router = FakeRouter(ctx, lambda frames: None)
    cancel = threading.Event()
    cancel.set()
    try:
        link = MasterLink(ctx, "127.0.0.1", router.port, cancel=cancel)
        with pytest.raises(HandshakeError, match="cancelled"):
            register(link, registration(_opts(), "h"), 30.0)
    finally:
        router.close()


class _NoPeerSocket(zmq.Socket):
    """A DEALER that queues nothing until a connection is up (ZMQ_IMMEDIATE), as one is
    left once a CURVE head has refused its handshake: its send blocks for want of a
    peer. (Whether libzmq drops a refused pipe depends on timing; this is the case
    that hung a keyless replica in CI.)"""

    def connect(self, addr: str) -> None:  # type: ignore[override]
        self.setsockopt(zmq.IMMEDIATE, 1)
        super().connect(addr)


class _NoPeerContext(zmq.Context):
    _socket_class = _NoPeerSocket


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("step", ["register", "handshake"])
def test_a_send_with_no_peer_still_times_out_naming_the_flag(step: str) -> None:
    ctx = _NoPeerContext()
    port = _closed_port()
    link = MasterLink(ctx, "127.0.0.1", port)
    started = time.monotonic()
    try:
        if step == "register":
            with pytest.raises(RegistrationError, match=r"within 0\.5s"):
                register(link, registration(_opts(), "h"), 0.5)
        else:
            reply = _reply(handshake_address=f"tcp://127.0.0.1:{port}")
            with pytest.raises(HandshakeError, match=r"within 0\.5s"):
                handshake(link, reply, 1, 0.5)
    finally:
        ctx.destroy(linger=0)
    assert time.monotonic() - started < 3


def _init(error: str | None = None) -> HandshakeInit:
    return HandshakeInit(
        stage_config={"stage_id": 1},
        input_address="tcp://0.0.0.0:6002",
        output_address="tcp://0.0.0.0:6003",
        coordinator_address="tcp://0.0.0.0:6004",
        heartbeat_interval_s=0.5,
        stage_init_timeout_s=10.0,
        error=error,
    )


def _hello_answer(init: HandshakeInit, hellos: list[Hello]) -> Answer:
    def answer(frames: list[bytes]) -> list[bytes]:
        hello = codec.decode_frames(frames[1:3])
        hellos.append(hello)
        return [frames[0], *codec.encode(init)]

    return answer


def test_handshake_says_hello_and_makes_the_init_addresses_dialable(ctx: zmq.Context) -> None:
    hellos: list[Hello] = []
    router = FakeRouter(ctx, _hello_answer(_init(), hellos))
    try:
        reply = _reply(handshake_address=f"tcp://127.0.0.1:{router.port}")
        init = handshake(MasterLink(ctx, "127.0.0.1", 0), reply, 1, 2.0)
    finally:
        router.close()
    assert (hellos[0].stage_id, hellos[0].replica_id, hellos[0].epoch) == (1, 3, 7)
    assert init.input_address == "tcp://127.0.0.1:6002"
    assert init.coordinator_address == "tcp://127.0.0.1:6004"


def test_a_refused_handshake_raises_with_the_heads_reason(ctx: zmq.Context) -> None:
    router = FakeRouter(ctx, _hello_answer(_init(error="not current"), []))
    try:
        reply = _reply(handshake_address=f"tcp://127.0.0.1:{router.port}")
        with pytest.raises(HandshakeError, match="not current"):
            handshake(MasterLink(ctx, "127.0.0.1", 0), reply, 1, 2.0)
    finally:
        router.close()
