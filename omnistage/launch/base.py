"""The launcher interface: what the head (and the headless supervisor) need from a
backend that starts replicas. Local subprocesses today; Ray actors implement the same."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from omnistage.replica.options import ReplicaOptions


class ReplicaProcess(Protocol):
    """One launched replica, whatever runs it."""

    options: ReplicaOptions

    @property
    def pid(self) -> int: ...


# Called (from a launcher thread) when a replica ends, with its exit code.
OnExit = Callable[[ReplicaProcess, int], None]


class Launcher(Protocol):
    def launch(self, options: ReplicaOptions) -> ReplicaProcess:
        """Start one replica with these options; it registers with the master itself."""
        ...

    def stop_all(self, grace_s: float) -> None:
        """Ask every replica to stop (drain); force those still running after ``grace_s``."""
        ...
