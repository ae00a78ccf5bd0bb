"""When to restart a local replica that exited: a small pure policy, injected clock.

``on-failure`` (default) restarts after a non-zero exit, ``always`` after any exit,
``never`` not at all.

How soon tells a crash loop from bad luck. A replica that reached UP and then served for
``settle_s`` (10 s) has shown that its model loads and its engine runs: when it fails
after that (a kill, a lost node, an out-of-memory kill under a burst) it is restarted at
once, since every second it is down a stage may have no replica. A replica that fails
before UP, or within ``settle_s`` of it, is likely to fail again the same way (a bad
config, a broken install, a request that crashes its engine: requests that waited for it
reach it within milliseconds of UP); its restarts back off exponentially (1 s, 2 s,
4 s ... up to 30 s), so a crash loop cannot spin the CPU. The backoff starts again from
1 s after a run that settled.

Why 10 s: several heartbeats (1 s apart), so a replica that dies from its first batch or
its first heartbeats counts as a loop; and well under the time a healthy replica serves
between unlucky failures, even under chaos testing that kills one every 10-15 s.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

POLICIES = ("never", "on-failure", "always")
# A replica UP for this long before it fails is restarted at once (see above).
SETTLE_S = 10.0


@dataclass(frozen=True)
class RestartPlan:
    """What a replica's failure decided: its restart in ``delay`` s (None: not), counted
    from ``at`` (the policy's clock), and whether the run it ended had settled."""

    delay: float | None
    settled: bool = False
    at: float = 0.0


NO_RESTART = RestartPlan(None)


@dataclass
class _History:
    failures: int = 0  # failures in a row that backed off (reset by a settled run)
    up_at: float | None = None  # when the current run reached UP; None: not yet


class RestartPolicy:
    def __init__(
        self,
        mode: str,
        clock: Callable[[], float],
        base_delay_s: float = 1.0,
        max_delay_s: float = 30.0,
        settle_s: float = SETTLE_S,
    ) -> None:
        if mode not in POLICIES:
            raise ValueError(f"unknown restart policy {mode!r}; expected one of {POLICIES}")
        self.mode = mode
        self._clock = clock
        self._base = base_delay_s
        self._max = max_delay_s
        self._settle = settle_s
        self._history: dict[tuple[int, int], _History] = {}

    def started(self, key: tuple[int, int]) -> None:
        """``key``'s process was launched (a new run: not UP yet)."""
        self._history.setdefault(key, _History()).up_at = None

    def up(self, key: tuple[int, int]) -> None:
        """``key``'s current run reached UP (it loaded and finished its handshake)."""
        h = self._history.setdefault(key, _History())
        if h.up_at is None:
            h.up_at = self._clock()

    def settled(self, key: tuple[int, int]) -> bool:
        """Whether ``key``'s current run has served past the settling time."""
        h = self._history.get(key)
        return h is not None and h.up_at is not None and self._clock() - h.up_at >= self._settle

    def delay_after_exit(self, key: tuple[int, int], code: int) -> float | None:
        """Seconds to wait before restarting ``key``, or None to leave it down."""
        if self.mode == "never" or (self.mode == "on-failure" and code == 0):
            return None
        settled = self.settled(key)
        h = self._history.setdefault(key, _History())
        h.up_at = None
        if settled:
            h.failures = 0
            return 0.0
        delay = min(self._max, self._base * 2**h.failures)
        h.failures += 1
        return delay

    def after_exit(self, key: tuple[int, int], code: int) -> RestartPlan:
        """``delay_after_exit``, with whether the run had settled, as of now."""
        settled = self.settled(key)
        return RestartPlan(self.delay_after_exit(key, code), settled, self._clock())

    def left(self, plan: RestartPlan) -> float:
        """Seconds from now until ``plan``'s restart is due."""
        return max(0.0, (plan.delay or 0.0) - (self._clock() - plan.at))
