"""The pieces of a fleet of heads without sockets: the fleet view (pure, with a fake
clock), a replica's admission across its heads (real runners on a real echo engine), and
the stage pool's view of what other heads hold on a replica."""

from __future__ import annotations

import threading
import time

import pytest

from omnistage.config.schema import StageConfig
from omnistage.control.balancing import make_policy
from omnistage.control.head_peers import FleetView, PeerChange
from omnistage.control.master import HeadAddresses, Master
from omnistage.control.replica_table import LoadReading, ReplicaEntry, Transition
from omnistage.control.slots import SlotTable
from omnistage.dataplane.stage_pool import StagePool
from omnistage.engines import build_engine
from omnistage.head.gossip import HeadFleet
from omnistage.protocol import codec
from omnistage.protocol.enums import ErrorKind
from omnistage.protocol.errors import IdConflict, ProtocolError
from omnistage.protocol.messages import (
    PROTOCOL_VERSION,
    AddRequest,
    HeadAnnounce,
    Prompt,
    Reason,
    ReplicaState,
)
from omnistage.protocol.registration import RegisterReply, RegisterRequest
from omnistage.replica.admission import Admission
from omnistage.replica.options import ReplicaOptions
from omnistage.replica.register import INSTANCE, gives_way, wire_map
from omnistage.replica.requests import RequestRunner
from tests.unit.fakes import FakeClock, others_done, until
from tests.unit.test_request_runner import Recorder

A, B, C = "tcp://10.0.0.1:5000", "tcp://10.0.0.2:5000", "tcp://10.0.0.3:5000"


def _view(clock: FakeClock) -> FleetView:
    return FleetView(A, "inst-a", clock, down_after_s=5.0, forget_after_s=60.0)


def test_a_head_alone_tells_replicas_no_heads() -> None:
    view = _view(FakeClock())
    assert view.heads() == [] and view.peers() == []
    # Its own address given back (a join to itself) changes nothing.
    assert view.heard(A, "inst-a", [A]) is None
    assert view.heads() == []


def test_heads_named_by_a_peer_are_learned_and_all_told_to_replicas_self_first() -> None:
    clock = FakeClock()
    view = _view(clock)
    change = view.heard(B, "inst-b", [C, A])
    assert change == PeerChange(B, "inst-b", up=True)
    assert view.peers() == [B, C]
    assert view.heads() == [A, B, C]
    rows = {r["address"]: r["state"] for r in view.snapshot()}
    assert rows == {A: "UP", B: "UP", C: "DOWN"}  # C only named, not heard yet


def test_a_silent_head_goes_down_then_is_forgotten_and_a_restart_is_news() -> None:
    clock = FakeClock()
    view = _view(clock)
    view.heard(B, "inst-b", [])
    version = view.version
    clock.now += 4.0
    assert view.expire() == []
    clock.now += 2.0
    assert view.expire() == [PeerChange(B, "inst-b", up=False)]
    # Still told to replicas while DOWN: they are back with it the moment it returns.
    assert view.heads() == [A, B] and view.version == version
    assert view.heard(B, "inst-b2", []) == PeerChange(B, "inst-b2", up=True)
    assert view.heard(B, "inst-b2", []) is None  # nothing new
    clock.now += 6.0
    view.expire()
    clock.now += 61.0
    assert view.expire() == [PeerChange(B, "inst-b2", up=False, forgotten=True)]
    assert view.heads() == [] and view.version > version


def _runners(n: int, capacity: int) -> tuple[list[RequestRunner], list[Recorder]]:
    stage = StageConfig(
        stage_id=0,
        name="echo",
        engine="echo",
        engine_args={"num_chunks": 4, "chunk_delay_s": 0.05},
        max_inflight_per_replica=capacity,
    )
    engine = build_engine(stage)
    admission = Admission()
    runners, outs = [], []
    for _ in range(n):
        runner = RequestRunner(0, engine, lambda _why: None, FakeClock())
        runner.admission = admission
        admission.runners.append(runner)
        out = Recorder()
        runner.bind(replica_id=0, epoch=1, outlet=out)
        runners.append(runner)
        outs.append(out)
    return runners, outs


