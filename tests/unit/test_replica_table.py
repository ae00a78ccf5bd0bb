"""ReplicaTable: state transitions driven by an injected fake clock (no sleeping)."""

from __future__ import annotations

import pytest

from omnistage.control.replica_table import (
    TIMEOUT_REASON,
    ReplicaState,
    ReplicaTable,
    routing_id,
)

KEY = (1, 0)
TIMEOUT = 5.0
START_TIMEOUT = 30.0


class FakeClock:
    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def table(clock: FakeClock) -> ReplicaTable:
    return ReplicaTable(clock, heartbeat_timeout_s=TIMEOUT)


def register(table: ReplicaTable, key=KEY, epoch: int = 1) -> list:
    return table.register(key, epoch, "tcp://10.0.0.1:5000", False, START_TIMEOUT)


def make_up(table: ReplicaTable, key=KEY, epoch: int = 1) -> None:
    register(table, key, epoch)
    assert table.ready(key, epoch, capacity=8, pid=4242) is not None


def beat(table: ReplicaTable, seq: int, epoch: int = 1, status: str = "UP", key=KEY, **load):
    return table.heartbeat(
        key,
        epoch,
        status,
        load.get("queue_length", 0),
        load.get("in_flight", 0),
        load.get("progress", 0),
        seq,
    )


def state(table: ReplicaTable, key=KEY) -> ReplicaState:
    entry = table.get(key)
    assert entry is not None
    return entry.state


def test_non_positive_heartbeat_timeout_is_rejected(clock):
    with pytest.raises(ValueError):
        ReplicaTable(clock, heartbeat_timeout_s=0)


def test_register_creates_starting_entry_with_deadline_from_clock(table, clock):
    transitions = register(table)
    assert len(transitions) == 1
    t = transitions[0]
    assert (t.old, t.new) == (None, ReplicaState.STARTING)
    entry = table.get(KEY)
    assert entry.state == ReplicaState.STARTING
    assert entry.epoch == 1
    assert entry.registered_at == 100.0
    assert entry.start_deadline == 100.0 + START_TIMEOUT
    assert entry.identity == routing_id(1, 0, 1) == b"1.0.1"


def test_ready_moves_starting_to_up_and_records_capacity_and_pid(table, clock):
    register(table)
    clock.now = 103.0
    t = table.ready(KEY, 1, capacity=8, pid=4242)
    assert t is not None
    assert (t.old, t.new) == (ReplicaState.STARTING, ReplicaState.UP)
    entry = table.get(KEY)
    assert entry.state == ReplicaState.UP
    assert (entry.capacity, entry.pid, entry.last_seen) == (8, 4242, 103.0)


def test_second_ready_for_an_up_replica_is_ignored(table):
    make_up(table)
    assert table.ready(KEY, 1, capacity=1, pid=1) is None
    assert table.get(KEY).capacity == 8


def test_up_replica_silent_past_timeout_becomes_error_on_expire(table, clock):
    make_up(table)
    clock.now = 100.0 + TIMEOUT + 0.5
    transitions = table.expire()
    assert len(transitions) == 1
    assert (transitions[0].old, transitions[0].new) == (ReplicaState.UP, ReplicaState.ERROR)
    assert transitions[0].reason == TIMEOUT_REASON
    assert state(table) == ReplicaState.ERROR


def test_up_replica_exactly_at_timeout_boundary_stays_up(table, clock):
    make_up(table)
    clock.now = 100.0 + TIMEOUT  # now - last_seen == timeout: not past it
    assert table.expire() == []
    assert state(table) == ReplicaState.UP


def test_heartbeats_keep_an_up_replica_alive_beyond_the_timeout(table, clock):
    make_up(table)
    for seq in range(5):
        clock.now += TIMEOUT - 1
        assert beat(table, seq) is None
        assert table.expire() == []
    assert state(table) == ReplicaState.UP
    assert clock.now - 100.0 > TIMEOUT


def test_heartbeat_records_load_and_last_seen(table, clock):
    make_up(table)
    clock.now = 102.0
    beat(table, 0, queue_length=3, in_flight=7, progress=11)
    entry = table.get(KEY)
    assert (entry.queue_length, entry.in_flight, entry.progress) == (3, 7, 11)
    assert entry.last_seen == 102.0
    assert entry.heartbeat_seq == 0


