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

If the stage's last live replica fails while such a restart loads, the stage waits on
that load: the head then lowers the loading replica's nice again (``hurry``), so it loads
at full priority (a thinker's restart took 51 s niced on a busy 2-core machine, ~4x the
time unniced).

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


def can_lower_to(nice: int) -> bool:
    if os.geteuid() == 0:
        return True
    # RLIMIT_NICE's soft limit r allows a nice as low as 20 - r.
    soft, _ = resource.getrlimit(resource.RLIMIT_NICE)
    return soft == resource.RLIM_INFINITY or 20 - soft <= nice


@dataclass(frozen=True)
class Lowered:
    """What ``lower_for_load`` did: the process's nice before, the step added, and the
    thread it niced (the process's main thread)."""

    base: int = 0
    step: int = 0
    tid: int = 0

    def restore(self, pid: int | None = None) -> None:
        """Lower every thread's nice by ``step``, never below ``base``: threads niced
        further on purpose (the TTS engine's later sentences) keep their difference,
        threads started before the load was niced keep theirs. ``pid``: another
        process's threads (the head hurrying a load, ``hurry``), not this one's. Done
        once: a load the head hurried (its main thread no longer niced) is left as is."""
        if self.step <= 0:
            return
        if pid is None and self.tid:
            try:
                if os.getpriority(os.PRIO_PROCESS, self.tid) < self.base + self.step:
                    return
            except OSError:
                pass
        try:
            tids = os.listdir(f"/proc/{pid or 'self'}/task")
        except OSError:  # it exited meanwhile
            return
        for name in tids:
            tid = int(name)
            try:
                nice = os.getpriority(os.PRIO_PROCESS, tid)
                if nice > self.base:
                    os.setpriority(os.PRIO_PROCESS, tid, max(self.base, nice - self.step))
            except OSError as exc:  # the thread ended meanwhile, or refused
                log.debug("thread %d keeps its priority: %s", tid, exc)


NOT_LOWERED = Lowered()


def hurry(pid: int, step: int) -> bool:
    """The head's side: a replica it started niced by ``step`` (``lower_for_load``) loads
    at full priority from now on, its stage having lost its last live replica: requests
    wait on this load now, and it has the cores to itself. Its own ``restore`` at ready
    then finds nothing left to undo. False where this process may not lower a nice."""
    if step <= 0 or not hasattr(os, "getpriority"):
        return False
    try:
        base = os.getpriority(os.PRIO_PROCESS, 0)  # the replica's, inherited at launch
        if not can_lower_to(base):
            return False
    except OSError:
        return False
    Lowered(base, min(step, MAX_NICE - base), pid).restore(pid)
    return True


def lower_for_load(step: int) -> Lowered:
    """Raise the calling thread's nice by ``step``, if it can be lowered again later."""
    if step <= 0 or not hasattr(os, "setpriority"):
        return NOT_LOWERED
    try:
        tid = threading.get_native_id()
        base = os.getpriority(os.PRIO_PROCESS, tid)
        step = min(step, MAX_NICE - base)
        if step <= 0 or not can_lower_to(base):
            return NOT_LOWERED
        os.setpriority(os.PRIO_PROCESS, tid, base + step)
        return Lowered(base, step, tid)
    except OSError as exc:
        log.debug("loading at the default priority: %s", exc)
        return NOT_LOWERED
