"""ReplicaTable: state transitions driven by an injected fake clock (no sleeping)."""

from __future__ import annotations

import pytest

from omnistage.control.replica_table import LoadReading, ReplicaTable
from omnistage.protocol.messages import Reason, ReplicaState, routing_id

TIMEOUT_REASON = Reason.HEARTBEAT_TIMEOUT
STALL_REASON = Reason.STALLED

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


def test_ready_records_what_the_engine_computes_on(table):
    register(table)
    assert table.ready(KEY, 1, capacity=8, pid=4242, kernel="int4-avx2") is not None
    assert table.get(KEY).kernel == "int4-avx2"


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


def test_loads_carry_each_replicas_last_reported_queue_and_other_heads_count(table):
    make_up(table)
    make_up(table, key=(1, 1), epoch=2)
    table.heartbeat(KEY, 1, "UP", 3, 5, 0, seq=0, others=4)
    table.heartbeat((1, 1), 2, "UP", 0, 0, 0, seq=0, others=0)  # nothing new
    assert table.loads() == [
        LoadReading(stage_id=1, replica_id=0, epoch=1, queue_length=3, others=4),
    ]


def test_loads_name_only_the_replicas_whose_load_changed_since_the_last_read(table):
    make_up(table)
    make_up(table, key=(1, 1), epoch=2)
    assert table.loads() == []  # a fleet at rest: nothing to refresh
    table.heartbeat(KEY, 1, "UP", 2, 2, 0, seq=0)
    table.heartbeat((1, 1), 2, "UP", 0, 0, 0, seq=0, others=1)
    table.heartbeat(KEY, 1, "UP", 1, 1, 0, seq=1)  # changed twice: read once, as last
    assert sorted(table.loads()) == [
        LoadReading(stage_id=1, replica_id=0, epoch=1, queue_length=1, others=0),
        LoadReading(stage_id=1, replica_id=1, epoch=2, queue_length=0, others=1),
    ]
    assert table.loads() == []
    table.heartbeat(KEY, 1, "UP", 1, 1, 0, seq=2)  # the same figures again
    assert table.loads() == []
    table.heartbeat(KEY, 1, "UP", 0, 0, 0, seq=3)
    table.remove(KEY, 1)  # gone before the read: nothing to say of it
    assert table.loads() == []


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
    t = table.mark(KEY, 1, ReplicaState.ERROR, Reason.PROCESS_EXITED)
    assert t is not None and t.new == ReplicaState.ERROR
    assert beat(table, 0) is None
    entry = table.get(KEY)
    assert entry.state == ReplicaState.ERROR
    assert entry.reason == Reason.PROCESS_EXITED


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
    table.mark(KEY, 1, ReplicaState.ERROR, Reason.PROCESS_EXITED)
    transitions = register(table, epoch=2)
    assert [(t.old, t.new) for t in transitions] == [(None, ReplicaState.STARTING)]


def test_mark_with_epoch_none_applies_to_any_epoch(table):
    make_up(table, epoch=7)
    t = table.mark(KEY, None, ReplicaState.ERROR, Reason.UNREACHABLE)
    assert t is not None
    assert (t.old, t.new, t.reason) == (ReplicaState.UP, ReplicaState.ERROR, Reason.UNREACHABLE)
    assert state(table) == ReplicaState.ERROR


def test_mark_with_wrong_epoch_is_ignored(table):
    make_up(table, epoch=7)
    assert table.mark(KEY, 6, ReplicaState.ERROR, Reason.UNREACHABLE) is None
    assert state(table) == ReplicaState.UP


def test_mark_to_same_state_or_from_down_is_not_a_transition(table):
    make_up(table)
    assert table.mark(KEY, None, ReplicaState.UP, Reason.READY) is None
    beat(table, 0, status="DOWN")
    assert table.mark(KEY, None, ReplicaState.ERROR, Reason.UNREACHABLE) is None
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
    from omnistage.control.replica_table import ReplicaTable
    from omnistage.protocol.messages import ReplicaState

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


# -- stall detection ---------------------------------------------------------------------

STALL = 20.0  # >= TIMEOUT, as the CLI requires


@pytest.fixture
def stall_table(clock: FakeClock) -> ReplicaTable:
    return ReplicaTable(clock, heartbeat_timeout_s=TIMEOUT, stall_timeout_s=STALL)


