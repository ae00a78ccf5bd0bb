"""Starting replica processes on this host, and noticing at once when one exits.

Each child runs ``python -m omnistage.replica`` with its options as one encoded blob in
its environment (see ``replica.options``).
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys

from omnistage.config.devices import DEVICE_ENV_VAR
from omnistage.launch import death_watch
from omnistage.launch.base import OnDying, OnExit, TrackingLauncher
from omnistage.replica.options import ReplicaOptions, encode_options

log = logging.getLogger(__name__)

REPLICA_ARGV = [sys.executable, "-m", "omnistage.replica"]


class LocalReplicaProcess:
    node: str | None = None  # this host

    def __init__(self, options: ReplicaOptions, proc: subprocess.Popen[bytes]) -> None:
        self.options = options
        self.proc = proc

    @property
    def pid(self) -> int:
        return self.proc.pid

    def terminate(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()

    def wait(self, timeout: float | None = None) -> int | None:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None


class LocalLauncher(TrackingLauncher[LocalReplicaProcess]):
    def __init__(self, on_exit: OnExit | None = None, on_dying: OnDying | None = None) -> None:
        super().__init__(on_exit, on_dying)

    def launch(self, options: ReplicaOptions) -> LocalReplicaProcess:
        proc = subprocess.Popen(REPLICA_ARGV, preexec_fn=die_with_parent, env=replica_env(options))
        handle = LocalReplicaProcess(options, proc)
        self._track(handle, self._watch, f"omni-watch-{proc.pid}")
        log.info("started stage %d replica process pid %d", options.stage_id, proc.pid)
        return handle

    def _watch(self, handle: LocalReplicaProcess) -> None:
        # A kill is seen when it lands, not when the last of the child's threads is gone
        # (seconds later where they are niced); wait() then returns the moment it exits.
        death_watch.watch(handle.pid, lambda: self._dying(handle))
        self._ended(handle, handle.proc.wait(), f"replica process pid {handle.pid}")

    def stop_all(self, grace_s: float = 10.0) -> None:
        """SIGTERM every child, then SIGKILL whoever is still there after ``grace_s``."""
        self._stopping = True
        procs = self.processes
        for p in procs:
            p.terminate()
        for p in procs:
            if p.wait(grace_s) is None:
                log.warning("replica pid %d did not exit in %.0fs; killing it", p.pid, grace_s)
                p.kill()
                p.wait(5)


def replica_env(options: ReplicaOptions) -> dict[str, str]:
    """A replica child's environment: ours, its options, and its own share of devices
    (which replaces ours: the share was already mapped through it, see config.devices)."""
    env = dict(os.environ)
    env["OMNISTAGE_REPLICA_OPTIONS"] = encode_options(options)
    if options.visible_devices is not None:
        env[DEVICE_ENV_VAR] = options.visible_devices
    return env


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Ask Linux to send this child ``sig`` when its parent dies (even by SIGKILL); run
    in the child, as a ``preexec_fn``. The signal follows the *thread* that forked it:
    fork from a thread that lives as long as the parent needs the child."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, sig)
    except OSError:
        pass
