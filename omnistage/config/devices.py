"""Which accelerator devices each replica of a stage sees: a small pure rule (the config
validates ``devices`` with it; ``launch.devices`` applies it to a launching process).

A stage's ``devices`` is ``"cpu"`` (no placement: replicas inherit the launching
process's device visibility) or a list of device indices, ``"0,1,2,3"``. The list is a
pool the replicas of one launching process share: replica ``r`` takes the ``k``
consecutive entries ``devices[r*k : (r+1)*k]``, where ``k`` is the devices one replica
needs (``devices_per_replica``, else the engine's tensor x pipeline parallel size, else 1).

- Fewer devices than ``replicas * k``: a start-up error naming the stage.
- More: the rest are spares. The initial replicas do not see them; a replica added later
  (replica id ``n`` and up, an autoscaler's) takes the next ``k`` of them. A replica
  whose share lies past the end of the list is refused with an error naming the stage,
  never given devices another replica already uses: two engines on one GPU run it out of
  memory, which shows up later and far from its cause.

Unlike vLLM-Omni, a lone replica also takes only its ``k`` devices (vLLM-Omni hands it
the whole list), and there is no "template" form (a list of exactly ``k`` entries
repeated per replica): one rule for every count.

Indices are logical, as in vLLM-Omni: when the launching process itself already has the
platform's variable (``CUDA_VISIBLE_DEVICES=4,5,6,7``), index 0 is its first visible
device (4), so a replica never sees a device its parent was not given.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

# The variable that limits which devices a process sees (CUDA; ROCm reads it too).
DEVICE_ENV_VAR = "CUDA_VISIBLE_DEVICES"
NO_PLACEMENT = "cpu"
_INDEX = re.compile(r"[0-9]+")


class DevicesError(ValueError):
    """A stage's devices cannot be split among its replicas (or are malformed)."""


def parse_devices(devices: str) -> list[int] | None:
    """``"cpu"`` -> None; ``"0, 2,3"`` -> [0, 2, 3]. Raises DevicesError otherwise."""
    if devices.strip() == NO_PLACEMENT:
        return None
    parts = [p.strip() for p in devices.split(",")]
    if not all(_INDEX.fullmatch(p) for p in parts):
        raise DevicesError(
            f"must be {NO_PLACEMENT!r} or comma-separated device indices such as '0,1', "
            f"got {devices!r}"
        )
    ids = [int(p) for p in parts]
    if len(set(ids)) != len(ids):
        raise DevicesError(f"must not repeat a device, got {devices!r}")
    return ids


def _parse(devices: str, stage: str) -> list[int] | None:
    try:
        return parse_devices(devices)
    except DevicesError as exc:
        raise DevicesError(f"{stage}: devices {exc}") from None


def devices_per_replica(explicit: int | None, engine_args: Mapping[str, Any]) -> int:
    """Devices one replica needs: the stage's own number, else what its engine args ask
    for (tensor_parallel_size x pipeline_parallel_size, vLLM's names), else 1."""
    if explicit is not None:
        return explicit
    need = 1
    for key in ("tensor_parallel_size", "pipeline_parallel_size"):
        value = engine_args.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            need *= value
    return need


def device_share(devices: str, index: int, per_replica: int, stage: str) -> str | None:
    """The devices replica ``index`` (0-based within its launching process) sees, as
    configured (logical indices); None for ``"cpu"``."""
    ids = _parse(devices, stage)
    if ids is None:
        return None
    start, end = index * per_replica, (index + 1) * per_replica
    if end > len(ids):
        raise DevicesError(
            f"{stage}: replica {index} needs devices {start}..{end - 1} of devices="
            f"{devices!r}, which has only {len(ids)} "
            f"({per_replica} per replica); list more devices for its replicas"
        )
    return ",".join(str(i) for i in ids[start:end])


def split_devices(devices: str, replicas: int, per_replica: int, stage: str) -> list[str | None]:
    """One share per replica (see the module doc); the error names ``stage``."""
    ids = _parse(devices, stage)
    if ids is None:
        return [None] * replicas
    need = replicas * per_replica
    if need > len(ids):
        raise DevicesError(
            f"{stage}: {replicas} replica(s) x {per_replica} device(s) each need {need} "
            f"devices, but devices={devices!r} lists {len(ids)}"
        )
    return [device_share(devices, r, per_replica, stage) for r in range(replicas)]


def visible_devices(share: str | None, inherited: str | None, stage: str) -> str | None:
    """The variable's value for a replica given its ``share``: the logical indices mapped
    through the launcher's own ``inherited`` value when it has one. None: leave it be."""
    if share is None:
        return None
    if inherited is None or not inherited.strip():
        return share
    # The parent's own list (ids, or UUIDs such as GPU-8f2...): index into it.
    parent = [p.strip() for p in inherited.split(",") if p.strip()]
    mapped = []
    for index in (int(p) for p in share.split(",")):
        if index >= len(parent):
            raise DevicesError(
                f"{stage}: device {index} is not visible here: {DEVICE_ENV_VAR}="
                f"{inherited!r} gives this process {len(parent)} device(s), and devices "
                f"are indices into them"
            )
        mapped.append(parent[index])
    return ",".join(mapped)
