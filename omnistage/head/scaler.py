"""The autoscaler: every tick, each autoscaled stage's replica count and load go to its
policy (``control.autoscale``), and its decisions become replicas added or retired.

Which stages: those with ``autoscaling`` in the deploy config that this head launches
replicas of (every stage; with ``--stage-id K``, stage K only). Headless replicas of a
stage count toward its replicas (they carry its load) but only the head's own are ever
removed. Runs on the head's event loop, where the pools live.

Each autoscaled stage gets sliding latency windows for what the head can time of it
(queue wait; a final stage's first token or first audio), fed by the orchestrator's
latency recorder: a stage with a latency target scales on them
(``control.latency_autoscale``), and every autoscaled stage shows them in its status.
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
    NOTABLE_HOLDS,
    AutoscalePolicy,
    Candidate,
    Cause,
    Decision,
    Direction,
    StageLoad,
    pick_victim,
)
from omnistage.control.latency_autoscale import LatencyPolicy, measurable
from omnistage.control.latency_window import LatencyWindow, WindowStats
from omnistage.control.replica_table import ReplicaEntry
from omnistage.dataplane.latency import LatencyRecorder
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


class Policy(Protocol):
    def step(self, current: int, load: StageLoad) -> Decision: ...


# Applied decisions by direction and cause, listed (as 0) before the first of each, so
# the counters exist from the start.
_CAUSES = {
    "inflight": {"up": (Cause.INFLIGHT,), "down": (Cause.INFLIGHT,)},
    "latency": {"up": (Cause.LATENCY,), "down": (Cause.HEADROOM, Cause.IDLE)},
}


@dataclass
class _Stage:
    policy: Policy
    name: str
    mode: str  # "inflight" or "latency"
    windows: dict[str, LatencyWindow]
    replicas: int = 0
    load: int = 0
    desired: int = 0
    decisions: Counter[str] = field(default_factory=Counter)
    by_cause: dict[str, Counter[str]] = field(default_factory=dict)
    last: dict[str, Any] | None = None
    check: Decision | None = None  # the last tick's, holds included
    reads: dict[str, WindowStats] = field(default_factory=dict)


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
        latency: LatencyRecorder | None = None,
        backlog: Callable[[int], int] | None = None,
    ) -> None:
        """``backlog(stage_id)``: work queued for the stage outside the head's pools
        (jobs waiting in the store), counted as waiting load."""
        self._pools = pools
        self._backlog = backlog
        self._entries = entries
        self._replicas = replicas
        self.interval_s = interval_s
        self._clock = clock
        self._wall = wall
        self._config = config
        self.stages: dict[int, _Stage] = {}
        for s in config.stages:
            spec = s.autoscaling
            if spec is None or s.stage_id not in stage_ids:
                continue
            windows = {
                family: LatencyWindow(spec.latency_window_s)
                for family in measurable(s.final_output, s.output_modality)
            }
            for family, window in windows.items():
                if latency is not None:
                    latency.watch(family, s.stage_id, window)
            mode = "latency" if spec.latency_targets else "inflight"
            policy: Policy = (
                LatencyPolicy(spec, clock, windows)
                if mode == "latency"
                else AutoscalePolicy(spec, clock)
            )
            by_cause = {d: Counter(dict.fromkeys(c, 0)) for d, c in _CAUSES[mode].items()}
            self.stages[s.stage_id] = _Stage(policy, s.name, mode, windows, by_cause=by_cause)

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
            load = _load(pool, mine, counted, self._backlog(sid) if self._backlog else 0)
            d = st.policy.step(len(counted), load)
            st.replicas, st.load, st.desired = len(counted), load.total, d.desired
            self._observe(sid, st, d)
            if d.direction is Direction.HOLD:
                continue
            if d.direction is Direction.UP:
                changed = self._scale_up(sid, d)
            else:
                changed = self._scale_down(sid, d, mine, owned)
            if not changed:
                continue
            st.decisions[str(d.direction)] += 1
            st.by_cause.setdefault(str(d.direction), Counter())[str(d.cause)] += 1
            st.last = {
                "direction": str(d.direction),
                "from": d.current,
                "to": d.replicas,
                "load": load.total,
                "replica_ids": changed,
                "cause": str(d.cause),
                "reason": d.reason,
                "time": round(self._wall(), 3),
            }
            out.append(d)
        return out

    def _observe(self, sid: int, st: _Stage, d: Decision) -> None:
        """Keep what the status shows of this tick, and log a hold worth an operator's
        attention (a missed target the autoscaler will not act on) as it begins."""
        now, policy = self._clock(), st.policy
        # Latency mode: as the policy reads them (since the last change).
        read, since = (
            (policy.reads, policy.since) if isinstance(policy, LatencyPolicy) else ({}, None)
        )
        st.reads = {f: read.get(f) or w.stats(now, since) for f, w in st.windows.items()}
        was, st.check = st.check, d
        notable = d.direction is Direction.HOLD and d.cause in NOTABLE_HOLDS
        if notable and (was is None or was.cause is not d.cause):
            log.info("autoscale stage %d (%s): holding: %s", sid, st.name, d.reason)

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
                    mode=st.mode,
                    replicas=st.replicas,
                    load=st.load,
                    desired=st.desired,
                    decisions={"up": st.decisions["up"], "down": st.decisions["down"]},
                    decisions_by_cause={d: dict(c) for d, c in st.by_cause.items()},
                    last_decision=st.last,
                    check=_check_view(st.check),
                    latency=_latency_view(st, s.autoscaling.latency_targets),
                )
            out[s.stage_id] = view
        return out


def _check_view(d: Decision | None) -> dict[str, Any] | None:
    if d is None:
        return None
    return {"direction": str(d.direction), "cause": str(d.cause), "reason": d.reason}


def _latency_view(st: _Stage, targets: dict[str, float]) -> dict[str, dict[str, Any]]:
    """Per family the stage is timed on: its target (None: not a target) and the p90
    and sample count the policy read last (latency mode: of requests since the last
    change; in-flight mode: of the whole window)."""
    out = {}
    for family in st.windows:
        r = st.reads.get(family)
        out[family] = {
            "target_p90_s": targets.get(family),
            "p90_s": None if r is None or r.p90 is None else round(r.p90, 4),
            "samples": 0 if r is None else r.samples,
        }
    return out


def _load(
    pool: StagePool, mine: list[ReplicaEntry], counted: set[int], backlog: int = 0
) -> StageLoad:
    """The stage's load over its serving replicas (the pool's UP handles); ``backlog``
    (jobs queued in the store) waits as the head's own waiting requests do."""
    up = [h for h in pool.replicas.values() if h.up]
    serving = sum(1 for e in mine if e.state == ReplicaState.UP and e.replica_id in counted)
    return StageLoad(
        in_flight=sum(h.in_flight for h in up),
        waiting=pool.waiting + backlog,
        queued=sum(h.queue_length for h in up),
        capacity=sum(h.capacity for h in up),
        serving=serving,
    )


def _counted(mine: list[ReplicaEntry], owned: set[int], retiring: set[int]) -> set[int]:
    """The replicas a stage has for scaling: the head's own that it has not retired
    (launched, loading, serving or about to restart), and others UP or STARTING."""
    active = {e.replica_id for e in mine if e.state in (ReplicaState.UP, ReplicaState.STARTING)}
    return owned | (active - retiring)
