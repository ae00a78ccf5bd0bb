"""The device rule (``config.devices``) applied in a launching process: a replica's share
is mapped through this process's own device visibility, read from its environment."""

from __future__ import annotations

import os

from omnistage.config.devices import DEVICE_ENV_VAR, device_share, visible_devices


def inherited_visible_devices() -> str | None:
    """This process's own device list, which replica shares index into."""
    return os.environ.get(DEVICE_ENV_VAR)


def replica_visible_devices(devices: str, index: int, per_replica: int, stage: str) -> str | None:
    """What replica ``index`` launched from this process sets the variable to (None: the
    stage has no placement and the replica inherits this process's visibility)."""
    share = device_share(devices, index, per_replica, stage)
    return visible_devices(share, inherited_visible_devices(), stage)