def _add(rid: str) -> AddRequest:
    return AddRequest(rid, Prompt(text="abcd"), [], {})  # type: ignore[arg-type]


async def test_a_replica_serving_two_heads_refuses_as_busy_beyond_its_capacity() -> None:
    (one, two), (out_one, out_two) = _runners(2, capacity=2)
    one.handle(_add("a1"))
    two.handle(_add("b1"))
    assert one.admission is not None and one.admission.in_flight() == 2
    assert one.admission.others(one) == 1
    two.handle(_add("b2"))  # the third: full
    await until(lambda: any(c.request_id == "b2" for c in out_two.head))
    (refusal,) = [c for c in out_two.head if c.request_id == "b2"]
    assert refusal.finished and refusal.error_kind == ErrorKind.BUSY
    assert "b2" not in two.requests
    await others_done()
    # Both admitted requests ran to the end, untouched by the refusal.
    for out, rid in ((out_one, "a1"), (out_two, "b1")):
        mine = [c for c in out.head if c.request_id == rid]
        assert mine[-1].finished and mine[-1].error is None


async def test_a_replica_serving_one_head_leaves_admission_to_that_head() -> None:
    (only,), (out,) = _runners(1, capacity=1)
    only.handle(_add("r1"))
    only.handle(_add("r2"))  # one head never sends more than capacity; if it does, run it
    await others_done()
    assert {c.request_id for c in out.head if c.finished and c.error is None} == {"r1", "r2"}


def _entry(rid: int) -> ReplicaEntry:
    return ReplicaEntry(
        stage_id=0,
        replica_id=rid,
        epoch=1,
        state=ReplicaState.UP,
        address="127.0.0.1",
        local=False,
        registered_at=0.0,
        last_seen=0.0,
        start_deadline=0.0,
        capacity=2,
    )


def _load(rid: int, others: int) -> LoadReading:
    return LoadReading(stage_id=0, replica_id=rid, epoch=1, queue_length=0, others=others)


async def test_the_pool_routes_around_what_other_heads_hold_and_falls_back_when_all_full() -> None:
    pool = StagePool(0, "s", make_policy("round-robin"))
    for rid in (0, 1):
        pool.apply(Transition(_entry(rid), ReplicaState.STARTING, ReplicaState.UP, Reason.READY))
    pool.observe(_load(0, others=2))  # the other heads fill replica 0
    picked = {pool.try_acquire(f"r{i}").replica_id for i in range(2)}  # type: ignore[union-attr]
    assert picked == {1}
    # Replica 1 is full by this head's own count; replica 0 is full only by a heartbeat-
    # old count of the others': try it (it refuses if it is still full).
    handle = pool.try_acquire("r2")
    assert handle is not None and handle.replica_id == 0
    pool.busy(handle)
    assert handle.others == handle.capacity
    pool.observe(_load(0, others=0))
    assert handle.others == 0
    pool.observe(LoadReading(0, 0, 2, 0, others=2))  # another incarnation's: not this one's
    assert handle.others == 0


def test_a_head_alone_idles_without_spinning() -> None:
    # No --omni-join and no peer: the announcing thread has nothing to poll. It must
    # sleep, not spin on an empty poller (which returns at once).
    fleet = HeadFleet(FleetView(A, "inst-a", time.monotonic, 5.0), interval_s=0.05)
    before = time.process_time()
    fleet.start()
    time.sleep(0.5)
    fleet.stop()
    used = time.process_time() - before
    assert used < 0.2, f"the announcing thread used {used:.2f} CPU-s in 0.5 s"


def test_a_head_keeps_announcing_to_its_join_target_when_another_head_found_it_first() -> None:
    # B (of another fleet) announced to us before we reached C, the head we were told to
    # join: C must still hear from us, or the two fleets never merge.
    fleet = HeadFleet(FleetView(A, "inst-a", FakeClock(), 5.0), interval_s=1.0, join=C)
    assert fleet._targets() == [C]
    fleet.answer([b"id", *codec.sign(codec.encode(HeadAnnounce(B, "inst-b", [])), None)])
    assert fleet._targets() == [B, C]
    fleet.answer([b"id", *codec.sign(codec.encode(HeadAnnounce(C, "inst-c", [B])), None)])
    assert fleet._targets() == [B, C]  # C is a peer now: asked once, as a peer


