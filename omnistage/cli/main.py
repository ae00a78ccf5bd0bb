"""``omnistage`` console entry: ``omnistage serve [MODEL_OR_CONFIG] [flags]``, and the
helpers ``omnistage curve-keys DIR``, ``omnistage tokenizer [MODEL_OR_CONFIG]`` and
``omnistage status [--url URL] [--watch [SECONDS]]``."""

from __future__ import annotations

import logging
import sys

import zmq

from omnistage import __version__, aio, tracing
from omnistage.cli.args import UsageError, build_parser, validate
from omnistage.config.load import load_config
from omnistage.launch.devices import DevicesError
from omnistage.logs import setup_logging
from omnistage.protocol.errors import ConfigError, EngineError

log = logging.getLogger("omnistage.head")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.version:
        print(f"omnistage {__version__}")
        return 0
    if args.command == "curve-keys":
        return _curve_keys(args.directory)
    if args.command == "tokenizer":
        return _tokenizer(args.model_or_config, args.stage)
    if args.command == "status":
        return _status(args)
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


def _tokenizer(model_or_config: str | None, stage: str | None) -> int:
    """Print the tokenizer directory, alone on stdout (for ``$(omnistage tokenizer)``)."""
    from omnistage.cli.tokenizer import tokenizer_dir

    try:
        config = load_config(model_or_config)
        setup_logging("INFO")  # to stderr: the one-time conversion takes ~30 s
        path = tokenizer_dir(config, stage)
    except (ConfigError, UsageError) as exc:
        print(f"omnistage tokenizer: error: {exc}", file=sys.stderr)
        return 2
    except EngineError as exc:
        print(f"omnistage tokenizer: error: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0


def _status(args) -> int:  # type: ignore[no-untyped-def]
    from omnistage.cli.status import run

    if args.watch is not None and not args.watch > 0:
        print(f"omnistage status: error: --watch must be > 0, got {args.watch:g}", file=sys.stderr)
        return 2
    return run(args.url, args.watch, args.api_key)


def _serve_head(args) -> int:  # type: ignore[no-untyped-def]
    from omnistage.cli.engine_flags import apply_diffusion_flags, check_diffusion_models
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
    config = apply_diffusion_flags(config, args)
    opts = HeadOptions.from_args(args, config)
    try:
        opts.check_devices()
    except DevicesError as exc:
        raise UsageError(str(exc)) from None
    source = args.deploy_config or args.model_or_config or config.pipeline
    check_diffusion_models(config, opts.local_replicas(), source)
    setup_logging(args.log_level)
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


def _serve_headless(args) -> int:  # type: ignore[no-untyped-def]
    from omnistage.headless import run_headless

    setup_logging(args.log_level)
    return run_headless(args)


if __name__ == "__main__":
    sys.exit(main())