def test_heartbeat_after_timeout_error_reattaches_replica_to_up(table, clock):
    make_up(table)
    clock.now += TIMEOUT + 1
    table.expire()
    assert state(table) == ReplicaState.ERROR
    t = beat(table, 0)
    assert t is not None
    assert (t.old, t.new) == (ReplicaState.ERROR, ReplicaState.UP)
    assert state(table) == ReplicaState.UP
    # It is fresh again: no immediate re-expiry.
    assert table.expire() == []


def test_error_for_another_reason_is_not_undone_by_heartbeat(table):
    make_up(table)
    t = table.mark(KEY, 1, ReplicaState.ERROR, "process exited")
    assert t is not None and t.new == ReplicaState.ERROR
    assert beat(table, 0) is None
    entry = table.get(KEY)
    assert entry.state == ReplicaState.ERROR
    assert entry.reason == "process exited"


def test_heartbeat_with_status_down_marks_replica_down(table):
    make_up(table)
    t = beat(table, 0, status="DOWN")
    assert t is not None
    assert (t.old, t.new) == (ReplicaState.UP, ReplicaState.DOWN)
    assert state(table) == ReplicaState.DOWN
    # A second goodbye is not a new transition.
    assert beat(table, 1, status="DOWN") is None


def test_down_replica_is_never_expired(table, clock):
    make_up(table)
    beat(table, 0, status="DOWN")
    clock.now += 10 * TIMEOUT
    assert table.expire() == []
    assert state(table) == ReplicaState.DOWN


def test_heartbeat_from_stale_epoch_is_ignored(table, clock):
    make_up(table, epoch=2)
    clock.now = 104.0
    assert beat(table, 0, epoch=1, status="DOWN", in_flight=9) is None
    entry = table.get(KEY)
    assert entry.state == ReplicaState.UP
    assert entry.in_flight == 0
    assert entry.last_seen == 100.0


def test_ready_from_stale_epoch_is_ignored(table):
    register(table, epoch=2)
    assert table.ready(KEY, 1, capacity=8, pid=1) is None
    assert state(table) == ReplicaState.STARTING


def test_heartbeat_for_unknown_replica_is_ignored(table):
    assert beat(table, 0, key=(9, 9)) is None
    assert table.get((9, 9)) is None


def test_out_of_order_and_duplicate_heartbeat_seq_are_ignored(table, clock):
    make_up(table)
    beat(table, 5, in_flight=5)
    clock.now = 101.0
    beat(table, 5, in_flight=99)  # duplicate
    beat(table, 3, in_flight=33)  # older
    entry = table.get(KEY)
    assert entry.heartbeat_seq == 5
    assert entry.in_flight == 5
    assert entry.last_seen == 100.0
    beat(table, 6, in_flight=6)
    assert table.get(KEY).in_flight == 6


def test_out_of_order_heartbeat_does_not_refresh_liveness(table, clock):
    make_up(table)
    beat(table, 10)
    clock.now += TIMEOUT - 1
    beat(table, 9)  # ignored: must not count as a sign of life
    clock.now = 100.0 + TIMEOUT + 0.5
    assert [t.new for t in table.expire()] == [ReplicaState.ERROR]


def test_starting_replica_past_start_deadline_becomes_error_naming_init_timeout(table, clock):
    register(table)
    clock.now = 100.0 + START_TIMEOUT
    assert table.expire() == []  # at the deadline, not past it
    clock.now += 0.5
    transitions = table.expire()
    assert len(transitions) == 1
    assert (transitions[0].old, transitions[0].new) == (ReplicaState.STARTING, ReplicaState.ERROR)
    assert "--stage-init-timeout" in transitions[0].reason
    assert state(table) == ReplicaState.ERROR


def test_starting_replica_is_not_subject_to_heartbeat_timeout(table, clock):
    register(table)
    clock.now = 100.0 + TIMEOUT * 2  # past heartbeat timeout, before start deadline
    assert table.expire() == []
    assert state(table) == ReplicaState.STARTING


