"""``omnistage serve --headless``: run replicas of one stage that join a remote head.

With --omni-dp-size-local 1 the replica runs in this process; with K > 1 this process
supervises K replica processes, each registering with an auto-assigned id, and
forwards SIGTERM/SIGINT to them.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import threading

from omnistage import aio
from omnistage.launch.local import LocalLauncher
from omnistage.replica.options import ReplicaOptions
from omnistage.replica.runtime import ReplicaRuntime

log = logging.getLogger(__name__)


def run_headless(args: argparse.Namespace) -> int:
    opts = replica_options(args)
    if args.omni_dp_size_local == 1:
        return aio.run(ReplicaRuntime(opts).run())
    return _supervise(opts, args.omni_dp_size_local)


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


def _supervise(opts: ReplicaOptions, count: int) -> int:
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
    for _ in range(count):
        launcher.launch(opts)
    while not all_done.wait(0.2):
        if stop.is_set():
            # The children drain first; kill only those that outlive their drain.
            launcher.stop_all(grace_s=opts.drain_timeout_s + 5.0)
            all_done.wait(5)
            break
    return max(codes, default=0)
