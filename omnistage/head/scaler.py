"""The autoscaler: every tick, each autoscaled stage's replica count and load go to its
policy (``control.autoscale``), and its decisions become replicas added or retired.

Which stages: those with ``autoscaling`` in the deploy config that this head launches
replicas of (every stage; with ``--stage-id K``, stage K only). Headless replicas of a
stage count toward its replicas (they carry its load) but only the head's own are ever
removed. Runs on the head's event loop, where the pools live.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from omnistage.config.schema import DeployConfig
from omnistage.control.autoscale import (
    AutoscalePolicy,
    Candidate,
    Decision,
    Direction,
    pick_victim,
)
from omnistage.control.replica_table import ReplicaEntry
from omnistage.dataplane.stage_pool import StagePool
from omnistage.protocol.messages import ReplicaState

log = logging.getLogger(__name__)

TICK_S = 0.25


class Replicas(Protocol):
    """What the scaler needs from the head's own replicas (``head.local.LocalReplicas``)."""

    def owned(self, stage_id: int) -> list[int]: ...

    def retiring(self, stage_id: int) -> list[int]: ...

    def add(self, stage_id: int) -> int | None: ...

    def retire(self, stage_id: int, replica_id: int, epoch: int | None) -> bool: ...


@dataclass
class _Stage:
    policy: AutoscalePolicy
    name: str
    replicas: int = 0
    load: int = 0
    desired: int = 0
    decisions: Counter[str] = field(default_factory=Counter)
    last: dict[str, Any] | None = None


class Scaler:
    def __init__(
        self,
        config: DeployConfig,
        stage_ids: set[int],
        pools: dict[int, StagePool],
        entries: Callable[[], list[ReplicaEntry]],
        replicas: Replicas,
        interval_s: float = TICK_S,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self._pools = pools
        self._entries = entries
        self._replicas = replicas
        self.interval_s = interval_s
        self._wall = wall
        self._config = config
        self.stages: dict[int, _Stage] = {
            s.stage_id: _Stage(AutoscalePolicy(s.autoscaling, clock), s.name)
            for s in config.stages
            if s.autoscaling is not None and s.stage_id in stage_ids
        }

    async def run(self) -> None:
        if not self.stages:
            return
        log.info(
            "autoscaling stage(s) %s",
            ", ".join(f"{sid}:{st.name}" for sid, st in sorted(self.stages.items())),
        )
        while True:
            try:
                self.tick()
            except Exception:
                log.exception("autoscaler tick failed")
            await asyncio.sleep(self.interval_s)

    def tick(self) -> list[Decision]:
        """Ask each stage's policy once and apply what it decides; returns the decisions
        that changed something."""
        entries = self._entries()
        out = []
        for sid, st in self.stages.items():
            mine = [e for e in entries if e.stage_id == sid]
            owned = set(self._replicas.owned(sid))
            pool = self._pools[sid]
            counted = _counted(mine, owned, set(self._replicas.retiring(sid)))
            load = sum(h.in_flight for h in pool.replicas.values() if h.up) + pool.waiting
            d = st.policy.decide(len(counted), load)
            st.replicas, st.load, st.desired = len(counted), load, d.desired
            if d.direction is Direction.HOLD:
                continue
            if d.direction is Direction.UP:
                changed = self._scale_up(sid, d)
            else:
                changed = self._scale_down(sid, d, mine, owned)
            if not changed:
                continue
            st.decisions[str(d.direction)] += 1
            st.last = {
                "direction": str(d.direction),
                "from": d.current,
                "to": d.replicas,
                "load": load,
                "replica_ids": changed,
                "reason": d.reason,
                "time": round(self._wall(), 3),
            }
            out.append(d)
        return out

    def _scale_up(self, sid: int, d: Decision) -> list[int]:
        added = [rid for _ in range(d.delta) if (rid := self._replicas.add(sid)) is not None]
        if added:
            self._log(sid, d, "adding replica(s) " + ", ".join(map(str, added)))
        return added

    def _scale_down(
        self, sid: int, d: Decision, mine: list[ReplicaEntry], owned: set[int]
    ) -> list[int]:
        pool = self._pools[sid]
        up = {e.replica_id: e.epoch for e in mine if e.state == ReplicaState.UP}
        candidates = [
            Candidate(
                rid,
                rid in up,
                pool.replicas[rid].in_flight if rid in pool.replicas else 0,
            )
            for rid in owned
        ]
        victim = pick_victim(candidates)
        if victim is None:
            log.debug("stage %d: %s, but it runs none of the head's own replicas", sid, d.reason)
            return []
        busy = next(c.in_flight for c in candidates if c.replica_id == victim)
        self._log(sid, d, f"draining replica {victim} ({busy} request(s) in flight)")
        return [victim] if self._replicas.retire(sid, victim, up.get(victim)) else []

    def _log(self, sid: int, d: Decision, action: str) -> None:
        log.info(
            "autoscale stage %d (%s): %s %d -> %d replicas: %s; %s",
            sid,
            self.stages[sid].name,
            d.direction,
            d.current,
            d.replicas,
            d.reason,
            action,
        )

    def status(self) -> dict[int, dict[str, Any]]:
        """Per autoscaling stage of the deploy config, for /v1/omni/stages (and /metrics,
        which reads it there): its bounds, what it counts now, and its decisions."""
        out: dict[int, dict[str, Any]] = {}
        for s in self._config.stages:
            if s.autoscaling is None:
                continue
            st = self.stages.get(s.stage_id)
            view: dict[str, Any] = {**s.autoscaling.model_dump(), "active": st is not None}
            if st is not None:
                view.update(
                    replicas=st.replicas,
                    load=st.load,
                    desired=st.desired,
                    decisions={"up": st.decisions["up"], "down": st.decisions["down"]},
                    last_decision=st.last,
                )
            out[s.stage_id] = view
        return out


def _counted(mine: list[ReplicaEntry], owned: set[int], retiring: set[int]) -> set[int]:
    """The replicas a stage has for scaling: the head's own that it has not retired
    (launched, loading, serving or about to restart), and others UP or STARTING."""
    active = {e.replica_id for e in mine if e.state in (ReplicaState.UP, ReplicaState.STARTING)}
    return owned | (active - retiring)
