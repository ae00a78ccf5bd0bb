"""``omnistage serve --headless``: run replicas of one stage that join a remote head.

With --omni-dp-size-local 1 the replica runs in this process; with K > 1 this process
supervises K replica processes, each registering with an auto-assigned id, and
forwards SIGTERM/SIGINT to them. Each gets its own share of this host's devices
(``replica_devices``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import threading

import msgspec

from omnistage import aio
from omnistage.launch.devices import (
    DEVICE_ENV_VAR,
    NO_PLACEMENT,
    DevicesError,
    devices_per_replica,
    replica_visible_devices,
    split_devices,
)
from omnistage.launch.local import LocalLauncher
from omnistage.replica.options import ReplicaOptions
from omnistage.replica.runtime import ReplicaRuntime

log = logging.getLogger(__name__)


def run_headless(args: argparse.Namespace) -> int:
    opts = replica_options(args)
    each = [
        msgspec.structs.replace(opts, visible_devices=share)
        for share in replica_devices(args, args.omni_dp_size_local)
    ]
    if args.omni_dp_size_local == 1:
        if each[0].visible_devices is not None:
            # Before any engine library loads (they read it once, at import).
            os.environ[DEVICE_ENV_VAR] = each[0].visible_devices
        return aio.run(ReplicaRuntime(each[0]).run())
    return _supervise(each)


def replica_options(args: argparse.Namespace) -> ReplicaOptions:
    """The options of every replica this headless process runs (ids auto-assigned)."""
    return ReplicaOptions(
        stage_id=args.stage_id,
        master_host=args.omni_master_address,
        master_port=args.omni_master_port,
        advertise_address=args.omni_replica_address,
        stage_init_timeout_s=args.stage_init_timeout,
        stage_overrides=_stage_overrides(args),
        binds_sockets=args.omni_replica_binds_sockets,
        drain_timeout_s=args.drain_timeout,
        auth_token=args.omni_auth_token,
        rejoin=True,
        curve_keys=args.omni_curve_keys,
        log_level=args.log_level,
        otlp_traces_endpoint=args.otlp_traces_endpoint,
    )


def _stage_overrides(args: argparse.Namespace) -> dict:
    """This stage's entry of --stage-overrides, applied on top of the head's config."""
    from omnistage.cli.engine_flags import headless_overrides

    raw = json.loads(args.stage_overrides) if args.stage_overrides else {}
    own = dict(raw.get(str(args.stage_id)) or raw.get(args.stage_id) or {})
    return headless_overrides(own, args)  # plus the diffusion flags given


def replica_devices(args: argparse.Namespace, count: int) -> list[str | None]:
    """Each local replica's devices (the CUDA_VISIBLE_DEVICES value; None: inherited).

    The stage's config arrives from the head only after a replica registers, and its
    ``devices`` describe the head's host anyway: this host's devices are the ``devices``
    (and ``devices_per_replica``, ``engine_args``) of its own --stage-overrides entry,
    split among its --omni-dp-size-local replicas by ``launch.devices``' rule. Without
    ``devices`` there, the replicas inherit this process's visibility.
    """
    from omnistage.cli.args import UsageError

    own = _stage_overrides(args)
    devices = own.get("devices", NO_PLACEMENT)
    per = own.get("devices_per_replica")
    engine_args = own.get("engine_args")
    label = f"stage {args.stage_id}"
    if not isinstance(devices, str):
        raise UsageError(f"--stage-overrides: {label}: devices must be a string such as '0,1'")
    if per is not None and (not isinstance(per, int) or isinstance(per, bool) or per < 1):
        raise UsageError(f"--stage-overrides: {label}: devices_per_replica must be an int >= 1")
    each = devices_per_replica(per, engine_args if isinstance(engine_args, dict) else {})
    try:
        split_devices(devices, count, each, label)
        shares = [replica_visible_devices(devices, r, each, label) for r in range(count)]
    except DevicesError as exc:
        raise UsageError(f"--stage-overrides: {exc}") from None
    if shares[0] is not None:
        log.info("%s: %d local replica(s) see %s = %s", label, count, DEVICE_ENV_VAR, shares)
    return shares


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
