"""The launcher interface: what the head (and the headless supervisor) need from a
backend that starts replicas: local subprocesses (``launch.local``) or Ray actors
(``launch.ray``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

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
