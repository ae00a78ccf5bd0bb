"""The coordinator: heartbeats in, replica state transitions out.

Owns the replica table behind a lock shared with the master. Transitions are reported
to one listener (the head's stage pools), always outside the lock; so are the prefix
cache contents a heartbeat carries (``Heartbeat.cached_prefixes``), to another.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import NamedTuple

from omnistage.control.replica_table import (
    LoadReading,
    ReplicaEntry,
    ReplicaKey,
    ReplicaTable,
    Transition,
)
from omnistage.logs import Throttled
from omnistage.protocol import codec
from omnistage.protocol.auth import Signer, Verifier
from omnistage.protocol.errors import ProtocolError
from omnistage.protocol.messages import Heartbeat, HeartbeatAck, Reason, ReplicaState

log = logging.getLogger(__name__)
_bad_input = Throttled(log)


class PrefixReport(NamedTuple):
    """A replica's heartbeat said what its prefix cache holds (protocol/prefix.py keys)."""

    stage_id: int
    replica_id: int
    epoch: int
    seq: int  # the heartbeat's: reports apply in order
    keys: list[int]


class Coordinator:
    def __init__(
        self,
        table: ReplicaTable,
        lock: threading.Lock,
        on_transition: Callable[[Transition], None],
        verifier: Verifier | None = None,
        signer: Signer | None = None,
        head_instance: str = "",
        on_prefixes: Callable[[PrefixReport], None] | None = None,
        heads: Callable[[], list[str]] | None = None,
    ) -> None:
        """``heads``: the fleet's heads, told to replicas in every ack (``head.fleet``)."""
        self._heads = heads
        self._on_prefixes = on_prefixes
        self._verifier = verifier
        # Acks are signed too: a forged "UNKNOWN" would make replicas leave.
        self._signer = signer
        self._head_instance = head_instance
        self._table = table
        self._lock = lock
        self._on_transition = on_transition

    # -- socket side (control thread) ------------------------------------------------

    def handle(self, frames: list[bytes]) -> list[bytes] | None:
        """One ROUTER message: ``[identity, tag, body]`` carrying a Heartbeat; the reply
        is a HeartbeatAck telling the replica what state the head has it in."""
        try:
            msg = codec.decode_signed(frames[1:], self._verifier, Heartbeat)
        except ProtocolError as exc:
            _bad_input.warning("coordinator dropped a message: %s", exc)
            return None
        with self._lock:
            t = self._table.heartbeat(
                (msg.stage_id, msg.replica_id),
                msg.epoch,
                msg.status,
                msg.queue_length,
                msg.in_flight,
                msg.progress,
                msg.seq,
                msg.detail,
                msg.others,
            )
            state = self._table.state_of((msg.stage_id, msg.replica_id), msg.epoch)
        self._emit([t] if t else [])
        if msg.cached_prefixes is not None and state is not None and self._on_prefixes:
            report = PrefixReport(
                msg.stage_id, msg.replica_id, msg.epoch, msg.seq, msg.cached_prefixes
            )
            try:
                self._on_prefixes(report)
            except Exception:
                log.exception("prefix report listener failed")
        if msg.status == ReplicaState.DOWN:
            return None  # it is leaving; nobody will read an answer
        ack = HeartbeatAck(
            state=state or ReplicaState.UNKNOWN,
            head_instance=self._head_instance,
            heads=self._heads() if self._heads is not None else [],
        )
        return [frames[0], *codec.sign(codec.encode(ack), self._signer)]

    def tick(self) -> None:
        with self._lock:
            transitions = self._table.expire()
        self._emit(transitions)

    # -- head side -------------------------------------------------------------------

    def register(
        self, key: ReplicaKey, epoch: int, address: str, local: bool, start_timeout_s: float
    ) -> None:
        with self._lock:
            transitions = self._table.register(key, epoch, address, local, start_timeout_s)
        self._emit(transitions)

    def ready(
        self,
        key: ReplicaKey,
        epoch: int,
        capacity: int,
        pid: int,
        peer_address: str = "",
        kernel: str = "",
        host_key: str = "",
    ) -> bool:
        with self._lock:
            t = self._table.ready(key, epoch, capacity, pid, peer_address, kernel, host_key)
        self._emit([t] if t else [])
        return t is not None

    def mark(
        self,
        key: ReplicaKey,
        epoch: int | None,
        state: ReplicaState,
        reason: Reason,
        detail: str = "",
    ) -> None:
        with self._lock:
            t = self._table.mark(key, epoch, state, reason, detail)
        self._emit([t] if t else [])

    def snapshot(self) -> list[ReplicaEntry]:
        with self._lock:
            return self._table.snapshot()

    def loads(self) -> list[LoadReading]:
        with self._lock:
            return self._table.loads()

    def _emit(self, transitions: list[Transition]) -> None:
        for t in transitions:
            e = t.entry
            level = logging.WARNING if t.new == ReplicaState.ERROR else logging.INFO
            log.log(
                level,
                "stage %d replica %d (epoch %d): %s -> %s%s",
                e.stage_id,
                e.replica_id,
                e.epoch,
                t.old or "-",
                t.new,
                f" ({t.why})" if t.reason else "",
            )
            try:
                self._on_transition(t)
            except Exception:
                log.exception("transition listener failed")
