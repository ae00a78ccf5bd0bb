"""The ``omnistage`` command line: its parser, and the validation of the serve flags.

The serve flags themselves are data (``cli/flags.py``). Validation runs before anything
starts; a violation is one line naming the flag, and exit code 2. It leaves the parsed
flags alone and returns a copy with the defaults that depend on other flags filled in.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from dataclasses import dataclass
from typing import Any

from omnistage import defaults, envs
from omnistage.cli.flags import (
    DIFFUSION_FLAGS,
    DIFFUSION_JSON,
    MODEL_OR_CONFIG,
    SERVE_GROUPS,
    add_flags,
    dest_of,
    flag,
)
from omnistage.cli.status import DEFAULT_URL, default_url

HEARTBEAT_INTERVAL_S = defaults.HEARTBEAT_INTERVAL_S
_BOTH_MASTER_FLAGS = "both --omni-master-address (-oma) and --omni-master-port (-omp)"


class UsageError(Exception):
    """A flag value or combination that cannot work; reported with exit code 2."""


class ChoiceError(UsageError):
    """A value outside a flag's ``choices``, found while parsing ``prog``'s flags."""

    def __init__(self, prog: str, message: str) -> None:
        super().__init__(message)
        self.prog = prog


class _Parser(argparse.ArgumentParser):
    """Reports a value outside a flag's ``choices`` like validate's errors: one line
    naming the flag and the value (argparse's own message comes after the usage)."""

    def _check_value(self, action: argparse.Action, value: Any) -> None:
        if action.choices is not None and value not in action.choices:
            name = action.option_strings[-1] if action.option_strings else action.dest
            choices = ", ".join(map(str, action.choices))
            raise ChoiceError(self.prog, f"{name}={value!r} is not one of: {choices}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="omnistage")
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command", parser_class=_Parser)
    keys = sub.add_parser(
        "curve-keys",
        help="create the CURVE keypairs for --omni-curve-keys",
        description="Write server.key(_secret) and client.key(_secret) into DIR.",
    )
    keys.add_argument("directory", metavar="DIR")
    _add_tokenizer_parser(sub)
    _add_status_parser(sub)
    serve = sub.add_parser(
        "serve",
        help="serve a pipeline (head), or one stage's replicas (--headless)",
        description="Serve a multi-stage pipeline behind an OpenAI-compatible API.",
    )
    for title, flags in SERVE_GROUPS:
        add_flags(serve.add_argument_group(title), flags)
    return parser


def _add_tokenizer_parser(sub: argparse._SubParsersAction) -> None:
    tok = sub.add_parser(
        "tokenizer",
        help="print the directory of an llm stage's tokenizer (for benchmark clients)",
        description="Print the local directory holding the tokenizer files (tokenizer.json, "
        "tokenizer_config.json, chat template) of the pipeline's text-writing llm stage, "
        'converting the model once if needed; e.g. aiperf --tokenizer "$(omnistage '
        'tokenizer)".',
    )
    add_flags(tok, (MODEL_OR_CONFIG,))
    tok.add_argument(
        "--stage",
        default=None,
        metavar="NAME_OR_ID",
        help="the llm stage, by name or stage id (default: the one writing the text answer)",
    )


def _add_status_parser(sub: argparse._SubParsersAction) -> None:
    st = sub.add_parser(
        "status",
        help="show a running pipeline's stages and replicas in the terminal",
        description="Print the head's stages, replicas, load and recent state changes "
        "(from GET /v1/omni/stages and /metrics); --watch redraws until Ctrl-C.",
    )
    status_flags = (
        flag(
            "--url",
            env=default_url,
            help=f"the head's HTTP address (default $OMNISTAGE_URL or {DEFAULT_URL})",
        ),
        flag(
            "--watch",
            nargs="?",
            type=float,
            const=1.0,
            default=None,
            metavar="SECONDS",
            help="redraw every SECONDS (default %(const)s) until Ctrl-C",
        ),
        flag(
            "--api-key",
            env=envs.api_key,
            help="the head's --api-key, sent as a Bearer token (env OMNISTAGE_API_KEY)",
        ),
    )
    add_flags(st, status_flags)


@dataclass(frozen=True)
class Bound:
    """A lower bound on one numeric flag; an unset (None) flag passes."""

    name: str
    low: float
    strict: bool = False  # > low, not >= low

    def check(self, args: argparse.Namespace) -> None:
        value = getattr(args, dest_of(self.name))
        if value is None or not (value <= self.low if self.strict else value < self.low):
            return
        op = ">" if self.strict else ">="
        raise UsageError(f"{self.name} must be {op} {self.low:g}, got {_show(value)}")


BOUNDS = (
    Bound("--stage-id", 0),
    Bound("--omni-dp-size-local", 0),
    Bound("--omni-heartbeat-timeout", 0, strict=True),
    Bound("--drain-timeout", 0),
    Bound("--stage-init-timeout", 0, strict=True),
    Bound("--init-timeout", 0, strict=True),
    Bound("--omni-stage-wait-timeout", 0, strict=True),
    Bound("--omni-restart-wait-timeout", 0, strict=True),
    Bound("--omni-max-retries", 0),
    Bound("--omni-stall-timeout", 0),
    Bound("--api-server-count", 1),
    Bound("--omni-max-queue", 0),
    Bound("--max-request-bytes", 1),
    Bound("--realtime-max-sessions", 1),
    Bound("--realtime-idle-timeout", 0, strict=True),
    Bound("--realtime-resume-ttl", 0),
    Bound("--media-ttl", 0),
    Bound("--media-fetch-timeout", 0, strict=True),
    Bound("--media-fetch-max-bytes", 1),
    Bound("--job-lease", 1),
)
PORTS = ("--port", "--omni-master-port")


def _show(value: float) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def stall_timeout(args: argparse.Namespace) -> float:
    """--omni-stall-timeout, by default the longer of its own default and the heartbeat
    timeout: a replica is not called stalled before it could be called silent."""
    if args.omni_stall_timeout is not None:
        return args.omni_stall_timeout
    return max(defaults.STALL_TIMEOUT_S, args.omni_heartbeat_timeout)


def validate(args: argparse.Namespace) -> argparse.Namespace:
    """Raise UsageError naming the flag for any invalid value or combination; return the
    flags with ``omni_stall_timeout`` resolved (a copy: ``args`` is left as parsed).

    Each flag's own value is checked first, then how the flags combine."""
    for bound in BOUNDS:
        bound.check(args)
    for port in PORTS:
        value = getattr(args, dest_of(port))
        if value is not None and not 0 <= value <= 65535:
            raise UsageError(f"{port} must be in 0..65535, got {value}")
    _check_roles(args)
    _check_head_only(args)
    if args.omni_join is not None:
        join_address(args.omni_join)
    stall = stall_timeout(args)
    _check_timeouts(args.omni_heartbeat_timeout, stall)
    _check_curve_keys(args)
    _check_backend(args)
    for name in args.served_model_name or ():
        if not name.strip():
            raise UsageError("--served-model-name: a name must not be empty")
    if args.headless and args.stage_overrides:
        _check_headless_overrides(args.stage_overrides, args.stage_id)
    _check_diffusion_flags(args)
    if args.model_or_config and args.deploy_config:
        raise UsageError("give either MODEL_OR_CONFIG or --deploy-config, not both")
    return argparse.Namespace(**{**vars(args), "omni_stall_timeout": stall})


def _check_roles(args: argparse.Namespace) -> None:
    """The flags that make this process a headless replica or a one-stage head."""
    has_master = args.omni_master_address is not None and args.omni_master_port is not None
    if args.headless and args.stage_id is None:
        raise UsageError("--headless requires --stage-id")
    if args.headless and not has_master:
        raise UsageError(f"--headless requires {_BOTH_MASTER_FLAGS}")
    if args.stage_id is not None and not has_master:
        raise UsageError(f"--stage-id requires {_BOTH_MASTER_FLAGS}")
    if args.omni_replica_address is not None and not args.headless:
        raise UsageError("--omni-replica-address requires --headless")
    if args.omni_replica_binds_sockets and not args.headless:
        raise UsageError("--omni-replica-binds-sockets requires --headless")
    if args.replica_id is not None:
        if not args.headless:
            raise UsageError("--replica-id requires --headless")
        if args.replica_id < 0:
            raise UsageError(f"--replica-id must be >= 0, got {args.replica_id}")
        if args.omni_dp_size_local != 1:
            raise UsageError("--replica-id names one replica: use --omni-dp-size-local 1")
    if args.omni_dp_size_local != 1 and args.stage_id is None:
        raise UsageError("--omni-dp-size-local != 1 requires --stage-id")
    if args.omni_dp_size_local == 0 and args.headless:
        # A head may run none (every replica headless: a fleet of heads); a headless
        # process that runs none would do nothing.
        raise UsageError("--omni-dp-size-local must be >= 1 with --headless")


def _check_head_only(args: argparse.Namespace) -> None:
    if not args.headless:
        return
    if args.api_server_count != 1:
        raise UsageError("--api-server-count is for the head; --headless serves no HTTP")
    if args.served_model_name is not None:
        raise UsageError("--served-model-name is for the head; --headless serves no HTTP")
    if args.worker_backend == "ray":
        raise UsageError(
            "--worker-backend ray is for the head; a --headless replica runs as a process"
        )
    if args.omni_join is not None:
        raise UsageError(
            "--omni-join is for a head; a --headless replica finds the fleet's heads "
            "through the one at -oma/-omp"
        )


def join_address(value: str) -> tuple[str, int]:
    """--omni-join HOST:PORT (IPv6 as [HOST]:PORT), checked."""
    host, sep, port = value.strip().rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UsageError(
            f"--omni-join must be HOST:PORT (another head's -oma and -omp), got {value!r}"
        )
    return host, int(port)


def _check_timeouts(heartbeat: float, stall: float) -> None:
    if heartbeat < 2 * HEARTBEAT_INTERVAL_S:
        raise UsageError(
            f"--omni-heartbeat-timeout must be at least twice the heartbeat interval "
            f"({2 * HEARTBEAT_INTERVAL_S:g}s), got {heartbeat:g}"
        )
    if 0 < stall < heartbeat:
        raise UsageError(
            f"--omni-stall-timeout ({stall:g}s) must be 0 or at least "
            f"--omni-heartbeat-timeout ({heartbeat:g}s)"
        )


def _check_curve_keys(args: argparse.Namespace) -> None:
    if args.omni_curve_keys is None:
        return
    from omnistage import curve
    from omnistage.protocol.errors import ConfigError

    try:
        if not args.headless:
            curve.check_head_dir(args.omni_curve_keys)
        curve.check_replica_dir(args.omni_curve_keys)  # the head's for its local replicas
    except ConfigError as exc:
        raise UsageError(str(exc)) from None


def _check_backend(args: argparse.Namespace) -> None:
    if args.worker_backend == "ray" and not _importable("ray"):
        raise UsageError("--worker-backend ray needs Ray: pip install 'omnistage[ray]'")
    if args.ray_address is None:
        return
    if args.worker_backend != "ray":
        raise UsageError("--ray-address requires --worker-backend ray")
    if not args.ray_address.strip():
        raise UsageError("--ray-address must not be empty (give HOST:PORT, ray://... or auto)")


def _check_diffusion_flags(args: argparse.Namespace) -> None:
    for each in DIFFUSION_FLAGS:
        raw = getattr(args, each.dest)
        if each.dest not in DIFFUSION_JSON or raw is None:
            continue
        try:
            value = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise UsageError(f"{each.name}: not valid JSON: {exc.msg}") from None
        if not isinstance(value, dict):
            raise UsageError(f"{each.name} must be a JSON object, got {raw!r}")
    name = args.model_class_name
    if name is not None and not name.isidentifier():
        raise UsageError(f"--model-class-name must be a Python class name, got {name!r}")
    size = args.max_generated_image_size
    if size is not None and size < 64 * 64:
        raise UsageError(f"--max-generated-image-size must be >= 4096 (64x64), got {size}")


def _check_headless_overrides(raw: str, stage_id: int) -> None:
    """A headless replica applies its own stage's overrides on top of the head's config;
    the config itself arrives later, so only the shape and field names are checked here."""
    from omnistage.config.schema import StageConfig

    try:
        overrides = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise UsageError(f"--stage-overrides: not valid JSON: {exc.msg}") from None
    if not isinstance(overrides, dict) or not all(isinstance(v, dict) for v in overrides.values()):
        raise UsageError('--stage-overrides must look like {"<stage_id>": {field: value}}')
    fields = overrides.get(str(stage_id), {})
    unknown = sorted(set(fields) - set(StageConfig.model_fields))
    if unknown:
        raise UsageError(f"--stage-overrides: unknown stage field(s) {', '.join(unknown)}")
    if "stage_id" in fields:
        raise UsageError("--stage-overrides: stage_id cannot be overridden")


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a broken install counts as missing
        return False
