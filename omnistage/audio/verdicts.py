"""The end-of-turn model's verdicts, off the event loop: one small worker pool per process.

Smart Turn takes tens of milliseconds of CPU per verdict. Run on a session's event loop,
that would stall every session's audio in the process while it runs; here it runs on a
worker thread and the session awaits it. The pool is bounded (``WORKERS`` threads, shared
by all sessions) and a question whose silence is over by the time a worker takes it
(the user spoke again, the turn ended) is not run at all: only live questions cost time,
at most one per session.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable
from concurrent.futures import Executor, ThreadPoolExecutor

import numpy as np

# Verdicts run side by side: enough for many sessions pausing at once, few enough to leave
# the event loop and the models' other work their cores.
WORKERS = max(1, min(2, (os.cpu_count() or 1) // 2))

Model = Callable[[np.ndarray], float]


def _run(model: Model, audio: np.ndarray, wanted: Callable[[], bool]) -> float | None:
    return model(audio) if wanted() else None


class VerdictPool:
    """Runs ``model(audio)`` on a worker thread, skipping questions no longer wanted."""

    def __init__(self, executor: Executor | None = None) -> None:
        self._executor = executor or ThreadPoolExecutor(WORKERS, thread_name_prefix="verdict")

    async def judge(
        self, model: Model, audio: np.ndarray, wanted: Callable[[], bool]
    ) -> float | None:
        """The model's verdict on ``audio``; None when ``wanted()`` said no before it ran
        (``wanted`` is called on the worker thread: it must only read)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, _run, model, audio, wanted)


_shared: VerdictPool | None = None
_lock = threading.Lock()


def shared_pool() -> VerdictPool:
    """The process's pool, made on first use."""
    global _shared
    with _lock:
        if _shared is None:
            _shared = VerdictPool()
        return _shared
