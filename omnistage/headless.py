"""``omnistage serve --headless``: run replicas of one stage that join a remote head.

With --omni-dp-size-local 1 the replica runs in this process; with K > 1 this process
supervises K replica processes, each registering with an auto-assigned id, and
forwards SIGTERM/SIGINT to them. Each gets its own share of this host's devices
(``HeadlessOptions.replica_devices``). The CLI builds the options from its flags
(``cli/serve.py``) and checks the devices split before anything starts.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from dataclasses import dataclass

import msgspec

from omnistage import aio
from omnistage.config.devices import (
    DEVICE_ENV_VAR,
    NO_PLACEMENT,
    DevicesError,
    devices_per_replica,
    split_devices,
)
from omnistage.launch.devices import replica_visible_devices
from omnistage.launch.local import LocalLauncher
from omnistage.replica.options import ReplicaOptions
from omnistage.replica.runtime import ReplicaRuntime

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HeadlessOptions:
    """What ``omnistage serve --headless`` runs: ``dp_size_local`` replicas of one stage
    with ``replica``'s options (ids auto-assigned), each with its share of this host's
    devices."""

    replica: ReplicaOptions
    dp_size_local: int = 1

    def replica_devices(self) -> list[str | None]:
        """Each local replica's devices (the CUDA_VISIBLE_DEVICES value; None: inherited).

        The stage's config arrives from the head only after a replica registers, and its
        ``devices`` describe the head's host anyway: this host's devices are the
        ``devices`` (and ``devices_per_replica``, ``engine_args``) of the replica's own
        ``stage_overrides``, split among the local replicas by ``launch.devices``' rule.
        Without ``devices`` there, the replicas inherit this process's visibility.
        Raises DevicesError naming the stage if they cannot be split.
        """
        own = self.replica.stage_overrides
        devices = own.get("devices", NO_PLACEMENT)
        per = own.get("devices_per_replica")
        engine_args = own.get("engine_args")
        label = f"stage {self.replica.stage_id}"
        if not isinstance(devices, str):
            raise DevicesError(f"{label}: devices must be a string such as '0,1'")
        if per is not None and (not isinstance(per, int) or isinstance(per, bool) or per < 1):
            raise DevicesError(f"{label}: devices_per_replica must be an int >= 1")
        each = devices_per_replica(per, engine_args if isinstance(engine_args, dict) else {})
        count = self.dp_size_local
        split_devices(devices, count, each, label)
        return [replica_visible_devices(devices, r, each, label) for r in range(count)]


def run_headless(opts: HeadlessOptions) -> int:
    shares = opts.replica_devices()
    if shares[0] is not None:
        log.info(
            "stage %d: %d local replica(s) see %s = %s",
            opts.replica.stage_id,
            opts.dp_size_local,
            DEVICE_ENV_VAR,
            shares,
        )
    each = [msgspec.structs.replace(opts.replica, visible_devices=share) for share in shares]
    if len(each) == 1:
        if each[0].visible_devices is not None:
            # Before any engine library loads (they read it once, at import).
            os.environ[DEVICE_ENV_VAR] = each[0].visible_devices
        return aio.run(ReplicaRuntime(each[0]).run())
    return _supervise(each)


def _supervise(each: list[ReplicaOptions]) -> int:
    count = len(each)
    opts = each[0]
    codes: list[int] = []
    all_done = threading.Event()

    def on_exit(_proc, code: int) -> None:  # type: ignore[no-untyped-def]
        codes.append(code)
        if len(codes) == count:
            all_done.set()

    launcher = LocalLauncher(on_exit=on_exit)
    stop = threading.Event()

    def on_signal(sig: int, _frame) -> None:  # type: ignore[no-untyped-def]
        log.info("received %s; stopping %d replicas", signal.Signals(sig).name, count)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    for options in each:
        launcher.launch(options)
    while not all_done.wait(0.2):
        if stop.is_set():
            # The children drain first; kill only those that outlive their drain.
            launcher.stop_all(grace_s=opts.drain_timeout_s + 5.0)
            all_done.wait(5)
            break
    return max(codes, default=0)
