"""A launcher sees its child killed before the child's last thread is gone
(launch/death_watch.py): real child processes, real signals, the kernel's own view."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import pytest

from omnistage.launch import death_watch
from omnistage.replica.load_priority import can_lower_to

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not hasattr(os, "pidfd_open"), reason="Linux /proc"
)

# A thread niced to 19 that waits for its stdin to close, then ends the process; the
# main (leader) thread exits on its own first, as a killed process's nice-0 threads do.
LEADER_GONE = r"""
import ctypes, os, sys, threading
ready = threading.Event()
def survivor():
    os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    print(threading.get_native_id(), flush=True)
    ready.set()
    sys.stdin.buffer.read()
    os._exit(0)
threading.Thread(target=survivor).start()
ready.wait()
ctypes.CDLL(None).pthread_exit(None)
"""

# Busy niced threads computing outside the GIL and 100 MB of touched memory: a TTS
# replica's later-chunk pool at work.
BUSY_NICED = r"""
import hashlib, os, threading, time
ballast = bytearray(100 << 20)
for i in range(0, len(ballast), 4096):
    ballast[i] = 1
def spin():
    os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    data = bytes(1 << 20)
    while True:
        hashlib.sha256(data).digest()
for _ in range(2):
    threading.Thread(target=spin, daemon=True).start()
print("ready", flush=True)
time.sleep(600)
"""


def _child(code: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )


def test_a_child_whose_leader_exited_is_seen_dying_before_it_is_gone_and_hastened() -> None:
    proc = _child(LEADER_GONE)
    try:
        assert proc.stdout is not None and proc.stdin is not None
        survivor = int(proc.stdout.readline())
        calls: list[bool] = []
        # Returns only when seen dying (the child cannot exit before its stdin closes).
        seen = lambda: calls.append(os.path.exists(f"/proc/{proc.pid}"))  # noqa: E731
        watcher = threading.Thread(target=death_watch.watch, args=(proc.pid, seen, 0.01))
        watcher.start()
        watcher.join(30)
        assert calls == [True]  # seen while the process was still there
        assert proc.poll() is None  # and still is: its survivor waits on stdin
        ours = os.getpriority(os.PRIO_PROCESS, 0)
        expected = ours if can_lower_to(ours) else 19
        assert os.getpriority(os.PRIO_PROCESS, survivor) == expected
        proc.stdin.close()
        assert proc.wait(30) == 0
    finally:
        proc.kill()
        proc.wait()


def test_a_live_child_with_busy_niced_threads_is_not_dying_and_is_once_sigkilled() -> None:
    proc = _child(BUSY_NICED)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
        assert not any(death_watch.dying(proc.pid) for _ in range(50))
        seen: list[bool] = []
        watcher = threading.Thread(
            target=death_watch.watch, args=(proc.pid, lambda: seen.append(True), 0.01)
        )
        watcher.start()
        os.kill(proc.pid, signal.SIGKILL)
        watcher.join(30)
        assert not watcher.is_alive()  # seen dying, or seen gone: either way it returned
        assert proc.wait(30) == -signal.SIGKILL
        assert seen in ([], [True])
    finally:
        proc.kill()
        proc.wait()


def test_the_watch_returns_at_once_when_turned_off_and_on_a_plain_exit() -> None:
    proc = _child("print('ready', flush=True)")
    assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
    seen: list[bool] = []
    death_watch.watch(proc.pid, lambda: seen.append(True), 0)  # off: returns at once
    death_watch.watch(proc.pid, lambda: seen.append(True), 0.01)  # returns at the exit
    assert proc.wait(30) == 0 and seen == []
