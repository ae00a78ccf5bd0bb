"""A replica restarted beside a live one of its stage loads its model at a lower CPU
priority than the serving it then does (the head sets ``ReplicaOptions.load_nice``).

Why: a replica restarted beside live ones (the head restarts a killed replica at once
when it had served) loads and warms up its model on the cores the live replicas are
answering on, just when they take over the failed one's requests. At the same priority
the load took half the cores: a realtime answer moved to the other thinker replica
stalled 4.3 s between audio deltas, against 0.5 s when the restart came a few seconds
later (bench/bench_realtime_faults.py). Niced, the load gets what the live replicas
leave idle (on an idle machine it loads as fast as before); once ready it serves at the
process's own priority again.

Linux only: nice is a per-thread attribute. It is raised on the main thread before the
engine starts (threads started while loading inherit it) and lowered again on every
thread of the process when the replica is ready. Lowering it needs CAP_SYS_NICE (root)
or an RLIMIT_NICE that allows it; where neither does, the load is not niced at all: a
replica must never go on serving niced.
"""

from __future__ import annotations

import logging
import os
import resource
import threading
from dataclasses import dataclass

log = logging.getLogger(__name__)

MAX_NICE = 19


def _can_lower_to(nice: int) -> bool:
    if os.geteuid() == 0:
        return True
    # RLIMIT_NICE's soft limit r allows a nice as low as 20 - r.
    soft, _ = resource.getrlimit(resource.RLIMIT_NICE)
    return soft == resource.RLIM_INFINITY or 20 - soft <= nice


@dataclass(frozen=True)
class Lowered:
    """What ``lower_for_load`` did: the process's nice before, and the step added."""

    base: int = 0
    step: int = 0

    def restore(self) -> None:
        """Lower every thread's nice by ``step``, never below ``base``: threads niced
        further on purpose (the TTS engine's later sentences) keep their difference,
        threads started before the load was niced keep theirs."""
        if self.step <= 0:
            return
        for name in os.listdir("/proc/self/task"):
            tid = int(name)
            try:
                nice = os.getpriority(os.PRIO_PROCESS, tid)
                if nice > self.base:
                    os.setpriority(os.PRIO_PROCESS, tid, max(self.base, nice - self.step))
            except OSError as exc:  # the thread ended meanwhile, or refused
                log.debug("thread %d keeps its priority: %s", tid, exc)


NOT_LOWERED = Lowered()


def lower_for_load(step: int) -> Lowered:
    """Raise the calling thread's nice by ``step``, if it can be lowered again later."""
    if step <= 0 or not hasattr(os, "setpriority"):
        return NOT_LOWERED
    try:
        tid = threading.get_native_id()
        base = os.getpriority(os.PRIO_PROCESS, tid)
        step = min(step, MAX_NICE - base)
        if step <= 0 or not _can_lower_to(base):
            return NOT_LOWERED
        os.setpriority(os.PRIO_PROCESS, tid, base + step)
        return Lowered(base, step)
    except OSError as exc:
        log.debug("loading at the default priority: %s", exc)
        return NOT_LOWERED
