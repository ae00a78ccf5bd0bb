"""Replica ids handed out by one head of a fleet, without sockets: the owner rule (pure
fleet view, fake clock), a head's redirect (the master's handler), and a replica
following it (``register_in_fleet`` over a fake ``send``)."""

from __future__ import annotations

import threading

import pytest

from omnistage.control.head_peers import FleetView
from omnistage.control.master import HeadAddresses, Master
from omnistage.control.slots import SlotTable
from omnistage.protocol import codec
from omnistage.protocol.errors import Redirected, RegistrationError
from omnistage.protocol.registration import RegisterReply, RegisterRequest
from omnistage.replica.options import ReplicaOptions
from omnistage.replica.register import MasterLink, register_in_fleet, wire_map
from tests.unit.fakes import FakeClock

A, B, C = "tcp://10.0.0.1:5000", "tcp://10.0.0.2:5000", "tcp://10.0.0.3:5000"


def test_the_up_head_with_the_smallest_instance_hands_out_ids_as_every_head_sees_it() -> None:
    clock = FakeClock()
    a = FleetView(A, "inst-b", clock, down_after_s=5.0)
    b = FleetView(B, "inst-a", clock, down_after_s=5.0)
    assert a.id_owner() is None  # alone: its own
    a.learn([B])
    assert a.id_owner() is None  # B named but not heard from: not UP
    a.heard(B, "inst-a", [])
    b.heard(A, "inst-b", [])
    # Both name B: A redirects there, B keeps the ids.
    assert (a.id_owner(), b.id_owner()) == (B, None)
    a.heard(C, "inst-c", [])
    assert a.id_owner() == B  # a greater instance changes nothing
    clock.now += 6.0
    a.heard(C, "inst-c", [])
    a.expire()  # B silent: DOWN, so A (below C) hands out ids again
    assert a.id_owner() is None


def _master(owner: str | None) -> Master:
    addresses = HeadAddresses("tcp://h:1", "tcp://h:2", "tcp://h:3", "tcp://h:4")
    return Master(
        SlotTable([0], instance="head-1", local_key="secret"),
        addresses,
        lambda slot, req: None,
        threading.Lock(),
        id_owner=lambda: owner,
    )


def _ask(master: Master, req: RegisterRequest) -> RegisterReply:
    frames = master.handle([b"peer", codec.encode_register_request(wire_map(req), None)])
    assert frames is not None
    return codec.decode_register_reply(frames[-1])


def test_a_head_redirects_only_auto_ids_of_replicas_that_follow_redirects() -> None:
    master = _master(owner=B)
    follows = RegisterRequest(stage_id=0, replica_id=-1, follows_redirect=True)
    with pytest.raises(Redirected) as err:
        _ask(master, follows)
    assert (err.value.master, err.value.head_instance) == (B, "head-1")
    # A seed client (no flag) and an id given by the operator or the fleet: served here.
    assert _ask(master, RegisterRequest(stage_id=0, replica_id=-1)).replica_id == 0
    assert _ask(master, RegisterRequest(stage_id=0, replica_id=5, follows_redirect=True))
    # The head's own replica, and one rejoining this head instance for its old id.
    own = RegisterRequest(stage_id=0, replica_id=-1, follows_redirect=True, local_key="secret")
    assert _ask(master, own).replica_id == 1
    back = RegisterRequest(
        stage_id=0, replica_id=-1, follows_redirect=True, previous_head="head-1",
        previous_replica_id=0,
    )  # fmt: skip
    assert _ask(master, back).replica_id == 0
    # The owner itself hands ids out.
    assert _ask(_master(owner=None), follows).replica_id == 0


class _Heads:
    """A fake ``send``: the first head at 10.0.0.1 redirects to the owner at 10.0.0.2
    (which gives id 7) unless told otherwise; records every registration."""

    def __init__(self, owner_answers: bool = True) -> None:
        self.owner_answers = owner_answers
        self.sent: list[tuple[str, RegisterRequest]] = []

    def __call__(self, link: MasterLink, req: RegisterRequest, timeout_s: float) -> RegisterReply:
        self.sent.append((link.host, req))
        if link.host == "10.0.0.2":
            if not self.owner_answers:
                raise RegistrationError("no answer")
            return _reply(7)
        if req.follows_redirect:
            raise Redirected(B, "head-1")
        return _reply(req.replica_id if req.replica_id >= 0 else 0)


def _reply(replica_id: int) -> RegisterReply:
    return RegisterReply("tcp://h:1", "tcp://h:2", "tcp://h:3", replica_id, None)


def _registration(replica_id: int = -1, **kw: object) -> RegisterRequest:
    return RegisterRequest(
        stage_id=0,
        replica_id=replica_id,
        replica_binds_sockets=True,
        replica_bind_address="10.0.0.9",
        replica_handshake_port=1,
        replica_input_port=2,
        replica_output_port=3,
        **kw,  # type: ignore[arg-type]
    )


_OPTS = ReplicaOptions(stage_id=0, master_host="10.0.0.1", master_port=5000)
_LINK = MasterLink(None, "10.0.0.1", 5000)  # type: ignore[arg-type]


def test_a_replica_redirected_takes_its_id_from_the_owner_then_registers_with_it() -> None:
    heads = _Heads()
    reply = register_in_fleet(_OPTS, _LINK, _registration(previous_head="x"), 10.0, heads)
    assert reply.replica_id == 7
    (h1, asked), (h2, claim), (h3, again) = heads.sent
    assert (h1, h2, h3) == ("10.0.0.1", "10.0.0.2", "10.0.0.1")
    assert asked.follows_redirect and asked.replica_id == -1
    # The owner is asked for an id only: it must not dial the sockets the replica binds
    # for its first head, nor redirect again.
    assert claim.replica_id == -1 and not claim.follows_redirect
    assert claim.replica_handshake_port is None and not claim.replica_binds_sockets
    assert claim.previous_head is None
    assert (again.replica_id, again.assigned_id, again.follows_redirect) == (7, True, None)
    assert again.replica_handshake_port == 1


def test_a_replica_whose_id_owner_does_not_answer_takes_an_id_from_its_first_head() -> None:
    heads = _Heads(owner_answers=False)
    assert register_in_fleet(_OPTS, _LINK, _registration(), 10.0, heads).replica_id == 0
    assert [host for host, _ in heads.sent] == ["10.0.0.1", "10.0.0.2", "10.0.0.1"]
    last = heads.sent[-1][1]
    assert last.replica_id == -1 and not last.follows_redirect and not last.assigned_id


def test_a_replica_with_an_id_registers_once_without_following_redirects() -> None:
    heads = _Heads()
    assert register_in_fleet(_OPTS, _LINK, _registration(3), 10.0, heads).replica_id == 3
    assert len(heads.sent) == 1 and not heads.sent[0][1].follows_redirect
