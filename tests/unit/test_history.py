"""The head's recent state changes and restart counts (pure, fake clock)."""

from __future__ import annotations

from omnistage.control.replica_table import ReplicaEntry, Transition
from omnistage.head.history import History
from omnistage.protocol.messages import Reason, ReplicaState


def _t(sid: int, rid: int, epoch: int, old: ReplicaState | None, new: ReplicaState) -> Transition:
    entry = ReplicaEntry(sid, rid, epoch, new, "tcp://h:1", True, 0.0, 0.0, 0.0)
    reason = Reason.PROCESS_EXITED if new == ReplicaState.ERROR else Reason.NONE
    return Transition(entry, old, new, reason, "exit code -9" if reason else "")


def test_changes_come_newest_first_with_their_time_and_reason() -> None:
    now = [100.0]
    h = History({0: "thinker", 1: "talker"}, clock=lambda: now[0])
    h.changed(_t(1, 0, 1, ReplicaState.STARTING, ReplicaState.UP))
    now[0] = 105.5
    h.changed(_t(1, 0, 1, ReplicaState.UP, ReplicaState.ERROR))
    newest, oldest = h.recent()
    assert newest["time"] == 105.5 and newest["state"] == "ERROR" and newest["old"] == "UP"
    assert "exit code -9" in newest["reason"] and newest["stage"] == "talker"
    assert oldest["state"] == "UP" and oldest["time"] == 100.0


def test_the_ring_is_bounded_and_restarts_are_counted_per_replica() -> None:
    h = History({0: "s"}, clock=lambda: 0.0, max_changes=3)
    for epoch in range(5):
        h.changed(_t(0, 0, epoch, None, ReplicaState.UP))
    assert [c["epoch"] for c in h.recent()] == [4, 3, 2]
    assert [c["epoch"] for c in h.recent(limit=1)] == [4]
    h.restarted(0, 0)
    h.restarted(0, 0)
    h.restarted(0, 1)
    assert h.restarts[(0, 0)] == 2 and h.restarts[(0, 1)] == 1 and h.restarts[(0, 2)] == 0
