"""A sliding window of one stage's recent latencies, for latency-target autoscaling.

The /metrics histograms are cumulative since the head started, so they cannot say how
the stage does *now*; the autoscaler reads these windows instead. The orchestrator's
latency recorder (``dataplane.latency``) appends a sample as it times a request, and the
policy (``control.latency_autoscale``) reads the p90 of the samples seen in the last
``window_s`` seconds.

Each sample carries two times: when it was observed (its end: the first token, the
dispatch) and when the request it times began to wait. Expiry goes by the first, which
grows with each append, so the oldest samples are always at the left. ``since`` filters by
the second: after the replica count changes, the policy counts only requests that began
after it, so a request that queued behind the old replica count and finished after the
change does not read as a miss of the new one.

Bounded: past ``max_samples`` the oldest go first, so a flood of requests costs a fixed
amount of memory, and the window then holds the most recent ``max_samples``.

Pure: every method takes the time; callers read their own (injected) clocks.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

MAX_SAMPLES = 4096


@dataclass(frozen=True)
class WindowStats:
    samples: int
    p90: float | None  # None without samples


class LatencyWindow:
    __slots__ = ("_samples", "window_s")

    def __init__(self, window_s: float, max_samples: int = MAX_SAMPLES) -> None:
        self.window_s = window_s
        # (observed at, began at, seconds)
        self._samples: deque[tuple[float, float, float]] = deque(maxlen=max_samples)

    def observe(self, at: float, began: float, value: float) -> None:
        """A latency of ``value`` seconds that ended at ``at`` for a request that began
        waiting at ``began``. Called on the orchestrator's hot path: an append."""
        self._samples.append((at, began, value))

    def stats(self, now: float, since: float | None = None) -> WindowStats:
        """The samples observed in the last ``window_s`` seconds whose requests began at
        or after ``since``, and their p90 (nearest rank: the smallest value that at least
        90% of the samples do not exceed, so one outlier in ten or more samples does not
        set it)."""
        self._expire(now)
        values = sorted(v for _, began, v in self._samples if since is None or began >= since)
        if not values:
            return WindowStats(0, None)
        return WindowStats(len(values), values[math.ceil(0.9 * len(values)) - 1])

    def _expire(self, now: float) -> None:
        horizon = now - self.window_s
        samples = self._samples
        while samples and samples[0][0] < horizon:
            samples.popleft()

    def __len__(self) -> int:
        return len(self._samples)
