"""How many torch threads the step loop uses, chosen by timing its own decode steps.

A CPU decode step is hundreds of small ops, each handed to torch's OpenMP helper
threads. While the cores are free, two threads decode a SmolLM2 step ~1.4x faster than
one (measured here: 7 ms against 9.5 at one row, 17.5 against 27 at eight). When other
processes want the cores (the head, a talker, another replica, a noisy neighbour), every
hand-off waits for a helper the kernel has not scheduled, and the same two threads
decoded 1.5x to ~80x slower than one (~1.2 s a step against 15 ms, a served thinker next
to a busy process). No fixed count is right on a shared machine, so the loop
measures: it runs on a count, now and then tries a neighbouring one for a few steps with
the batch unchanged, and moves if that was faster.

``ThreadTuner`` is the pure policy (step durations in, the next count out); the worker
times the steps and applies the count.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass


def thread_ladder(cores: int) -> tuple[int, ...]:
    """The counts tried: 1, 2, 4, ... up to ``cores`` (and ``cores`` itself)."""
    counts, n = [], 1
    while n < cores:
        counts.append(n)
        n *= 2
    counts.append(max(1, cores))
    return tuple(counts)


@dataclass
class _Trial:
    count: int
    rows: int
    baseline: float  # median step seconds on the current count just before
    times: list[float]


class ThreadTuner:
    """Hill-climbs a ladder of thread counts on measured decode-step times.

    It starts at one thread, the count that is never far off: on a busy machine more
    threads can be very slow (seen here in a served thinker under load: ~1.2 s a step on
    two threads, 15 ms on one), and it takes a few steps to know. Steps are only compared
    at the same batch size: a trial starts after ``window`` steps with an unchanged number
    of rows and is dropped if the rows change during it. A trial ends lost as soon as one
    of its steps takes ``abort`` times the baseline, so a wrong guess costs one slow step.
    A lost trial doubles the wait before the next one (up to ``max_period`` steps); a
    won one moves there and the wait starts over. On more than one thread, a step that
    takes ``abort`` times the recent ones (the machine got busy) drops a rung at once.
    """

    def __init__(
        self,
        ladder: tuple[int, ...],
        window: int = 8,
        period: int = 64,
        max_period: int = 4096,
        margin: float = 0.05,
        abort: float = 3.0,
    ) -> None:
        if not ladder:
            raise ValueError("an empty ladder")
        self.ladder = ladder
        self.count = ladder[0]
        self._window = window
        self._min_period = period
        self._period = period
        self._max_period = max_period
        self._margin = margin
        self._abort = abort
        self._since = 0  # steps since the last trial or move
        self._recent: list[float] = []  # the current count's last steps at self._rows
        self._rows = -1
        self._trial: _Trial | None = None
        self._upward = True  # which neighbour the next trial tries first
        self.moves = 0

    @property
    def period(self) -> int:
        """Steps between trials now."""
        return self._period

    def observe(self, rows: int, seconds: float) -> int:
        """Record one decode step of ``rows`` rows that took ``seconds`` on the count
        last returned; the count for the next step."""
        if self._trial is not None:
            return self._observe_trial(rows, seconds)
        if rows != self._rows:
            self._rows, self._recent = rows, []
        if (
            self.count > self.ladder[0]
            and len(self._recent) >= self._window // 2
            and seconds > self._abort * statistics.median(self._recent)
        ):
            # Slower at once: other work took the cores the helpers need.
            self._move(self.ladder[self.ladder.index(self.count) - 1])
            return self.count
        self._recent.append(seconds)
        del self._recent[: -self._window]
        self._since += 1
        neighbour = self._neighbour()
        if self._since >= self._period and len(self._recent) == self._window and neighbour:
            self._trial = _Trial(neighbour, rows, statistics.median(self._recent), [])
            return neighbour
        return self.count

    def _observe_trial(self, rows: int, seconds: float) -> int:
        trial = self._trial
        assert trial is not None
        if rows != trial.rows:  # not comparable: back to where we were, no verdict
            self._end_trial(won=None)
        elif seconds > self._abort * trial.baseline:
            self._end_trial(won=False)
        else:
            trial.times.append(seconds)
            if len(trial.times) < self._window:
                return trial.count
            won = statistics.median(trial.times) < trial.baseline * (1 - self._margin)
            self._end_trial(won=won)
        return self.count

    def _neighbour(self) -> int | None:
        i = self.ladder.index(self.count)
        below = self.ladder[i - 1] if i > 0 else None
        above = self.ladder[i + 1] if i + 1 < len(self.ladder) else None
        first, second = (above, below) if self._upward else (below, above)
        return first if first is not None else second

    def _move(self, count: int) -> None:
        self._upward = count > self.count  # keep going the way that paid
        self.count = count
        self.moves += 1
        self._period = self._min_period
        self._since = 0
        self._recent = []

    def _end_trial(self, won: bool | None) -> None:
        trial = self._trial
        assert trial is not None
        self._trial = None
        if won:
            self._move(trial.count)
            return
        self._since = 0
        self._recent = []
        if won is False:
            self._period = min(self._max_period, self._period * 2)
            # Next time, the other side of the ladder (if there is one).
            self._upward = trial.count < self.count
