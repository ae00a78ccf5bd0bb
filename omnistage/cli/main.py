"""``omnistage`` console entry: ``omnistage serve [MODEL_OR_CONFIG] [flags]``, and the
helpers ``omnistage curve-keys DIR``, ``omnistage tokenizer [MODEL_OR_CONFIG]`` and
``omnistage status [--url URL] [--watch [SECONDS]]``."""

from __future__ import annotations

import argparse
import sys

from omnistage import __version__
from omnistage.cli.args import ChoiceError, UsageError, build_parser
from omnistage.cli.serve import serve
from omnistage.config.load import load_config
from omnistage.logs import setup_logging
from omnistage.protocol.errors import ConfigError, EngineError


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except ChoiceError as exc:
        print(f"{exc.prog}: error: {exc}", file=sys.stderr)
        return 2
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
        return serve(args)
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


def _status(args: argparse.Namespace) -> int:
    from omnistage.cli.status import run

    if args.watch is not None and not args.watch > 0:
        print(f"omnistage status: error: --watch must be > 0, got {args.watch:g}", file=sys.stderr)
        return 2
    return run(args.url, args.watch, args.api_key)


if __name__ == "__main__":
    sys.exit(main())