# -- replica ids across heads: a conflict, and the replica that gives way -------------------


def _master(moved: list[tuple[int, int, int]]) -> Master:
    addresses = HeadAddresses("tcp://h:1", "tcp://h:2", "tcp://h:3", "tcp://h:4")
    return Master(
        SlotTable([0]),
        addresses,
        lambda slot, req: None,
        threading.Lock(),
        on_moved=lambda *args: moved.append(args),
    )


def _ask(master: Master, req: RegisterRequest) -> RegisterReply:
    frames = master.handle([b"peer", codec.encode_register_request(wire_map(req), None)])
    assert frames is not None and frames[0] == b"peer"
    return codec.decode_register_reply(frames[-1])


def test_a_registration_of_another_protocol_version_is_refused_and_one_without_is_not() -> None:
    master = _master([])
    older = RegisterRequest(stage_id=0, replica_id=-1, protocol_version=PROTOCOL_VERSION - 1)
    with pytest.raises(ProtocolError, match=f"this head speaks {PROTOCOL_VERSION}"):
        _ask(master, older)
    # A seed client states none: its map is the one this head reads.
    assert _ask(master, RegisterRequest(stage_id=0, replica_id=-1)).replica_id == 0
    stated = RegisterRequest(stage_id=0, replica_id=-1, protocol_version=PROTOCOL_VERSION)
    assert _ask(master, stated).protocol_version == PROTOCOL_VERSION


def test_a_head_refuses_an_id_another_head_gave_out_and_names_its_holder() -> None:
    moved: list[tuple[int, int, int]] = []
    master = _master(moved)
    auto = RegisterRequest(stage_id=0, replica_id=-1, replica_instance="bbbb")
    assert _ask(master, auto).replica_id == 0
    # Another replica was given id 0 by another head at the same time.
    other = RegisterRequest(stage_id=0, replica_id=0, replica_instance="aaaa", assigned_id=True)
    with pytest.raises(IdConflict) as err:
        _ask(master, other)
    assert err.value.held_by == "bbbb"
    assert moved == []


def test_a_replica_registering_again_under_a_new_id_lets_its_old_slot_go_at_once() -> None:
    moved: list[tuple[int, int, int]] = []
    master = _master(moved)
    req = RegisterRequest(stage_id=0, replica_id=-1, replica_instance="bbbb")
    first = _ask(master, req)
    # It gives way: a fresh registration while its old slot is still filled.
    second = _ask(master, req)
    assert second.replica_id != first.replica_id
    assert moved == [(0, first.replica_id, first.epoch)]
    # A replica registering for the same id again (a rejoin) has not moved.
    _ask(master, RegisterRequest(stage_id=0, replica_id=second.replica_id, replica_instance="bbbb"))
    assert len(moved) == 1


def _opts(replica_id: int = -1) -> ReplicaOptions:
    return ReplicaOptions(stage_id=0, master_host="127.0.0.1", master_port=1, replica_id=replica_id)


def test_of_two_replicas_given_one_id_exactly_one_gives_way() -> None:
    lower, higher = sorted([INSTANCE, "0" * len(INSTANCE), "f" * len(INSTANCE)])[::2]
    # Seen from this process: a holder with a lower instance keeps the id, we move.
    assert gives_way(_opts(), IdConflict("held", held_by=lower))
    assert not gives_way(_opts(), IdConflict("held", held_by=higher))
    # A head's own replica always keeps its id; an operator's id (--replica-id) waits.
    assert gives_way(_opts(), IdConflict("reserved", held_by=""))
    assert not gives_way(_opts(replica_id=3), IdConflict("held", held_by=lower))
    assert not gives_way(_opts(replica_id=3), IdConflict("reserved", held_by=""))