def test_start_deadline_error_is_not_undone_by_heartbeat(table, clock):
    register(table)
    clock.now += START_TIMEOUT + 1
    table.expire()
    assert beat(table, 0) is None
    assert state(table) == ReplicaState.ERROR


def test_reregistering_slot_with_new_epoch_retires_old_up_entry(table):
    make_up(table, epoch=1)
    transitions = register(table, epoch=2)
    assert [(t.entry.epoch, t.old, t.new) for t in transitions] == [
        (1, ReplicaState.UP, ReplicaState.DOWN),
        (2, None, ReplicaState.STARTING),
    ]
    entry = table.get(KEY)
    assert (entry.epoch, entry.state) == (2, ReplicaState.STARTING)
    # The old incarnation is fenced off.
    assert table.ready(KEY, 1, capacity=1, pid=1) is None
    assert table.ready(KEY, 2, capacity=1, pid=1) is not None


def test_reregistering_over_error_entry_emits_only_the_new_starting(table):
    make_up(table, epoch=1)
    table.mark(KEY, 1, ReplicaState.ERROR, "process exited")
    transitions = register(table, epoch=2)
    assert [(t.old, t.new) for t in transitions] == [(None, ReplicaState.STARTING)]


def test_mark_with_epoch_none_applies_to_any_epoch(table):
    make_up(table, epoch=7)
    t = table.mark(KEY, None, ReplicaState.ERROR, "unreachable")
    assert t is not None
    assert (t.old, t.new, t.reason) == (ReplicaState.UP, ReplicaState.ERROR, "unreachable")
    assert state(table) == ReplicaState.ERROR


def test_mark_with_wrong_epoch_is_ignored(table):
    make_up(table, epoch=7)
    assert table.mark(KEY, 6, ReplicaState.ERROR, "stale") is None
    assert state(table) == ReplicaState.UP


def test_mark_to_same_state_or_from_down_is_not_a_transition(table):
    make_up(table)
    assert table.mark(KEY, None, ReplicaState.UP, "again") is None
    beat(table, 0, status="DOWN")
    assert table.mark(KEY, None, ReplicaState.ERROR, "late") is None
    assert state(table) == ReplicaState.DOWN


def test_remove_only_removes_matching_epoch(table):
    make_up(table, epoch=3)
    table.remove(KEY, 2)
    assert table.get(KEY) is not None
    table.remove(KEY, 3)
    assert table.get(KEY) is None


def test_snapshot_is_sorted_and_returns_copies(table):
    make_up(table, key=(2, 0))
    make_up(table, key=(0, 1))
    make_up(table, key=(0, 0))
    snap = table.snapshot()
    assert [e.key for e in snap] == [(0, 0), (0, 1), (2, 0)]
    snap[0].state = ReplicaState.DOWN
    snap[0].in_flight = 1000
    entry = table.get((0, 0))
    assert entry.state == ReplicaState.UP
    assert entry.in_flight == 0


def test_transition_entry_is_a_snapshot_not_the_live_entry(table):
    make_up(table)
    t = beat(table, 0, status="DOWN")
    t.entry.state = ReplicaState.UP
    assert state(table) == ReplicaState.DOWN


def test_draining_heartbeat_takes_the_replica_out_of_rotation_until_down() -> None:
    from omnistage.control.replica_table import ReplicaState, ReplicaTable

    now = [0.0]
    table = ReplicaTable(lambda: now[0], heartbeat_timeout_s=5)
    table.register((0, 0), 1, "127.0.0.1", False, 60)
    table.ready((0, 0), 1, 4, 123)
    t = table.heartbeat((0, 0), 1, "DRAINING", 0, 1, 0, seq=1)
    assert t is not None and t.new == ReplicaState.DRAINING
    now[0] = 6.0  # a silent draining replica still expires
    (expired,) = table.expire()
    assert expired.new == ReplicaState.ERROR
    table.heartbeat((0, 0), 1, "DRAINING", 0, 0, 0, seq=2)
    down = table.heartbeat((0, 0), 1, "DOWN", 0, 0, 0, seq=3)
    assert down is not None and down.new == ReplicaState.DOWN
