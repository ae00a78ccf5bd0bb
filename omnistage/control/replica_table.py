"""The replica table: who serves each stage and in what state. Pure state.

No sockets, no threads, no wall clock: time comes from the injected ``clock`` so expiry
is unit-testable without sleeping. The coordinator wraps it with a lock.

States (``protocol.messages.ReplicaState``): STARTING (registered, engine loading) -> UP
(READY received, taking traffic) -> ERROR (silent past the heartbeat timeout, stalled,
failed, or process exited) or DOWN (said goodbye). An ERROR replica that heartbeats
again after *silence* returns to UP: a network blip or a long GC pause must not retire
a healthy replica for good.

A replica is stalled when it holds work but its engine's progress counter (in every
heartbeat) has not moved for the stall timeout: its heartbeat thread is alive, its
engine is not. That is not forgiven by heartbeats, which say nothing about the engine.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from omnistage.protocol.messages import Reason, ReplicaState, routing_id

ReplicaKey = tuple[int, int]  # (stage_id, replica_id)


class LoadReading(NamedTuple):
    """What a replica's last heartbeat said of its load, for the balancer's once-a-beat
    refresh: a few fields, not a copy of the whole entry (at 5,000 replicas, copying
    every entry each second cost ~10-16 ms under the coordinator's lock)."""

    stage_id: int
    replica_id: int
    epoch: int
    queue_length: int
    others: int


@dataclass
class ReplicaEntry:
    stage_id: int
    replica_id: int
    epoch: int
    state: ReplicaState
    address: str
    local: bool
    registered_at: float
    last_seen: float
    start_deadline: float
    capacity: int = 0
    queue_length: int = 0
    in_flight: int = 0
    progress: int = 0
    heartbeat_seq: int = -1
    reason: Reason = Reason.NONE
    detail: str = ""  # what the reason alone does not say (an exit code, say)
    pid: int = 0
    # Where other replicas push this one's inputs (see Ready.peer_address).
    peer_address: str = ""
    host_key: str = ""  # which shared memory it sees (see Ready.host_key)
    # When progress last moved (or the replica last held no work): the stall clock.
    progress_at: float = 0.0
    starting: str = ""  # while STARTING: what the engine's start is doing
    kernel: str = ""  # what its engine computes on (Ready.kernel)
    # Requests it holds for the fleet's other heads (Heartbeat.others).
    others: int = 0

    @property
    def key(self) -> ReplicaKey:
        return (self.stage_id, self.replica_id)

    @property
    def identity(self) -> bytes:
        """Routing id of this incarnation on the head's input socket."""
        return routing_id(self.stage_id, self.replica_id, self.epoch)

    @property
    def why(self) -> str:
        return describe(self.reason, self.detail)


def describe(reason: Reason, detail: str = "") -> str:
    """The text operators read for a reason and its detail."""
    return f"{reason.value} ({detail})" if detail else reason.value


@dataclass(frozen=True)
class Transition:
    entry: ReplicaEntry  # a snapshot taken after the change
    old: ReplicaState | None
    new: ReplicaState
    reason: Reason
    detail: str = ""

    @property
    def why(self) -> str:
        return describe(self.reason, self.detail)


class ReplicaTable:
    def __init__(
        self,
        clock: Callable[[], float],
        heartbeat_timeout_s: float,
        stall_timeout_s: float = 0.0,
    ) -> None:
        if heartbeat_timeout_s <= 0:
            raise ValueError("heartbeat_timeout_s must be > 0")
        self._clock = clock
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.stall_timeout_s = stall_timeout_s  # 0: never judge progress
        self._entries: dict[ReplicaKey, ReplicaEntry] = {}

    def get(self, key: ReplicaKey) -> ReplicaEntry | None:
        return self._entries.get(key)

    def snapshot(self) -> list[ReplicaEntry]:
        return [dataclasses.replace(self._entries[k]) for k in sorted(self._entries)]

    def loads(self) -> list[LoadReading]:
        return [
            LoadReading(e.stage_id, e.replica_id, e.epoch, e.queue_length, e.others)
            for e in self._entries.values()
        ]

    def register(
        self,
        key: ReplicaKey,
        epoch: int,
        address: str,
        local: bool,
        start_timeout_s: float,
    ) -> list[Transition]:
        """A replica registered; a previous incarnation of the slot is retired."""
        now = self._clock()
        out: list[Transition] = []
        old = self._entries.get(key)
        if (
            old is not None
            and old.epoch != epoch
            and old.state
            in (
                ReplicaState.UP,
                ReplicaState.STARTING,
            )
        ):
            out.append(self._set(old, ReplicaState.DOWN, Reason.REPLACED))
        entry = ReplicaEntry(
            stage_id=key[0],
            replica_id=key[1],
            epoch=epoch,
            state=ReplicaState.STARTING,
            address=address,
            local=local,
            registered_at=now,
            last_seen=now,
            start_deadline=now + start_timeout_s,
        )
        self._entries[key] = entry
        out.append(Transition(dataclasses.replace(entry), None, ReplicaState.STARTING, Reason.NONE))
        return out

    def ready(
        self,
        key: ReplicaKey,
        epoch: int,
        capacity: int,
        pid: int,
        peer_address: str = "",
        kernel: str = "",
        host_key: str = "",
    ) -> Transition | None:
        entry = self._current(key, epoch)
        if entry is None or entry.state != ReplicaState.STARTING:
            return None
        entry.capacity = capacity
        entry.pid = pid
        entry.peer_address = peer_address
        entry.kernel = kernel
        entry.host_key = host_key
        entry.starting = ""
        # The session's heartbeats count their own sequence from 1 (the loading ones
        # had another thread's numbers).
        entry.heartbeat_seq = -1
        entry.last_seen = entry.progress_at = self._clock()
        return self._set(entry, ReplicaState.UP, Reason.READY)

    def heartbeat(
        self,
        key: ReplicaKey,
        epoch: int,
        status: ReplicaState,
        queue_length: int,
        in_flight: int,
        progress: int,
        seq: int,
        detail: str = "",
        others: int = 0,
    ) -> Transition | None:
        """Record a heartbeat; stale epochs and out-of-order sequence numbers are ignored."""
        entry = self._current(key, epoch)
        if entry is None or seq <= entry.heartbeat_seq:
            return None
        entry.heartbeat_seq = seq
        entry.last_seen = self._clock()
        if entry.state == ReplicaState.STARTING:
            # The loading engine's heartbeats: only what it is doing is news.
            entry.starting = detail
            return None
        if progress != entry.progress or in_flight == 0:
            entry.progress_at = entry.last_seen
        entry.queue_length = queue_length
        entry.in_flight = in_flight
        entry.others = others
        entry.progress = progress
        if status == ReplicaState.DOWN:
            if entry.state != ReplicaState.DOWN:
                return self._set(entry, ReplicaState.DOWN, Reason.SHUT_DOWN)
            return None
        silent = entry.state == ReplicaState.ERROR and entry.reason == Reason.HEARTBEAT_TIMEOUT
        if status == ReplicaState.DRAINING:
            if entry.state == ReplicaState.UP or silent:
                return self._set(entry, ReplicaState.DRAINING, Reason.DRAINING)
            return None
        if silent:
            # Only silence is forgiven; a replica that failed for another reason
            # (process exit, engine error) does not come back by heartbeating.
            # The stall clock restarts too: the pause counted as silence, its work was
            # moved away, and until its Aborts land it still reports that work at the
            # old progress value, which must not read as a stall (never forgiven).
            entry.progress_at = entry.last_seen
            return self._set(entry, ReplicaState.UP, Reason.HEARTBEATS_RESUMED)
        return None

    def state_of(self, key: ReplicaKey, epoch: int) -> ReplicaState | None:
        """The state of that incarnation; None when the table has no such incarnation."""
        entry = self._current(key, epoch)
        return entry.state if entry is not None else None

    def mark(
        self,
        key: ReplicaKey,
        epoch: int | None,
        state: ReplicaState,
        reason: Reason,
        detail: str = "",
    ) -> Transition | None:
        """Force a state (process exit, unreachable socket). ``epoch=None`` means any."""
        entry = self._entries.get(key)
        if entry is None or (epoch is not None and entry.epoch != epoch):
            return None
        if entry.state == state or entry.state == ReplicaState.DOWN:
            return None
        return self._set(entry, state, reason, detail)

    def expire(self) -> list[Transition]:
        """Mark silent UP replicas, and STARTING ones past their deadline, as ERROR."""
        now = self._clock()
        out: list[Transition] = []
        for entry in self._entries.values():
            if entry.state in (ReplicaState.UP, ReplicaState.DRAINING):
                if now - entry.last_seen > self.heartbeat_timeout_s:
                    out.append(self._set(entry, ReplicaState.ERROR, Reason.HEARTBEAT_TIMEOUT))
                elif (
                    self.stall_timeout_s
                    and entry.in_flight > 0
                    and now - entry.progress_at > self.stall_timeout_s
                ):
                    out.append(self._set(entry, ReplicaState.ERROR, Reason.STALLED))
            elif entry.state == ReplicaState.STARTING and now > entry.start_deadline:
                out.append(self._set(entry, ReplicaState.ERROR, Reason.START_TIMEOUT))
        return out

    def remove(self, key: ReplicaKey, epoch: int) -> None:
        entry = self._entries.get(key)
        if entry is not None and entry.epoch == epoch:
            del self._entries[key]

    def _current(self, key: ReplicaKey, epoch: int) -> ReplicaEntry | None:
        entry = self._entries.get(key)
        if entry is None or entry.epoch != epoch:
            return None
        return entry

    def _set(
        self, entry: ReplicaEntry, state: ReplicaState, reason: Reason, detail: str = ""
    ) -> Transition:
        old = entry.state
        entry.state = state
        entry.reason, entry.detail = reason, detail
        return Transition(dataclasses.replace(entry), old, state, reason, detail)