def beat_every(table: ReplicaTable, clock: FakeClock, first_seq: int, until: float, **load):
    """Heartbeat every TIMEOUT - 1 seconds (never silent) until ``until``, expiring after
    each beat as the coordinator's tick does; returns every transition seen, and the next
    heartbeat seq."""
    seen = []
    seq = first_seq
    while clock.now + TIMEOUT - 1 <= until:
        clock.now += TIMEOUT - 1
        t = beat(table, seq, **load)
        seq += 1
        if t is not None:
            seen.append(t)
        seen.extend(table.expire())
    return seen, seq


def test_stalled_replica_with_work_goes_error_after_the_stall_timeout(stall_table, clock):
    make_up(stall_table)
    clock.now = 101.0
    beat(stall_table, 0, in_flight=2, progress=7)  # progress moved (0 -> 7) at 101
    # Heartbeats keep arriving, so silence never fires; only the engine is stuck.
    seen, _ = beat_every(stall_table, clock, 1, 101.0 + STALL, in_flight=2, progress=7)
    assert seen == []
    clock.now = 101.0 + STALL  # exactly at the stall timeout: not past it
    assert stall_table.expire() == []
    clock.now += 0.5
    (t,) = stall_table.expire()
    assert (t.old, t.new, t.reason) == (ReplicaState.UP, ReplicaState.ERROR, STALL_REASON)
    assert "--omni-stall-timeout" in t.reason
    assert state(stall_table) == ReplicaState.ERROR


def test_replica_whose_progress_keeps_moving_never_stalls(stall_table, clock):
    make_up(stall_table)
    for seq in range(40):  # 40 * 4s = 8 stall timeouts of steady (slow) progress
        clock.now += TIMEOUT - 1
        assert beat(stall_table, seq, in_flight=3, progress=seq + 1) is None
        assert stall_table.expire() == []
    assert state(stall_table) == ReplicaState.UP


def test_idle_replica_never_stalls(stall_table, clock):
    make_up(stall_table)
    seen, _ = beat_every(stall_table, clock, 0, 100.0 + 10 * STALL, in_flight=0, progress=5)
    assert seen == []
    assert state(stall_table) == ReplicaState.UP


def test_the_stall_clock_starts_when_work_arrives_not_at_the_last_progress(stall_table, clock):
    make_up(stall_table)
    # Idle for a long time at the same progress value ...
    seen, seq = beat_every(stall_table, clock, 0, 100.0 + 5 * STALL, in_flight=0, progress=5)
    assert seen == []
    last_idle = clock.now
    # ... then it takes a request: that is not a stall yet, though progress last
    # changed long ago.
    clock.now += 1
    assert beat(stall_table, seq, in_flight=1, progress=5) is None
    assert stall_table.expire() == []
    clock.now = last_idle + STALL + 0.5
    assert [t.new for t in stall_table.expire()] == [ReplicaState.ERROR]


def test_stall_timeout_zero_disables_stall_detection(table, clock):
    assert table.stall_timeout_s == 0
    make_up(table)
    seen, _ = beat_every(table, clock, 0, 100.0 + 100 * TIMEOUT, in_flight=4, progress=1)
    assert seen == []
    assert state(table) == ReplicaState.UP


def test_stalled_replica_is_not_set_back_to_up_by_later_heartbeats(stall_table, clock):
    make_up(stall_table)
    beat(stall_table, 0, in_flight=1, progress=1)
    clock.now += STALL + 1
    beat(stall_table, 1, in_flight=1, progress=1)
    assert [t.reason for t in stall_table.expire()] == [STALL_REASON]
    # Its heartbeat thread is alive, and even a moving counter or an empty hand does
    # not bring it back: heartbeats say nothing about whether the engine is sane.
    clock.now += 1
    assert beat(stall_table, 2, in_flight=1, progress=1) is None
    clock.now += 1
    assert beat(stall_table, 3, in_flight=1, progress=2) is None
    clock.now += 1
    assert beat(stall_table, 4, in_flight=0, progress=2) is None
    assert stall_table.expire() == []  # and it is not reported again
    entry = stall_table.get(KEY)
    assert (entry.state, entry.reason) == (ReplicaState.ERROR, STALL_REASON)


