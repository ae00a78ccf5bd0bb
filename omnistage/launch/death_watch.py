"""Seeing a local replica's death when the kill lands, not when its last thread is gone.

Why: a SIGKILLed process exits thread by thread, and everything the head watches (its
sockets closing, ``waitpid``) comes only when its *last* thread has exited. That thread
also tears down the whole address space (the last one out drops the mm: a model's
hundreds of MB to unmap) and only then closes the files. A replica whose threads are
niced (the TTS engine's later-chunk pool, ``later_nice`` 10; a restart loading at
OMNISTAGE_LOAD_NICE, its threads up to 19) runs that teardown at its niced share of a
busy core: weight 15 against 1024 at nice 19, ~70x slower. On 2 cores busy with nice-0
work of the same session (kernel 6.18, EEVDF; bench/bench_niced_kill.py) a replica with
1 GB and busy nice-19 threads was gone 5-22 s after its kill, against 0.5-1 s at nice 0,
and the head saw it only by its heartbeat timeout; its answers' failover waited for that.

The kill itself is visible at once: a fatal signal puts SIGKILL in every thread's
pending set the moment it is sent (the kernel turns a group exit into a SIGKILL to each
thread), and a thread that has run it is a zombie (the leader) or gone. Neither can be
undone, so a leader showing either is dying for sure: a sound ERROR, with nothing of the
replica able to run user code again (a stray message already on its way carries a
fenced epoch). (A leader that ended by ``pthread_exit`` with other threads live is a
zombie too; a replica's Python main thread never does that.) The watch polls
``/proc/<pid>/status`` of its own children only, every ``OMNISTAGE_DEATH_WATCH_S`` (one
small read each, ~25 us), and waits on a pidfd meanwhile, so a plain exit is still seen
the moment it happens.

Seen dying, the process is also *hastened*: every thread still there gets the watcher's
own nice back (the kill made the reason for nicing moot), so its teardown, its sockets'
close and its memory come in ~0.5 s on busy cores instead of seconds. That is what makes
a replica killed under a headless supervisor (``omnistage serve --headless`` with
several replicas, a ``LocalLauncher`` too) seen quickly by a head on another host, which
only sees its connections close. Lowering a nice needs CAP_SYS_NICE or RLIMIT_NICE;
without either the process exits at its own pace and only this host's head sees it early.
"""

from __future__ import annotations

import logging
import os
import select
import signal
from collections.abc import Callable

from omnistage import envs
from omnistage.replica.load_priority import can_lower_to

log = logging.getLogger(__name__)

_SIGKILL_BIT = 1 << (signal.SIGKILL - 1)


def dying(pid: int) -> bool:
    """Whether process ``pid`` (not yet reaped) has been dealt a fatal signal or its
    leader thread has already exited: it is on its way out and cannot come back."""
    try:
        with open(f"/proc/{pid}/status") as f:
            status = f.read()
    except OSError:  # gone (or not Linux): the wait sees the exit
        return False
    pending = 0
    for line in status.splitlines():
        name, _, value = line.partition(":")
        if name == "State":
            if value.split()[:1] in (["Z"], ["X"]):
                return True
        elif name in ("SigPnd", "ShdPnd"):
            pending |= int(value.strip(), 16)
    return bool(pending & _SIGKILL_BIT)


def hasten(pid: int) -> int:
    """Give every remaining thread of dying process ``pid`` this process's nice, where it
    has a higher one; returns how many threads were changed."""
    try:
        base = os.getpriority(os.PRIO_PROCESS, 0)
        if not can_lower_to(base):
            return 0
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0
    changed = 0
    for name in tids:
        try:
            tid = int(name)
            if os.getpriority(os.PRIO_PROCESS, tid) > base:
                os.setpriority(os.PRIO_PROCESS, tid, base)
                changed += 1
        except OSError:  # that thread has exited meanwhile
            pass
    return changed


def watch(pid: int, on_dying: Callable[[], None], interval_s: float | None = None) -> None:
    """Block until child ``pid`` exits or is seen dying (then hasten it and call
    ``on_dying`` first); the caller reaps it after. Returns at once where there is
    nothing to watch with (no pidfd, the watch turned off)."""
    interval = envs.death_watch_s() if interval_s is None else interval_s
    if interval <= 0 or not hasattr(os, "pidfd_open"):
        return
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:  # reaped already, or an old kernel
        return
    try:
        poller = select.poll()
        poller.register(pidfd, select.POLLIN)
        while not poller.poll(interval * 1000):
            # The pidfd still unreadable after the read: the status was this child's,
            # not that of a process that took its pid after it was reaped.
            if dying(pid) and not poller.poll(0):
                changed = hasten(pid)
                log.debug("pid %d dying; %d niced threads hastened", pid, changed)
                on_dying()
                return
    finally:
        os.close(pidfd)
