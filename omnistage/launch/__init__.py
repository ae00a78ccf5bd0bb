"""Launchers: how replica processes are started, watched and stopped, behind one interface
(``base.Launcher``). ``local`` runs subprocesses on this host; ``ray`` runs each replica
under a Ray actor placed by the cluster."""

from __future__ import annotations

from typing import TYPE_CHECKING

from omnistage.launch.base import Launcher, OnDying, OnExit

if TYPE_CHECKING:
    from omnistage.config.schema import DeployConfig


def make_launcher(
    backend: str,
    on_exit: OnExit,
    config: DeployConfig,
    ray_address: str | None = None,
    on_dying: OnDying | None = None,
) -> Launcher:
    """The launcher for ``--worker-backend`` (``multi_process`` or ``ray``); Ray is
    imported only when chosen, and places replicas by the stages' ``ray:`` specs in
    ``config`` on the cluster at ``ray_address``. ``on_dying``: a local replica seen
    killed before its process is gone (``launch.death_watch``)."""
    if backend == "ray":
        from omnistage.launch.ray import RayLauncher

        return RayLauncher(config, ray_address, on_exit=on_exit)
    from omnistage.launch.local import LocalLauncher

    return LocalLauncher(on_exit=on_exit, on_dying=on_dying)