def test_silence_is_still_forgiven_with_stall_detection_on(stall_table, clock):
    make_up(stall_table)
    beat(stall_table, 0, in_flight=1, progress=1)
    clock.now += TIMEOUT + 1
    assert [t.reason for t in stall_table.expire()] == [TIMEOUT_REASON]
    t = beat(stall_table, 1, in_flight=1, progress=2)
    assert t is not None and (t.old, t.new) == (ReplicaState.ERROR, ReplicaState.UP)


def test_silence_is_reported_as_silence_not_as_a_stall(stall_table, clock):
    # Both clocks ran out: the replica is silent, and silence is the forgivable reason.
    make_up(stall_table)
    beat(stall_table, 0, in_flight=1, progress=1)
    clock.now += STALL + 1
    assert [t.reason for t in stall_table.expire()] == [TIMEOUT_REASON]


def test_draining_replica_that_stalls_goes_error(stall_table, clock):
    make_up(stall_table)
    t = beat(stall_table, 0, status="DRAINING", in_flight=1, progress=3)
    assert t is not None and t.new == ReplicaState.DRAINING
    seen, _ = beat_every(
        stall_table, clock, 1, 100.0 + STALL + TIMEOUT, status="DRAINING", in_flight=1, progress=3
    )
    assert [(t.old, t.new, t.reason) for t in seen] == [
        (ReplicaState.DRAINING, ReplicaState.ERROR, STALL_REASON)
    ]


def test_a_long_pause_with_work_in_hand_is_forgiven_like_any_silence(stall_table, clock):
    # A whole-process pause (GC, SIGSTOP, swapped out) longer than the stall timeout:
    # it goes ERROR for silence and the head moves its requests elsewhere (and sends
    # it Aborts). Its first heartbeat back may still count those requests in flight,
    # at the progress value from before the pause. Taking it back must not turn
    # straight into a stall, which, unlike silence, is never forgiven.
    make_up(stall_table)
    beat(stall_table, 0, in_flight=2, progress=9)
    clock.now += STALL + TIMEOUT
    assert [t.reason for t in stall_table.expire()] == [TIMEOUT_REASON]
    t = beat(stall_table, 1, in_flight=2, progress=9)
    assert t is not None and t.new == ReplicaState.UP
    assert stall_table.expire() == []
    assert state(stall_table) == ReplicaState.UP


def test_a_replica_taken_back_after_silence_that_still_makes_no_progress_stalls(stall_table, clock):
    # The forgiveness above only restarts the stall clock: a wedged engine is still
    # caught one stall timeout after the replica came back.
    make_up(stall_table)
    beat(stall_table, 0, in_flight=2, progress=9)
    clock.now += STALL + TIMEOUT
    stall_table.expire()
    back = clock.now
    assert beat(stall_table, 1, in_flight=2, progress=9) is not None
    seen, _ = beat_every(stall_table, clock, 2, back + STALL, in_flight=2, progress=9)
    assert seen == []
    clock.now = back + STALL + 0.5
    assert [t.reason for t in stall_table.expire()] == [STALL_REASON]


def test_expire_looks_only_at_replicas_due_and_keeps_one_look_queued_each(stall_table, clock):
    keys = [(1, r) for r in range(200)]
    for key in keys:
        make_up(stall_table, key=key)
    # Every replica beats each second for a minute, its work coming and going (each
    # arrival may queue an earlier look for a stall); the tick expires after each beat.
    for seq in range(60):
        clock.now += 1.0
        for key in keys:
            beat(stall_table, seq, key=key, in_flight=seq % 2, progress=seq)
        assert stall_table.expire() == []
    assert len(stall_table._queued) == len(keys)  # one live look each
    assert len(stall_table._due) <= 3 * len(keys)  # and few replaced ones left behind
    # One falls silent: found once its timeout is past, the others untouched.
    clock.now += TIMEOUT + 0.5
    for key in keys[1:]:
        beat(stall_table, 60, key=key)
    (t,) = stall_table.expire()
    assert (t.entry.key, t.new, t.reason) == (keys[0], ReplicaState.ERROR, TIMEOUT_REASON)
    assert keys[0] not in stall_table._queued  # ERROR: no more looks
