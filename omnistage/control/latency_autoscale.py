"""Latency-target autoscaling: a stage's replica count follows the latency its users feel.
A small pure policy with an injected clock, the sibling of ``control.autoscale`` (the
in-flight mode), whose decisions, delays and bounds it shares.

A stage with ``target_p90_first_token_s``, ``target_p90_first_audio_s`` or
``target_p90_queue_wait_s`` scales on the p90 of that latency over a sliding window of
recent requests (``control.latency_window``), not on a count of requests:

- **Up** when a target is missed *and load is the cause*, on every tick for
  ``upscale_delay_s``: the window holds at least ``latency_min_samples`` samples (so one
  slow request among a handful is not a miss), their p90 is over the target, and the
  replicas are busy: requests wait (at the head for a slot, or queued inside a replica)
  or the replicas hold at least ``busy_fraction`` of their capacity in flight. A miss
  with idle replicas (a slow upstream stage, long prompts, a slow replica) would not get
  better with more replicas, so it holds, and the scaler says so in its log.
  How many: at least one more; enough that the load fits without waiting (load over one
  replica's capacity); and as many as the miss suggests if latency grows with the load
  per replica (count x p90 / target), but at most double per step.
- **Down** one replica per ``downscale_delay_s`` when there is headroom: every target's
  p90 is under ``HEADROOM`` x its target and the load would fit on one replica fewer
  (nothing waits, and the in-flight count stays under ``busy_fraction`` of the capacity
  that would remain); or the stage is idle (no load and no samples). Removal is the same
  drain as in the in-flight mode.
- **Hold** while replicas are still loading (their effect is not measured yet), and with
  load but no samples to judge by.

After every change the window counts only requests that began after it (after an
upscale: once every replica counted is serving), so the p90 always describes the current
replica count, and a change is judged on fresh samples.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from omnistage.config.schema import AutoscalingConfig
from omnistage.control.autoscale import (
    Cause,
    Decision,
    Direction,
    StageLoad,
    Stayed,
    out_of_bounds,
)
from omnistage.control.latency_window import LatencyWindow, WindowStats
from omnistage.protocol.enums import Modality

# Latencies a window can hold, by the name in the target keys (target_p90_<family>_s).
FAMILIES = ("first_token", "first_audio", "queue_wait")
# A p90 under this fraction of its target is headroom: with latency growing with the
# load per replica, one replica fewer of n (n >= 2) raises it at most n / (n - 1) <= 2x.
HEADROOM = 0.5
# One upscale at most multiplies the count by this, however far the p90 is over.
MAX_STEP = 2


@dataclass(frozen=True)
class _Want:
    direction: Direction
    desired: int
    cause: Cause
    why: str


class LatencyPolicy:
    def __init__(
        self,
        spec: AutoscalingConfig,
        clock: Callable[[], float],
        windows: Mapping[str, LatencyWindow],
    ) -> None:
        self.spec = spec
        self.targets = spec.latency_targets
        missing = set(self.targets) - set(windows)
        if missing:
            raise ValueError(f"no latency window for {', '.join(sorted(missing))}")
        self._clock = clock
        self._windows = windows
        self._up = Stayed()
        self._down = Stayed()
        # Samples count from requests that began at or after this (the last change).
        self.since: float | None = None
        self._settling = False  # replicas added and not all serving yet
        self.reads: dict[str, WindowStats] = {}  # the last tick's, per target family

    def step(self, current: int, load: StageLoad) -> Decision:
        now = self._clock()
        if self._settling and load.serving >= current:
            self._settling = False
            self.since = now
        self.reads = {f: self._windows[f].stats(now, self.since) for f in self.targets}
        if (bounds := out_of_bounds(self.spec, current)) is not None:
            direction, replicas, reason = bounds
            up = direction is Direction.UP
            self._changed(now, up)
            cause = Cause.MIN_REPLICAS if up else Cause.MAX_REPLICAS
            return Decision(direction, current, replicas, replicas, load.total, reason, cause)
        want = self._judge(current, load)
        return self._apply(now, current, load, want)

    def _judge(self, current: int, load: StageLoad) -> _Want:
        s = self.spec
        hold = Direction.HOLD
        if load.serving < current:
            why = f"{current - load.serving} replica(s) starting: their effect is not measured yet"
            return _Want(hold, current, Cause.STARTING, why)
        missed = [
            (f, r)
            for f, r in self.reads.items()
            if r.p90 is not None and r.samples >= s.latency_min_samples and r.p90 > self.targets[f]
        ]
        if missed:
            miss = "; ".join(self._describe(f, r, "over") for f, r in missed)
            busy, how = self._busy(load)
            if not busy:
                why = f"{miss}, but the replicas are not busy ({how}): load is not the cause"
                return _Want(hold, current, Cause.NOT_LOAD, why)
            if current >= s.max_replicas:
                why = f"{miss} with the replicas busy ({how}), at max_replicas {s.max_replicas}"
                return _Want(hold, current, Cause.AT_MAX, why)
            desired = self._wanted(current, load, missed)
            return _Want(Direction.UP, desired, Cause.LATENCY, f"{miss} with replicas busy ({how})")
        few = [
            f"{r.samples} of latency_min_samples {s.latency_min_samples} for {f}"
            for f, r in self.reads.items()
            if r.p90 is not None and r.p90 > self.targets[f]
        ]
        if few:
            return _Want(hold, current, Cause.FEW_SAMPLES, "; ".join(few))
        return self._headroom(current, load)

    def _headroom(self, current: int, load: StageLoad) -> _Want:
        s, hold = self.spec, Direction.HOLD
        if all(r.samples == 0 for r in self.reads.values()):
            if load.total > 0:
                why = f"load {load.total} but no samples in the window yet"
                return _Want(hold, current, Cause.FEW_SAMPLES, why)
            if current > s.min_replicas:
                return _Want(Direction.DOWN, current - 1, Cause.IDLE, "no requests")
            return _Want(hold, current, Cause.WITHIN, "no requests")
        roomy = all(
            r.p90 is not None and r.p90 < HEADROOM * self.targets[f] for f, r in self.reads.items()
        )
        if not roomy or current <= s.min_replicas:
            return _Want(hold, current, Cause.WITHIN, "within target")
        fits, how = self._fits(current - 1, load)
        if not fits:
            return _Want(hold, current, Cause.WITHIN, f"under target; {how}")
        under = "; ".join(
            self._describe(f, r, f"under {HEADROOM:g} x") for f, r in self.reads.items()
        )
        return _Want(Direction.DOWN, current - 1, Cause.HEADROOM, f"{under} and {how}")

    def _apply(self, now: float, current: int, load: StageLoad, want: _Want) -> Decision:
        s = self.spec

        def decision(direction: Direction, replicas: int, why: str, cause: Cause) -> Decision:
            return Decision(direction, current, replicas, want.desired, load.total, why, cause)

        if want.direction is Direction.UP:
            self._down.reset()
            held = self._up.hold(now)
            if held < s.upscale_delay_s:
                return decision(Direction.HOLD, current, f"{want.why} for {held:.1f}s", Cause.DELAY)
            self._changed(now, up=True)
            why = f"{want.why} for {held:.1f}s (upscale_delay_s {s.upscale_delay_s:g})"
            return decision(Direction.UP, want.desired, why, want.cause)
        if want.direction is Direction.DOWN:
            self._up.reset()
            held = self._down.hold(now)
            if held < s.downscale_delay_s:
                return decision(Direction.HOLD, current, f"{want.why} for {held:.1f}s", Cause.DELAY)
            self._changed(now, up=False)
            why = f"{want.why} for {held:.1f}s (downscale_delay_s {s.downscale_delay_s:g})"
            return decision(Direction.DOWN, current - 1, why, want.cause)
        self._up.reset()
        self._down.reset()
        return decision(Direction.HOLD, current, want.why, want.cause)

    def _changed(self, now: float, up: bool) -> None:
        """The count changes now: judge the next change on requests that begin after it
        (an upscale: after the new replicas serve); the next step down waits a whole
        ``downscale_delay_s`` again."""
        self._up.reset()
        self._down.reset(None if up else now)
        self._settling = up
        self.since = now

    def _busy(self, load: StageLoad) -> tuple[bool, str]:
        """Whether the replicas are saturated, and the figures that say so."""
        held = f"{load.in_flight} in flight of capacity {load.capacity}"
        if load.waiting:
            return True, f"{load.waiting} waiting for a replica slot, {held}"
        if load.queued:
            return True, f"{load.queued} queued in the replicas, {held}"
        busy = load.capacity > 0 and load.in_flight >= self.spec.busy_fraction * load.capacity
        return busy, f"{held}, busy_fraction {self.spec.busy_fraction:g}" + (
            "" if busy else ", none waiting"
        )

    def _fits(self, replicas: int, load: StageLoad) -> tuple[bool, str]:
        """Whether the load would fit on ``replicas`` of the serving ones' size."""
        if load.waiting or load.queued or load.serving == 0:
            return False, "requests wait"
        room = self.spec.busy_fraction * load.capacity / load.serving * replicas
        # Strictly under: at the room exactly, the replicas left would be busy, and a
        # miss then would add the replica back.
        fits = load.total < room
        verb = "fits" if fits else "does not fit"
        return fits, f"load {load.total} {verb} {replicas} replica(s) ({room:g} at busy_fraction)"

    def _wanted(self, current: int, load: StageLoad, missed: list[tuple[str, WindowStats]]) -> int:
        s = self.spec
        # The whole load without a wait, at the serving replicas' mean capacity (serving
        # >= current >= 1 here; capacity 0 only while the pool has not seen them UP yet).
        per = load.capacity / load.serving
        by_capacity = math.ceil(load.total / per) if per > 0 else current + 1
        ratio = max((r.p90 or 0.0) / self.targets[f] for f, r in missed)
        by_latency = min(MAX_STEP * current, math.ceil(current * ratio))
        return max(s.min_replicas, min(s.max_replicas, max(current + 1, by_capacity, by_latency)))

    def _describe(self, family: str, r: WindowStats, relation: str) -> str:
        return (
            f"p90 {family} {r.p90:.3f}s {relation} target {self.targets[family]:g}s "
            f"({r.samples} samples)"
        )


def measurable(final_output: bool, output_modality: str) -> tuple[str, ...]:
    """The latency families the head can time for a stage (as the config checks them:
    ``StageConfig._latency_targets_measurable``)."""
    firsts = {Modality.TEXT: ("first_token",), Modality.AUDIO: ("first_audio",)}
    return (*(firsts.get(output_modality, ()) if final_output else ()), "queue_wait")
