"""Starting replica processes on this host, and noticing at once when one exits.

The launcher is the seam for other backends: ``--worker-backend ray`` will provide a
class with the same ``launch``/``stop_all`` surface that places replicas on a Ray cluster.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)

OnExit = Callable[["LocalReplicaProcess", int], None]


@dataclass
class ReplicaSpec:
    stage_id: int
    master_host: str
    master_port: int
    replica_id: int = -1
    advertise_address: str | None = None
    stage_init_timeout_s: float = 300.0
    stage_overrides_json: str | None = None
    binds_sockets: bool = False
    drain_timeout_s: float = 30.0
    log_level: str = "INFO"
    # Passed in the environment, not argv: command lines are visible to every user.
    auth_token: str | None = None
    # Headless replicas outlive their head and register again; the head's own exit.
    rejoin: bool = False
    curve_keys: str | None = None
    local_key: str | None = None  # environment too: the key to head-local slots

    def argv(self) -> list[str]:
        args = [
            sys.executable,
            "-m",
            "omnistage.replica",
            "--stage-id",
            str(self.stage_id),
            "--replica-id",
            str(self.replica_id),
            "-oma",
            self.master_host,
            "-omp",
            str(self.master_port),
            "--stage-init-timeout",
            str(self.stage_init_timeout_s),
            "--log-level",
            self.log_level,
            "--drain-timeout",
            str(self.drain_timeout_s),
        ]
        if self.advertise_address:
            args += ["--omni-replica-address", self.advertise_address]
        if self.stage_overrides_json:
            args += ["--stage-overrides", self.stage_overrides_json]
        if self.binds_sockets:
            args.append("--omni-replica-binds-sockets")
        if self.rejoin:
            args.append("--rejoin")
        if self.curve_keys:
            args += ["--omni-curve-keys", self.curve_keys]
        return args


class LocalReplicaProcess:
    def __init__(self, spec: ReplicaSpec, proc: subprocess.Popen[bytes]) -> None:
        self.spec = spec
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


class LocalLauncher:
    def __init__(self, on_exit: OnExit | None = None) -> None:
        self._on_exit = on_exit
        self._procs: list[LocalReplicaProcess] = []
        self._lock = threading.Lock()
        self._stopping = False

    @property
    def processes(self) -> list[LocalReplicaProcess]:
        with self._lock:
            return list(self._procs)

    def launch(self, spec: ReplicaSpec) -> LocalReplicaProcess:
        env = dict(os.environ)
        if spec.auth_token:
            env["OMNISTAGE_AUTH_TOKEN"] = spec.auth_token
        env.pop("OMNISTAGE_LOCAL_KEY", None)
        if spec.local_key:
            env["OMNISTAGE_LOCAL_KEY"] = spec.local_key
        proc = subprocess.Popen(spec.argv(), preexec_fn=_die_with_parent, env=env)
        handle = LocalReplicaProcess(spec, proc)
        with self._lock:
            self._procs.append(handle)
        threading.Thread(
            target=self._watch, args=(handle,), name=f"omni-watch-{proc.pid}", daemon=True
        ).start()
        log.info("started stage %d replica process pid %d", spec.stage_id, proc.pid)
        return handle

    def _watch(self, handle: LocalReplicaProcess) -> None:
        # wait() returns the moment the child exits: no polling delay for local replicas.
        code = handle.proc.wait()
        if not self._stopping:
            level = logging.INFO if code == 0 else logging.WARNING
            log.log(level, "replica process pid %d exited with code %d", handle.pid, code)
        if self._on_exit is not None:
            self._on_exit(handle, code)

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


def _die_with_parent() -> None:
    """Ask Linux to SIGTERM this child if its parent dies (even by SIGKILL)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGTERM)
    except OSError:
        pass
