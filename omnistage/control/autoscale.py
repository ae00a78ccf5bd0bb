"""When to add or remove replicas of a stage: a small pure policy, injected clock.

Each tick the head gives the policy the stage's replica count and its load:

- **replicas**: those taking work or about to (UP, STARTING, and the head's own launched
  but not yet registered), so a replica still loading its engine counts and the policy
  does not launch again while it loads. Draining ones do not count.
- **load**: requests in flight on the stage's replicas plus requests waiting for one.

The stage wants ``desired = ceil(load / target_inflight_per_replica)`` replicas, clamped
to ``[min_replicas, max_replicas]``.

- **Up**: once ``desired`` has stayed above the count for ``upscale_delay_s``, straight to
  ``desired``: a load step is met in one round of launches that load in parallel, and
  ``desired`` is already what the load needs, so it does not overshoot.
- **Down**: once ``desired`` has stayed below the count for ``downscale_delay_s``, one
  replica; the next after another ``downscale_delay_s`` below. Each removal drains a
  replica and moves its share of the load to the others, so stepping lets the measured
  load confirm each step, and a lull between two bursts costs at most one replica.
- Outside ``[min, max]`` (a replica that will not restart, headless replicas that
  joined) the count is brought back at once.

"Stayed" means every tick in the window saw it: one tick the other way restarts the
clock, so load that hovers around a boundary does not flap.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from omnistage.config.schema import AutoscalingConfig


class Direction(enum.StrEnum):
    UP = "up"
    DOWN = "down"
    HOLD = "hold"


@dataclass(frozen=True)
class Decision:
    direction: Direction
    current: int  # replicas counted this tick
    replicas: int  # the count to have after this decision (== current when holding)
    desired: int  # what the load asks for, clamped to [min, max]
    load: int
    reason: str

    @property
    def delta(self) -> int:
        return self.replicas - self.current


class AutoscalePolicy:
    def __init__(self, spec: AutoscalingConfig, clock: Callable[[], float]) -> None:
        self.spec = spec
        self._clock = clock
        self._above_since: float | None = None  # desired > current since then
        self._below_since: float | None = None  # desired < current since then

    def desired(self, load: int) -> int:
        s = self.spec
        wanted = math.ceil(load / s.target_inflight_per_replica) if load > 0 else 0
        return max(s.min_replicas, min(s.max_replicas, wanted))

    def decide(self, current: int, load: int) -> Decision:
        s, now = self.spec, self._clock()
        desired = self.desired(load)

        def decision(direction: Direction, replicas: int, reason: str) -> Decision:
            return Decision(direction, current, replicas, desired, load, reason)

        if current < s.min_replicas:
            self._above_since = self._below_since = None
            return decision(Direction.UP, s.min_replicas, f"below min_replicas {s.min_replicas}")
        if current > s.max_replicas:
            self._above_since = self._below_since = None
            return decision(Direction.DOWN, current - 1, f"above max_replicas {s.max_replicas}")
        per = s.target_inflight_per_replica
        if desired > current:
            self._below_since = None
            since = self._above_since = self._above_since if self._above_since is not None else now
            if now - since >= s.upscale_delay_s:
                self._above_since = None
                return decision(
                    Direction.UP,
                    desired,
                    f"load {load} above {current} x {per:g} for {now - since:.1f}s "
                    f"(upscale_delay_s {s.upscale_delay_s:g})",
                )
            return decision(Direction.HOLD, current, f"load above target for {now - since:.1f}s")
        if desired < current:
            self._above_since = None
            since = self._below_since = self._below_since if self._below_since is not None else now
            if now - since >= s.downscale_delay_s:
                self._below_since = now  # the next step waits a whole delay again
                return decision(
                    Direction.DOWN,
                    current - 1,
                    f"load {load} needs {desired} replica(s) of {per:g}, below {current} for "
                    f"{now - since:.1f}s (downscale_delay_s {s.downscale_delay_s:g})",
                )
            return decision(Direction.HOLD, current, f"load below target for {now - since:.1f}s")
        self._above_since = self._below_since = None
        return decision(Direction.HOLD, current, "load within target")


@dataclass(frozen=True)
class Candidate:
    """A replica the head could remove."""

    replica_id: int
    serving: bool  # UP (taking work); False: not registered yet, or still STARTING
    in_flight: int


def pick_victim(candidates: Iterable[Candidate]) -> int | None:
    """The replica to remove: one not serving yet (nothing to drain, nothing lost), else
    the least loaded (the shortest drain), else the highest id (ids stay small)."""
    ranked = sorted(candidates, key=lambda c: (c.serving, c.in_flight, -c.replica_id))
    return ranked[0].replica_id if ranked else None
