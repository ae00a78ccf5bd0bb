"""The device rule (``config.devices``) applied in a launching process: a replica's share
is mapped through this process's own device visibility, read from its environment."""

from __future__ import annotations

import os

# Re-exported: the launch side (the CLI, --headless) takes the rule's names from here.
from omnistage.config.devices import (
    DEVICE_ENV_VAR,
    NO_PLACEMENT,
    DevicesError,
    device_share,
    devices_per_replica,
    parse_devices,
    split_devices,
    visible_devices,
)

__all__ = [
    "DEVICE_ENV_VAR",
    "NO_PLACEMENT",
    "DevicesError",
    "device_share",
    "devices_per_replica",
    "inherited_visible_devices",
    "parse_devices",
    "replica_visible_devices",
    "split_devices",
    "visible_devices",
]


def inherited_visible_devices() -> str | None:
    """This process's own device list, which replica shares index into."""
    return os.environ.get(DEVICE_ENV_VAR)


def replica_visible_devices(devices: str, index: int, per_replica: int, stage: str) -> str | None:
    """What replica ``index`` launched from this process sets the variable to (None: the
    stage has no placement and the replica inherits this process's visibility)."""
    share = device_share(devices, index, per_replica, stage)
    return visible_devices(share, inherited_visible_devices(), stage)
