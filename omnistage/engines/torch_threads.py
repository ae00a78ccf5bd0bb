"""Which OS thread runs an engine's torch work, and how many OpenMP threads it uses.

``TorchThread``: an engine's model is loaded on the thread that then computes with it.
OpenMP keeps a pool of helper threads per thread that starts parallel work; with a
second pool in the process (a model loaded on one thread and used on another) the
process manages more threads than there are cores, and libgomp then cuts its spin-wait
short, so every op's hand-off goes through the kernel (measured: a SmolLM2 decode step
~7 ms on the loading thread, ~21 ms on another).

``ThreadTuner``: how many threads. A CPU forward is hundreds of small ops, each handed
to OpenMP's helper threads. While the cores are free, two threads decode a SmolLM2 step
~1.4x faster than one (7 ms against 9.5 at one row, 17.5 against 27 at eight). When
other processes want the cores (the head, a talker, another replica, a noisy neighbour),
every hand-off waits for a helper the kernel has not scheduled, and the same two threads
ran 1.5x to ~80x slower than one (~1.2 s a step against 15 ms, a served thinker next to
a busy process). No fixed count is right on a shared machine, so the engine measures: it
runs on a count, now and then tries a neighbouring one for a few steps of the same
shape, and moves if that was faster. The tuner is the pure policy (step durations in,
the next count out); the engine times its steps and applies the count on its thread.
"""

from __future__ import annotations

import os
import queue
import statistics
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field


def cores() -> int:
    """CPUs this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def use_threads(count: int) -> None:
    """Run this thread's torch ops on ``count`` threads (a no-op when they already do)."""
    import torch

    if count != torch.get_num_threads():
        torch.set_num_threads(count)


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


@dataclass
class _ShapeState:
    """What the tuner knows of one step shape: the best count found, and when to try
    another."""

    count: int
    period: int
    since: int = 0  # steps since the last trial or move
    recent: list[float] = field(default_factory=list)  # last steps on ``count``
    upward: bool = True  # which neighbour the next trial tries first


