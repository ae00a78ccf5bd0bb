"""When to restart a local replica that exited: a small pure policy, injected clock.

``on-failure`` (default) restarts after a non-zero exit, ``always`` after any exit,
``never`` not at all. Delays back off exponentially (1 s, 2 s, 4 s ... up to 30 s) while
a replica keeps failing soon after it starts, and reset once it has run for a while, so
a crash loop cannot spin the CPU but a rare crash is repaired at once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

POLICIES = ("never", "on-failure", "always")


@dataclass
class _History:
    failures: int = 0
    started_at: float = 0.0


class RestartPolicy:
    def __init__(
        self,
        mode: str,
        clock: Callable[[], float],
        base_delay_s: float = 1.0,
        max_delay_s: float = 30.0,
        stable_after_s: float = 60.0,
    ) -> None:
        if mode not in POLICIES:
            raise ValueError(f"unknown restart policy {mode!r}; expected one of {POLICIES}")
        self.mode = mode
        self._clock = clock
        self._base = base_delay_s
        self._max = max_delay_s
        self._stable_after = stable_after_s
        self._history: dict[tuple[int, int], _History] = {}

    def started(self, key: tuple[int, int]) -> None:
        self._history.setdefault(key, _History()).started_at = self._clock()

    def delay_after_exit(self, key: tuple[int, int], code: int) -> float | None:
        """Seconds to wait before restarting ``key``, or None to leave it down."""
        if self.mode == "never" or (self.mode == "on-failure" and code == 0):
            return None
        h = self._history.setdefault(key, _History())
        if self._clock() - h.started_at >= self._stable_after:
            h.failures = 0
        delay = min(self._max, self._base * 2**h.failures)
        h.failures += 1
        return delay
