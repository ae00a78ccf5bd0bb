"""``omnistage`` console entry: ``omnistage serve [MODEL_OR_CONFIG] [flags]``."""

from __future__ import annotations

import sys

from omnistage import __version__, aio
from omnistage.cli.args import HEARTBEAT_INTERVAL_S, UsageError, build_parser, validate
from omnistage.config.load import load_config
from omnistage.logs import setup_logging
from omnistage.protocol.errors import ConfigError


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.version:
        print(f"omnistage {__version__}")
        return 0
    if args.command == "curve-keys":
        return _curve_keys(args.directory)
    if args.command != "serve":
        parser.print_help()
        return 2
    try:
        validate(args)
        if args.headless:
            return _serve_headless(args)
        return _serve_head(args)
    except UsageError as exc:
        print(f"omnistage serve: error: {exc}", file=sys.stderr)
        return 2


def _curve_keys(directory: str) -> int:
    from omnistage import curve

    try:
        paths = curve.generate(directory)
    except ConfigError as exc:
        print(f"omnistage curve-keys: error: {exc}", file=sys.stderr)
        return 2
    print("\n".join(str(p) for p in paths))
    print(
        "give the head and every replica --omni-curve-keys "
        f"{directory} (replica hosts need server.key and client.key_secret)"
    )
    return 0


def _serve_head(args) -> int:  # type: ignore[no-untyped-def]
    from omnistage.head import Head, HeadOptions

    try:
        config = load_config(args.deploy_config or args.model_or_config, args.stage_overrides)
    except ConfigError as exc:
        raise UsageError(f"invalid deploy config: {exc}") from None
    if args.stage_id is not None and args.stage_id not in config.stage_ids:
        raise UsageError(
            f"--stage-id {args.stage_id} is not a stage of {config.pipeline!r} "
            f"(stages: {', '.join(str(s) for s in config.stage_ids)})"
        )
    setup_logging(args.log_level)
    opts = HeadOptions(
        config=config,
        host=args.host,
        port=args.port,
        master_host=args.omni_master_address or "127.0.0.1",
        master_port=args.omni_master_port or 0,
        stage_id=args.stage_id,
        dp_size_local=args.omni_dp_size_local,
        lb_policy=args.omni_lb_policy,
        heartbeat_interval_s=HEARTBEAT_INTERVAL_S,
        heartbeat_timeout_s=args.omni_heartbeat_timeout,
        stage_init_timeout_s=args.stage_init_timeout,
        init_timeout_s=args.init_timeout,
        no_replica_wait_s=args.omni_stage_wait_timeout,
        max_retries=args.omni_max_retries,
        stall_timeout_s=args.omni_stall_timeout,
        log_level=args.log_level,
        api_key=args.api_key,
        max_queue=args.omni_max_queue,
        restart_policy=args.omni_restart_policy,
        auth_token=args.omni_auth_token,
        curve_keys=args.omni_curve_keys,
        max_request_bytes=args.max_request_bytes,
        log_stats=args.log_stats,
    )
    return aio.run(Head(opts).run())


def _serve_headless(args) -> int:  # type: ignore[no-untyped-def]
    from omnistage.headless import run_headless

    setup_logging(args.log_level)
    return run_headless(args)


if __name__ == "__main__":
    sys.exit(main())
