"""The launcher interface: what the head (and the headless supervisor) need from a
backend that starts replicas: local subprocesses (``launch.local``) or Ray actors
(``launch.ray``)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

from omnistage.replica.options import ReplicaOptions


class ReplicaProcess(Protocol):
    """One launched replica, whatever runs it."""

    options: ReplicaOptions

    @property
    def pid(self) -> int: ...

    # Where it runs, for the views of the running system: None for this host, else the
    # backend's name for the node (a Ray node id).
    node: str | None

    def terminate(self) -> None:
        """Ask it to drain (finish its requests, take no new ones) and exit."""
        ...

    def kill(self) -> None:
        """Stop it now."""
        ...


# Called (from a launcher thread) when a replica ends, with its exit code.
OnExit = Callable[[ReplicaProcess, int], None]
# Called (from a launcher thread) when a replica is seen killed before its process is
# gone (``launch.death_watch``); ``OnExit`` follows once it is.
OnDying = Callable[[ReplicaProcess], None]


log = logging.getLogger(__name__)
P = TypeVar("P", bound=ReplicaProcess)


class TrackingLauncher(Generic[P]):
    """What both launchers share: the replicas they run, each watched by a thread of
    its own that calls ``on_exit`` when it ends."""

    def __init__(self, on_exit: OnExit | None, on_dying: OnDying | None = None) -> None:
        self._on_exit = on_exit
        self._on_dying = on_dying
        self._procs: list[P] = []
        self._lock = threading.Lock()
        self._stopping = False

    @property
    def processes(self) -> list[P]:
        with self._lock:
            return list(self._procs)

    def _track(self, handle: P, watch: Callable[[P], None], name: str) -> P:
        with self._lock:
            self._procs.append(handle)
        threading.Thread(target=watch, args=(handle,), name=name, daemon=True).start()
        return handle

    def _dying(self, handle: P) -> None:
        """``handle`` was killed; its process is still exiting."""
        if self._on_dying is not None and not self._stopping:
            log.warning("replica process pid %d was killed; it is exiting", handle.pid)
            self._on_dying(handle)

    def _ended(self, handle: P, code: int, what: str) -> None:
        """``handle`` (``what`` names it; "": already said how) ended with ``code``."""
        if what and not self._stopping:
            level = logging.INFO if code == 0 else logging.WARNING
            log.log(level, "%s exited with code %d", what, code)
        if self._on_exit is not None:
            self._on_exit(handle, code)


class Launcher(Protocol):
    @property
    def processes(self) -> list[ReplicaProcess]:
        """The replicas it runs now."""
        ...

    def launch(self, options: ReplicaOptions) -> ReplicaProcess:
        """Start one replica with these options; it registers with the master itself."""
        ...

    def stop_all(self, grace_s: float) -> None:
        """Ask every replica to stop (drain); force those still running after ``grace_s``."""
        ...


def placed_nodes(launcher: Launcher) -> dict[tuple[int, int], str]:
    """Where each of ``launcher``'s replicas runs, when the backend places them (Ray)."""
    return {
        (p.options.stage_id, p.options.replica_id): p.node
        for p in launcher.processes
        if p.node is not None
    }
