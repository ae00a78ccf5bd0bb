"""The head's restarts that load niced beside a live replica of their stage (see
``replica.load_priority``), and the moment each goes to full priority: after
``OMNISTAGE_LOAD_NICE_S`` (the live replica's takeover of the failed one's requests), or at
once when the stage has no live replica left and waits on the load. Niced on busy cores,
a talker's restart took 8-20 s and a thinker's 45-55 s, against ~1 s and ~5-10 s at full
priority: the stage on one replica all that time.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
from collections.abc import Callable

from omnistage import envs
from omnistage.launch.base import ReplicaProcess
from omnistage.replica import load_priority

log = logging.getLogger(__name__)


class NicedLoads:
    def __init__(self, hurry: Callable[[int, int], bool] = load_priority.hurry) -> None:
        """``hurry(pid, step)`` lowers a loading process's nice (``load_priority.hurry``)."""
        self.hurry_load = hurry
        # Replicas loading niced: (stage, replica) -> (their process, nice steps).
        self._loading: dict[tuple[int, int], tuple[ReplicaProcess, int]] = {}
        self._lock = threading.Lock()  # the loop and launcher threads both call in

    def launched(
        self,
        key: tuple[int, int],
        proc: ReplicaProcess,
        step: int,
        loop: asyncio.AbstractEventLoop | None,
    ) -> None:
        """``proc`` was launched as ``key``, loading ``step`` nice steps lower (0: not);
        it goes to full priority ``OMNISTAGE_LOAD_NICE_S`` from now, on ``loop``."""
        with self._lock:
            self._loading.pop(key, None)
            if step <= 0 or proc.node is not None or loop is None:  # not ours to renice
                return
            self._loading[key] = (proc, step)
        why = f"niced for {envs.load_nice_s():g}s (OMNISTAGE_LOAD_NICE_S)"
        hurry = functools.partial(self.hurry, key, proc, why)
        loop.call_soon_threadsafe(loop.call_later, envs.load_nice_s(), hurry)

    def done(self, key: tuple[int, int]) -> None:
        """``key`` is UP (it serves at its own priority now) or exited."""
        with self._lock:
            self._loading.pop(key, None)

    def hurry(self, key: tuple[int, int], proc: ReplicaProcess | None, why: str) -> None:
        """``proc``, if still loading niced as ``key``, loads at full priority from now on."""
        with self._lock:
            held = self._loading.get(key)
            if held is None or (proc is not None and held[0] is not proc):
                return
            del self._loading[key]
        if self.hurry_load(held[0].pid, held[1]):
            log.info("stage %d replica %d loads at full priority now: %s", *key, why)

    def exited(self, key: tuple[int, int], stage_serving: bool) -> None:
        """``key``'s process exited; ``stage_serving``: whether another replica of its
        stage is UP on this head. With none, the stage waits on its loads: all of them
        go to full priority now."""
        self.done(key)
        if stage_serving:
            return
        with self._lock:
            keys = [k for k in self._loading if k[0] == key[0]]
        for loading in keys:
            self.hurry(loading, None, "its stage has no live replica left")
