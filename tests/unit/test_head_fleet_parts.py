"""The pieces of a fleet of heads without sockets: the fleet view (pure, with a fake
clock), a replica's admission across its heads (real runners on a real echo engine), and
the stage pool's view of what other heads hold on a replica."""

from __future__ import annotations

import time

from omnistage.config.schema import StageConfig
from omnistage.control.balancing import make_policy
from omnistage.control.fleet import FleetView, PeerChange
from omnistage.control.replica_table import ReplicaEntry, Transition
from omnistage.dataplane.stage_pool import StagePool
from omnistage.engines import build_engine
from omnistage.head.fleet import HeadFleet
from omnistage.protocol.enums import ErrorKind
from omnistage.protocol.messages import AddRequest, Prompt, Reason, ReplicaState
from omnistage.replica.fleet import Admission
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


def _entry(rid: int, others: int = 0) -> ReplicaEntry:
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
        others=others,
    )


async def test_the_pool_routes_around_what_other_heads_hold_and_falls_back_when_all_full() -> None:
    pool = StagePool(0, "s", make_policy("round-robin"))
    for rid in (0, 1):
        pool.apply(Transition(_entry(rid), ReplicaState.STARTING, ReplicaState.UP, Reason.READY))
    pool.observe(_entry(0, others=2))  # the other heads fill replica 0
    picked = {pool.try_acquire(f"r{i}").replica_id for i in range(2)}  # type: ignore[union-attr]
    assert picked == {1}
    # Replica 1 is full by this head's own count; replica 0 is full only by a heartbeat-
    # old count of the others': try it (it refuses if it is still full).
    handle = pool.try_acquire("r2")
    assert handle is not None and handle.replica_id == 0
    pool.busy(handle)
    assert handle.others == handle.capacity
    pool.observe(_entry(0, others=0))
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
