"""Launchers: how replica processes are started, watched and stopped, behind one interface
(``base.Launcher``). ``local`` runs subprocesses on this host; ``ray`` runs each replica
under a Ray actor placed by the cluster."""

from __future__ import annotations

from typing import TYPE_CHECKING

from omnistage.launch.base import Launcher, OnExit

if TYPE_CHECKING:
    from omnistage.head.options import HeadOptions


def make_launcher(opts: HeadOptions, on_exit: OnExit) -> Launcher:
    """The launcher for ``--worker-backend``; Ray is imported only when chosen."""
    if opts.worker_backend == "ray":
        from omnistage.launch.ray import RayLauncher

        return RayLauncher(opts.config, opts.ray_address, on_exit=on_exit)
    from omnistage.launch.local import LocalLauncher

    return LocalLauncher(on_exit=on_exit)
