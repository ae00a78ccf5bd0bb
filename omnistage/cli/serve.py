"""``omnistage serve``: the validated flags become the options of the head, or of a
``--headless`` replica supervisor, and that role runs.

Everything a flag can get wrong is found here, before anything starts, and raised as a
UsageError (exit code 2); the roles take typed options and raise their own errors.
"""

from __future__ import annotations

import argparse
import json
import logging
from typing import TYPE_CHECKING, Any

import zmq

from omnistage import aio, tracing
from omnistage.cli.args import UsageError, join_address, validate
from omnistage.config.devices import DevicesError
from omnistage.config.load import load_config
from omnistage.logs import setup_logging
from omnistage.net import tcp_url
from omnistage.protocol.errors import ConfigError
from omnistage.replica.options import ReplicaOptions

if TYPE_CHECKING:
    from omnistage.config.schema import DeployConfig
    from omnistage.head.options import HeadOptions
    from omnistage.headless import HeadlessOptions

log = logging.getLogger("omnistage.head")


def serve(args: argparse.Namespace) -> int:
    """Run what the flags ask for; raises UsageError for a flag that cannot work."""
    args = validate(args)
    if args.headless:
        return serve_headless(args)
    return serve_head(args)


def serve_head(args: argparse.Namespace) -> int:
    from omnistage.cli.engine_flags import apply_diffusion_flags, check_diffusion_models
    from omnistage.head.process import Head

    setup_logging(args.log_level)  # before the config: fetching a model by hub id logs
    try:
        config = load_config(args.deploy_config or args.model_or_config, args.stage_overrides)
    except ConfigError as exc:
        raise UsageError(f"invalid deploy config: {exc}") from None
    if args.stage_id is not None and args.stage_id not in config.stage_ids:
        raise UsageError(
            f"--stage-id {args.stage_id} is not a stage of {config.pipeline!r} "
            f"(stages: {', '.join(str(s) for s in config.stage_ids)})"
        )
    config = apply_diffusion_flags(config, args)
    opts = head_options(args, config)
    try:
        opts.check_devices()
    except DevicesError as exc:
        raise UsageError(str(exc)) from None
    source = args.deploy_config or args.model_or_config or config.pipeline
    check_diffusion_models(config, opts.local_replicas(), source)
    # Before the head: its orchestrator takes real span hooks only if tracing is on.
    tracing.configure(opts.otlp_traces_endpoint, "omnistage-head")
    try:
        head = Head(opts)
    except OSError as exc:
        # The HTTP port is claimed before anything starts.
        log.error(
            "cannot listen on %s:%d (--host/--port): %s", opts.host, opts.port, exc.strerror or exc
        )
        return 1
    except zmq.ZMQError as exc:
        log.error(
            "cannot bind the master on %s:%d (-oma/-omp): %s",
            opts.master_host,
            opts.master_port,
            exc,
        )
        return 1
    try:
        return aio.run(head.run())
    finally:
        tracing.shutdown()  # export the last batch of spans


def serve_headless(args: argparse.Namespace) -> int:
    from omnistage.headless import run_headless

    opts = headless_options(args)
    setup_logging(args.log_level)
    return run_headless(opts)


def headless_options(args: argparse.Namespace) -> HeadlessOptions:
    """The headless supervisor's options (validated flags); raises UsageError if this
    host's devices cannot be split among its --omni-dp-size-local replicas."""
    from omnistage.headless import HeadlessOptions

    replica = ReplicaOptions(
        stage_id=args.stage_id,
        replica_id=-1 if args.replica_id is None else args.replica_id,
        master_host=args.omni_master_address,
        master_port=args.omni_master_port,
        advertise_address=args.omni_replica_address,
        stage_init_timeout_s=args.stage_init_timeout,
        stage_overrides=_own_overrides(args),
        binds_sockets=args.omni_replica_binds_sockets,
        drain_timeout_s=args.drain_timeout,
        auth_token=args.omni_auth_token,
        rejoin=True,
        curve_keys=args.omni_curve_keys,
        log_level=args.log_level,
        otlp_traces_endpoint=args.otlp_traces_endpoint,
    )
    opts = HeadlessOptions(replica=replica, dp_size_local=args.omni_dp_size_local)
    try:
        opts.replica_devices()
    except DevicesError as exc:
        raise UsageError(f"--stage-overrides: {exc}") from None
    return opts


def _own_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """This stage's entry of --stage-overrides (applied on top of the head's config),
    plus the diffusion flags given."""
    from omnistage.cli.engine_flags import headless_overrides

    raw = json.loads(args.stage_overrides) if args.stage_overrides else {}
    return headless_overrides(dict(raw.get(str(args.stage_id)) or {}), args)


def head_options(args: argparse.Namespace, config: DeployConfig) -> HeadOptions:
    """The head's options from the validated flags and the loaded config."""
    from omnistage.head.options import HeadOptions, default_master_host

    return HeadOptions(
        config=config,
        host=args.host,
        port=args.port,
        master_host=args.omni_master_address
        or default_master_host(args.worker_backend, args.ray_address),
        master_port=args.omni_master_port or 0,
        stage_id=args.stage_id,
        dp_size_local=args.omni_dp_size_local,
        lb_policy=args.omni_lb_policy,
        heartbeat_timeout_s=args.omni_heartbeat_timeout,
        stage_init_timeout_s=args.stage_init_timeout,
        init_timeout_s=args.init_timeout,
        no_replica_wait_s=args.omni_stage_wait_timeout,
        restart_wait_s=args.omni_restart_wait_timeout,
        max_retries=args.omni_max_retries,
        stall_timeout_s=args.omni_stall_timeout,
        log_level=args.log_level,
        api_key=args.api_key,
        max_queue=args.omni_max_queue,
        restart_policy=args.omni_restart_policy,
        auth_token=args.omni_auth_token,
        curve_keys=args.omni_curve_keys,
        max_request_bytes=args.max_request_bytes,
        realtime_max_sessions=args.realtime_max_sessions,
        realtime_idle_timeout_s=args.realtime_idle_timeout,
        realtime_resume_ttl_s=args.realtime_resume_ttl,
        allowed_media_domains=tuple(args.allowed_media_domains or ()),
        media_fetch_timeout_s=args.media_fetch_timeout,
        media_fetch_max_bytes=args.media_fetch_max_bytes,
        store_url=args.store_url,
        media_url=args.media_url,
        media_ttl_s=args.media_ttl,
        job_lease_s=args.job_lease,
        log_stats=args.log_stats,
        api_server_count=args.api_server_count,
        served_model_names=tuple(args.served_model_name or ()),
        otlp_traces_endpoint=args.otlp_traces_endpoint,
        worker_backend=args.worker_backend,
        ray_address=args.ray_address,
        join=tcp_url(*join_address(args.omni_join)) if args.omni_join else None,
    )
