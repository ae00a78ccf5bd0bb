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
import heapq
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from omnistage.protocol.messages import Reason, ReplicaState, routing_id

ReplicaKey = tuple[int, int]  # (stage_id, replica_id)


class LoadReading(NamedTuple):
    """What a replica's last heartbeat said of its load, for the balancer's once-a-beat
    refresh: a few fields, not a copy of the whole entry, and only of the replicas
    whose figures changed since the last refresh (at 5,000 replicas, copying every
    entry each second cost ~10-16 ms under the coordinator's lock)."""

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
        # Replicas whose reported load changed since ``loads`` was last read (a dict:
        # an ordered set).
        self._load_changed: dict[ReplicaKey, None] = {}
        # When each replica is next due a look from ``expire`` (heartbeat timeout, stall
        # or start deadline): a heap of (when, n, key), the live item per key in
        # ``_queued``; an item replaced by a newer one is dropped when it comes up.
        self._due: list[tuple[float, int, ReplicaKey]] = []
        self._queued: dict[ReplicaKey, int] = {}
        self._n = itertools.count()

    def get(self, key: ReplicaKey) -> ReplicaEntry | None:
        return self._entries.get(key)

    def snapshot(self) -> list[ReplicaEntry]:
        return [dataclasses.replace(self._entries[k]) for k in sorted(self._entries)]

    def loads(self) -> list[LoadReading]:
        """The load of each replica whose heartbeats changed it since the last call:
        a fleet at rest costs nothing per refresh."""
        changed, self._load_changed = self._load_changed, {}
        return [
            LoadReading(e.stage_id, e.replica_id, e.epoch, e.queue_length, e.others)
            for key in changed
            if (e := self._entries.get(key)) is not None
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
        self._watch(entry)
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
        t = self._set(entry, ReplicaState.UP, Reason.READY)
        self._watch(entry)
        return t

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
        if entry.queue_length != queue_length or entry.others != others:
            self._load_changed[key] = None
        if self.stall_timeout_s and in_flight and not entry.in_flight:
            self._watch(entry)  # work came: its stall may be due before its silence
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
            t = self._set(entry, ReplicaState.UP, Reason.HEARTBEATS_RESUMED)
            self._watch(entry)
            return t
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
        """Mark silent UP replicas, and STARTING ones past their deadline, as ERROR:
        those due a look by now, not a walk of every replica."""
        now = self._clock()
        out: list[Transition] = []
        due = self._due
        while due and due[0][0] < now:
            _, n, key = heapq.heappop(due)
            if self._queued.get(key) != n:
                continue  # replaced by a newer look
            del self._queued[key]
            entry = self._entries.get(key)
            if entry is None:
                continue
            t = self._judge(entry, now)
            if t is not None:
                out.append(t)
            else:
                self._watch(entry)  # not yet: due again later
        return out

    def _judge(self, entry: ReplicaEntry, now: float) -> Transition | None:
        if entry.state in (ReplicaState.UP, ReplicaState.DRAINING):
            if entry.last_seen + self.heartbeat_timeout_s < now:
                return self._set(entry, ReplicaState.ERROR, Reason.HEARTBEAT_TIMEOUT)
            if self._stall_due(entry) < now:
                return self._set(entry, ReplicaState.ERROR, Reason.STALLED)
        elif entry.state == ReplicaState.STARTING and entry.start_deadline < now:
            return self._set(entry, ReplicaState.ERROR, Reason.START_TIMEOUT)
        return None

    def _stall_due(self, entry: ReplicaEntry) -> float:
        if not self.stall_timeout_s or entry.in_flight <= 0:
            return math.inf
        return entry.progress_at + self.stall_timeout_s

    def _watch(self, entry: ReplicaEntry) -> None:
        """Queue ``entry``'s next look, replacing any queued (none in a final state)."""
        if entry.state in (ReplicaState.UP, ReplicaState.DRAINING):
            when = min(entry.last_seen + self.heartbeat_timeout_s, self._stall_due(entry))
        elif entry.state == ReplicaState.STARTING:
            when = entry.start_deadline
        else:
            self._queued.pop(entry.key, None)
            return
        n = next(self._n)
        self._queued[entry.key] = n
        heapq.heappush(self._due, (when, n, entry.key))

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