class ThreadTuner:
    """Hill-climbs a ladder of thread counts on measured step times, per step shape.

    The best count depends on the shape (one row or eight, a 64x64 image or a 512x512
    one: small steps are overhead that threads do not share), so each shape (``rows``)
    has its own count and its own schedule of trials, and steps are only compared
    within a shape. A new shape starts on the count of the nearest shape seen (seven
    rows behave as eight: a batch that grows and shrinks makes many shapes, and each
    would otherwise wait its own ``period`` steps before its first trial), the first at
    one thread, the count that is never far off: on a busy machine more threads can be
    very slow, and it takes a few steps to know. A
    trial starts after ``window`` steps of the shape and is dropped if the shape changes
    during it. It ends lost as soon as one of its steps takes ``abort`` times the
    baseline, so a wrong guess costs one slow step. A lost trial doubles the wait before
    the shape's next one (up to ``max_period`` steps); a won one moves there and the wait
    starts over. On more than one thread, a step that takes ``abort`` times the recent
    ones (the machine got busy) drops a rung at once. At most ``max_shapes`` shapes are
    remembered (the oldest go).
    """

    def __init__(
        self,
        ladder: tuple[int, ...],
        window: int = 8,
        period: int = 64,
        max_period: int = 4096,
        margin: float = 0.05,
        abort: float = 3.0,
        max_shapes: int = 64,
    ) -> None:
        if not ladder:
            raise ValueError("an empty ladder")
        self.ladder = ladder
        self.count = ladder[0]
        self._window = window
        self._min_period = period
        self._max_period = max_period
        self._margin = margin
        self._abort = abort
        self._max_shapes = max_shapes
        self._shapes: dict[int, _ShapeState] = {}
        self._rows = -1
        self._trial: _Trial | None = None
        self.moves = 0

    @property
    def period(self) -> int:
        """Steps between trials now, for the last shape seen."""
        shape = self._shapes.get(self._rows)
        return shape.period if shape else self._min_period

    def count_for(self, rows: int) -> int:
        """The count a shape runs on now (a shape not seen yet: where it would start)."""
        shape = self._shapes.get(rows)
        return shape.count if shape else self._start_count(rows)

    def _start_count(self, rows: int) -> int:
        if not self._shapes:
            return self.ladder[0]
        nearest = min(self._shapes, key=lambda seen: (abs(seen - rows), seen))
        return self._shapes[nearest].count

    def observe(self, rows: int, seconds: float) -> int:
        """Record one step that took ``seconds`` on the count last returned; the count
        for the next step. ``rows``: what else the step's time depends on (a batch's
        rows, an image's pixels); only steps of equal ``rows`` are compared."""
        if self._trial is not None:
            return self._observe_trial(rows, seconds)
        shape = self._shape(rows)
        if shape.count != self.count:
            # The shape changed and this step ran on the last one's count: switch.
            self.count = shape.count
            return self.count
        if (
            self.count > self.ladder[0]
            and len(shape.recent) >= self._window // 2
            and seconds > self._abort * statistics.median(shape.recent)
        ):
            # Slower at once: other work took the cores the helpers need.
            self._move(shape, self.ladder[self.ladder.index(self.count) - 1])
            return self.count
        shape.recent.append(seconds)
        del shape.recent[: -self._window]
        shape.since += 1
        neighbour = self._neighbour(shape)
        if shape.since >= shape.period and len(shape.recent) == self._window and neighbour:
            self._trial = _Trial(neighbour, rows, statistics.median(shape.recent), [])
            return neighbour
        return self.count

    def _shape(self, rows: int) -> _ShapeState:
        self._rows = rows
        shape = self._shapes.get(rows)
        if shape is None:
            if len(self._shapes) >= self._max_shapes:
                del self._shapes[next(iter(self._shapes))]
            start = self._start_count(rows)
            shape = self._shapes[rows] = _ShapeState(start, self._min_period)
        return shape

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

    def _neighbour(self, shape: _ShapeState) -> int | None:
        i = self.ladder.index(shape.count)
        below = self.ladder[i - 1] if i > 0 else None
        above = self.ladder[i + 1] if i + 1 < len(self.ladder) else None
        first, second = (above, below) if shape.upward else (below, above)
        return first if first is not None else second

    def _move(self, shape: _ShapeState, count: int) -> None:
        shape.upward = count > shape.count  # keep going the way that paid
        shape.count = self.count = count
        shape.period = self._min_period
        shape.since = 0
        shape.recent = []
        self.moves += 1

    def _end_trial(self, won: bool | None) -> None:
        trial = self._trial
        assert trial is not None
        self._trial = None
        shape = self._shape(trial.rows)
        self.count = shape.count
        if won:
            self._move(shape, trial.count)
            return
        shape.since = 0
        shape.recent = []
        if won is False:
            shape.period = min(self._max_period, shape.period * 2)
            # Next time, the other side of the ladder (if there is one).
            shape.upward = trial.count < shape.count


class TorchThread:
    """The one thread that runs a model's torch work: loading it, then every forward
    (see the module's doc). A daemon thread: a loop still running at exit does not hold
    the interpreter up."""

    def __init__(self, name: str) -> None:
        self._calls: queue.SimpleQueue[tuple[Callable[[], object], Future]] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    @property
    def ident(self) -> int | None:
        return self._thread.ident

    def run(self, fn: Callable[[], object]) -> Future:
        """``fn()`` on this thread, after what was submitted before it."""
        done: Future = Future()
        self._calls.put((fn, done))
        return done

    def _serve(self) -> None:
        while True:
            fn, done = self._calls.get()
            if not done.set_running_or_notify_cancel():
                continue
            try:
                done.set_result(fn())
            except BaseException as exc:  # handed to whoever waits on it
                done.set_exception(exc)
