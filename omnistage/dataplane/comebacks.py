"""The replicas of one stage that are coming back, and how long a request waits for them.

A stage with no live replica is not always a stage nothing will serve: the head may be
restarting one of its replicas (``head.local``: local processes or Ray actors), or a
replica may have registered and be loading or handshaking (STARTING), a headless one
its supervisor restarted, say. A request then waits for it, up to
--omni-restart-wait-timeout, instead of failing after --omni-stage-wait-timeout, the
short wait meant for a stage that nothing is known to serve. A 503 says which it was.

Pure: times are ``time.monotonic`` values passed in. The stage's pool keeps one, fed by
the coordinator's transitions and by the head's restarts, on the head's loop.
"""

from __future__ import annotations

from dataclasses import dataclass

from omnistage.protocol.errors import StageOverloadedError, StageUnavailableError
from omnistage.protocol.messages import ReplicaState

NOTHING_COMING = "has no live replica and none is restarting"


@dataclass(frozen=True)
class WaitBounds:
    """How long a request waits for a stage's replica."""

    stage_s: float  # --omni-stage-wait-timeout: for a live one, or a free slot on one
    restart_s: float  # --omni-restart-wait-timeout: for one that is coming back


class Comebacks:
    def __init__(self) -> None:
        # Replica id -> when the head restarts it; kept until it is UP again (it may
        # have started and not registered yet) or its restart is dropped.
        self._restarts: dict[int, float] = {}
        # Replica id -> the epoch of its registration that is STARTING.
        self._starting: dict[int, int] = {}
        # Some replica of the stage has been UP: one coming now comes *back*.
        self.was_up = False

    def __bool__(self) -> bool:
        return bool(self._restarts or self._starting)

    @property
    def restarting(self) -> bool:
        """The stage served before and a replica is on its way back (what /health and
        the views call "restarting"; before its first UP a stage is just starting)."""
        return self.was_up and bool(self)

    def restart(self, replica_id: int, at: float | None) -> None:
        """The head restarts ``replica_id`` at ``at``; None: it will not after all
        (given up, retired, its launch failed)."""
        if at is None:
            self._restarts.pop(replica_id, None)
        else:
            self._restarts[replica_id] = at

    def observe(self, replica_id: int, epoch: int, state: ReplicaState) -> bool:
        """A coordinator transition of that replica's registration ``epoch``; whether
        what is coming changed."""
        if state == ReplicaState.STARTING:
            self._starting[replica_id] = epoch
            return True
        changed = self._starting.get(replica_id) == epoch
        if changed:
            del self._starting[replica_id]
        if state == ReplicaState.UP:
            self.was_up = True
            changed = self._restarts.pop(replica_id, None) is not None or changed
        return changed

    def restarts(self) -> dict[int, float]:
        """Replica id -> when the head restarts it (past: restarted, not UP yet)."""
        return dict(self._restarts)

    def deadline(
        self,
        stage_id: int,
        name: str,
        started: float,
        now: float,
        bounds: WaitBounds,
        queue: tuple[int, int] = (0, 1),
    ) -> float:
        """When a request for this stage, which has no live replica, stops waiting
        (``started``: when it began to). StageUnavailableError, saying why, if that is
        now: nothing is coming and the stage wait is over; what is coming did not come
        within the restart wait; or every restart is due after it. ``queue``: requests
        waiting for the stage and how many may; StageOverloadedError when it is full
        and something is coming (a long wait: the bound keeps them from piling up)."""
        if self and queue[0] >= queue[1]:
            why = f"{queue[0]} requests already waiting for a replica to come back"
            raise StageOverloadedError(stage_id, name, why)
        if not self:
            end = started + bounds.stage_s
            if now >= end:
                raise StageUnavailableError(stage_id, name, now - started, NOTHING_COMING)
            return end
        end = started + max(bounds.stage_s, bounds.restart_s)
        if now >= end:
            why = (
                f"has no live replica: {self._describe()} did not come up within "
                f"{bounds.restart_s:g}s (--omni-restart-wait-timeout)"
            )
            raise StageUnavailableError(stage_id, name, now - started, why)
        if not self._starting and min(self._restarts.values()) > end:
            rid, at = min(self._restarts.items(), key=lambda kv: kv[1])
            why = (
                f"has no live replica: replica {rid} restarts in {at - now:.0f}s, after "
                f"the {bounds.restart_s:g}s a request waits for it (--omni-restart-wait-timeout)"
            )
            raise StageUnavailableError(stage_id, name, now - started, why)
        return end

    def _describe(self) -> str:
        """The replicas coming, as "restarting replica 0", "starting replicas 2, 3"."""
        parts = []
        starting = [rid for rid in self._starting if rid not in self._restarts]
        for what, ids in (("restarting", list(self._restarts)), ("starting", starting)):
            if ids:
                s = "s" if len(ids) > 1 else ""
                parts.append(f"{what} replica{s} {', '.join(map(str, sorted(ids)))}")
        return " and ".join(parts)
