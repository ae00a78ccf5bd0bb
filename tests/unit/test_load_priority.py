"""A replica loads niced and serves at its own priority (replica/load_priority.py), in a
child process of its own: nice is per thread and must not leak into the test process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

CHILD = r"""
import json, os, threading
from omnistage.replica import load_priority as lp

def nice(tid=None):
    return os.getpriority(os.PRIO_PROCESS, tid or threading.get_native_id())

before = threading.Thread(target=lambda: None)  # started before the load: not niced
seen = {}
early = threading.Event(); done = threading.Event()
def waiter(key, extra=0):
    if extra:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice() + extra)
    seen[key + "_tid"] = threading.get_native_id()
    seen[key] = nice()
    early.set() if key == "early" else None
    done.wait()
t0 = threading.Thread(target=waiter, args=("early",)); t0.start(); early.wait()
lowered = lp.lower_for_load(5)
seen["main_loading"] = nice()
t1 = threading.Thread(target=waiter, args=("loader",)); t1.start()
t2 = threading.Thread(target=waiter, args=("later", 3)); t2.start()
while "loader" not in seen or "later" not in seen: pass
lowered.restore()
seen["after"] = {k: nice(seen[k + "_tid"]) for k in ("early", "loader", "later")}
seen["main_after"] = nice()
seen["step"] = lowered.step
done.set()
print(json.dumps(seen))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="nice is per thread on Linux")
def test_threads_started_while_loading_are_niced_and_restored_keeping_their_own_offsets():
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    out = subprocess.run(
        [sys.executable, "-c", CHILD], capture_output=True, text=True, env=env, timeout=60
    )
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout)
    base = seen["early"]
    if os.geteuid() != 0 and seen["step"] == 0:
        pytest.skip("no permission to lower a nice again here: the load is not niced")
    assert seen["step"] == 5
    assert seen["main_loading"] == seen["loader"] == base + 5  # inherited while loading
    assert seen["later"] == base + 8  # niced further on purpose (TTS later sentences)
    # Ready: back to the process's own priority; the extra offset kept; none below base.
    assert seen["after"] == {"early": base, "loader": base, "later": base + 3}
    assert seen["main_after"] == base


def test_a_zero_step_nices_nothing():
    from omnistage.replica.load_priority import NOT_LOWERED, lower_for_load

    assert lower_for_load(0) is NOT_LOWERED
    NOT_LOWERED.restore()  # a no-op


HURRIED = r"""
import os, sys, threading
from omnistage.replica import load_priority as lp

def nice(tid=None):
    return os.getpriority(os.PRIO_PROCESS, tid or threading.get_native_id())

lowered = lp.lower_for_load(5)
ready = threading.Event()
def later():  # started while loading, niced further on purpose
    os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice() + 3)
    ready.set()
    threading.Event().wait()
threading.Thread(target=later, daemon=True).start()
ready.wait()
print(lowered.step, flush=True)
sys.stdin.readline()  # the parent hurries us meanwhile
lowered.restore()  # ready: nothing left to undo
print(sorted(nice(int(t)) for t in os.listdir("/proc/self/task")), flush=True)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="nice is per thread on Linux")
def test_the_head_hurries_a_niced_load_to_full_priority_keeping_offsets_on_purpose():
    from omnistage.replica.load_priority import hurry

    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    child = subprocess.Popen(
        [sys.executable, "-c", HURRIED], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        text=True, env=env,
    )  # fmt: skip
    try:
        assert child.stdout is not None and child.stdin is not None
        if child.stdout.readline().strip() == "0":
            pytest.skip("no permission to lower a nice again here: the load is not niced")
        base = os.getpriority(os.PRIO_PROCESS, 0)
        tids = [int(t) for t in os.listdir(f"/proc/{child.pid}/task")]
        assert sorted(os.getpriority(os.PRIO_PROCESS, t) for t in tids) == [base + 5, base + 8]
        assert hurry(child.pid, 5)
        assert sorted(os.getpriority(os.PRIO_PROCESS, t) for t in tids) == [base, base + 3]
        child.stdin.write("\n")
        child.stdin.flush()
        # Its own restore at ready lowers nothing further (never below its base).
        assert child.stdout.readline().strip() == str([base, base + 3])
    finally:
        child.kill()
        child.wait()
