"""When to add or remove replicas of a stage: a small pure policy, injected clock. This
is the in-flight mode, the default; a stage with a latency target scales with
``control.latency_autoscale`` instead, which shares the pieces below the policy.

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


class Cause(enum.StrEnum):
    """Why a decision went the way it did: a short label for the metrics (the
    ``reason`` string says it in words, with the figures)."""

    MIN_REPLICAS = "min_replicas"  # up: below min_replicas
    MAX_REPLICAS = "max_replicas"  # down: above max_replicas
    INFLIGHT = "inflight"  # in-flight mode: load above (below) the target
    LATENCY = "latency"  # latency mode, up: a target missed while the replicas are busy
    HEADROOM = "headroom"  # latency mode, down: well under every target, load fits fewer
    IDLE = "idle"  # latency mode, down: no requests
    # Holds
    WITHIN = "within"  # nothing to do
    DELAY = "delay"  # wants a change, waiting out upscale_delay_s / downscale_delay_s
    STARTING = "starting"  # replicas still loading: their effect is not measured yet
    FEW_SAMPLES = "few_samples"  # a target may be missed, but too few samples to say
    NOT_LOAD = "not_load"  # a target is missed, but the replicas are not busy
    AT_MAX = "at_max"  # a target is missed under load, at max_replicas


# Causes of a hold an operator wants to hear about (logged when a stage starts holding
# for them): the stage misses its target and the autoscaler will not help.
NOTABLE_HOLDS = frozenset({Cause.NOT_LOAD, Cause.AT_MAX})


@dataclass(frozen=True)
class Decision:
    direction: Direction
    current: int  # replicas counted this tick
    replicas: int  # the count to have after this decision (== current when holding)
    desired: int  # what the load asks for, clamped to [min, max]
    load: int
    reason: str
    cause: Cause = Cause.WITHIN

    @property
    def delta(self) -> int:
        return self.replicas - self.current


@dataclass(frozen=True)
class StageLoad:
    """What the scaler reads of a stage each tick (its serving replicas only)."""

    in_flight: int = 0  # sent to a replica and not finished
    waiting: int = 0  # waiting at the head for a free replica slot
    queued: int = 0  # accepted by a replica but not started (its heartbeats)
    capacity: int = 0  # requests the serving replicas take at once, summed
    serving: int = 0  # replicas UP among those counted

    @property
    def total(self) -> int:
        return self.in_flight + self.waiting


class Stayed:
    """Since when a condition has held on every tick: one tick without it restarts the
    clock, so a load that hovers around a boundary does not flap."""

    __slots__ = ("since",)

    def __init__(self) -> None:
        self.since: float | None = None

    def hold(self, now: float) -> float:
        """It holds this tick; returns for how long it has."""
        if self.since is None:
            self.since = now
        return now - self.since

    def reset(self, since: float | None = None) -> None:
        self.since = since


def out_of_bounds(spec: AutoscalingConfig, current: int) -> tuple[Direction, int, str] | None:
    """Outside ``[min, max]`` (a replica that will not restart, headless replicas that
    joined) the count is brought back at once, whatever the load says."""
    if current < spec.min_replicas:
        return Direction.UP, spec.min_replicas, f"below min_replicas {spec.min_replicas}"
    if current > spec.max_replicas:
        return Direction.DOWN, current - 1, f"above max_replicas {spec.max_replicas}"
    return None


class AutoscalePolicy:
    """The in-flight mode (see the module docstring)."""

    def __init__(self, spec: AutoscalingConfig, clock: Callable[[], float]) -> None:
        self.spec = spec
        self._clock = clock
        self._above = Stayed()  # desired > current
        self._below = Stayed()  # desired < current

    def desired(self, load: int) -> int:
        s = self.spec
        wanted = math.ceil(load / s.inflight_target) if load > 0 else 0
        return max(s.min_replicas, min(s.max_replicas, wanted))

    def step(self, current: int, load: StageLoad) -> Decision:
        """The scaler's call (both modes have it): this mode reads the total load."""
        return self.decide(current, load.total)

    def decide(self, current: int, load: int) -> Decision:
        s, now = self.spec, self._clock()
        desired = self.desired(load)

        def decision(direction: Direction, replicas: int, reason: str, cause: Cause) -> Decision:
            return Decision(direction, current, replicas, desired, load, reason, cause)

        if (bounds := out_of_bounds(s, current)) is not None:
            self._above.reset()
            self._below.reset()
            direction, replicas, reason = bounds
            cause = Cause.MIN_REPLICAS if direction is Direction.UP else Cause.MAX_REPLICAS
            return decision(direction, replicas, reason, cause)
        per = s.inflight_target
        if desired > current:
            self._below.reset()
            held = self._above.hold(now)
            if held >= s.upscale_delay_s:
                self._above.reset()
                return decision(
                    Direction.UP,
                    desired,
                    f"load {load} above {current} x {per:g} for {held:.1f}s "
                    f"(upscale_delay_s {s.upscale_delay_s:g})",
                    Cause.INFLIGHT,
                )
            return decision(
                Direction.HOLD, current, f"load above target for {held:.1f}s", Cause.DELAY
            )
        if desired < current:
            self._above.reset()
            held = self._below.hold(now)
            if held >= s.downscale_delay_s:
                self._below.reset(now)  # the next step waits a whole delay again
                return decision(
                    Direction.DOWN,
                    current - 1,
                    f"load {load} needs {desired} replica(s) of {per:g}, below {current} for "
                    f"{held:.1f}s (downscale_delay_s {s.downscale_delay_s:g})",
                    Cause.INFLIGHT,
                )
            return decision(
                Direction.HOLD, current, f"load below target for {held:.1f}s", Cause.DELAY
            )
        self._above.reset()
        self._below.reset()
        return decision(Direction.HOLD, current, "load within target", Cause.WITHIN)


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
