"""The ``omnistage serve`` flags and their validation.

Flag names follow vLLM-Omni's serve command. Validation runs before anything starts;
a violation is one line naming the flag, and exit code 2.
"""

from __future__ import annotations

import argparse
import importlib.util
import json

from omnistage import defaults, envs
from omnistage.control.balancing import POLICIES
from omnistage.launch.restart import POLICIES as RESTART_POLICIES

HEARTBEAT_INTERVAL_S = defaults.HEARTBEAT_INTERVAL_S
WORKER_BACKENDS = ("multi_process", "ray")


class UsageError(Exception):
    """A flag value or combination that cannot work; reported with exit code 2."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="omnistage")
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command")
    keys = sub.add_parser(
        "curve-keys",
        help="create the CURVE keypairs for --omni-curve-keys",
        description="Write server.key(_secret) and client.key(_secret) into DIR.",
    )
    keys.add_argument("directory", metavar="DIR")
    tok = sub.add_parser(
        "tokenizer",
        help="print the directory of an llm stage's tokenizer (for benchmark clients)",
        description="Print the local directory holding the tokenizer files (tokenizer.json, "
        "tokenizer_config.json, chat template) of the pipeline's text-writing llm stage, "
        'converting the model once if needed; e.g. aiperf --tokenizer "$(omnistage '
        'tokenizer)".',
    )
    tok.add_argument(
        "model_or_config",
        nargs="?",
        default=None,
        metavar="MODEL_OR_CONFIG",
        help="a built-in pipeline name or a deploy config YAML (default: the built-in default)",
    )
    tok.add_argument(
        "--stage",
        default=None,
        metavar="NAME_OR_ID",
        help="the llm stage, by name or stage id (default: the one writing the text answer)",
    )
    _add_status_parser(sub)
    s = sub.add_parser(
        "serve",
        help="serve a pipeline (head), or one stage's replicas (--headless)",
        description="Serve a multi-stage pipeline behind an OpenAI-compatible API.",
    )
    s.add_argument(
        "model_or_config",
        nargs="?",
        default=None,
        metavar="MODEL_OR_CONFIG",
        help="a built-in pipeline name or a deploy config YAML (default: the built-in default)",
    )
    s.add_argument("--host", default="127.0.0.1", help="HTTP bind address (default 127.0.0.1)")
    s.add_argument("--port", type=int, default=defaults.HTTP_PORT, help="HTTP port (default 8091)")
    s.add_argument("--deploy-config", default=None, metavar="PATH", help="deploy config YAML")
    s.add_argument(
        "--stage-overrides",
        default=None,
        metavar="JSON",
        help='per-stage field overrides, e.g. \'{"1": {"replicas": 2}}\'',
    )
    s.add_argument(
        "--stage-id",
        type=int,
        default=None,
        help="launch only this stage locally (head) or serve it (--headless)",
    )
    s.add_argument(
        "--headless",
        action="store_true",
        help="run replicas of --stage-id that join a head at -oma/-omp",
    )
    s.add_argument(
        "-oma",
        "--omni-master-address",
        default=None,
        help="master (registration) address; head default 127.0.0.1",
    )
    s.add_argument(
        "-omp",
        "--omni-master-port",
        type=int,
        default=None,
        help="master port; head default: a free port, logged at start",
    )
    s.add_argument(
        "-ora",
        "--omni-replica-address",
        default=None,
        help="this host's address as seen by the head (headless; auto-detected)",
    )
    s.add_argument(
        "--omni-replica-binds-sockets",
        action="store_true",
        help="headless: bind the replica's data sockets on its own address and let the "
        "head dial in (default: the replica dials the head)",
    )
    s.add_argument(
        "--omni-dp-size-local",
        type=int,
        default=1,
        help="replicas of --stage-id to run in this process tree (default 1)",
    )
    s.add_argument(
        "--omni-lb-policy",
        default=defaults.LB_POLICY,
        help=f"replica balancing: {', '.join(POLICIES)} (default random)",
    )
    s.add_argument(
        "--omni-heartbeat-timeout",
        type=float,
        default=defaults.HEARTBEAT_TIMEOUT_S,
        help="seconds of silence before a replica is marked ERROR (default 5)",
    )
    s.add_argument(
        "--omni-stall-timeout",
        type=float,
        default=None,
        help="seconds a replica may hold work without its engine making progress before "
        "it is marked ERROR and its requests move elsewhere; 0 disables (default 60, or "
        "the heartbeat timeout if that is longer)",
    )
    s.add_argument(
        "--omni-max-retries",
        type=int,
        default=defaults.MAX_RETRIES,
        help="times a request's stage is dispatched again after its replica fails "
        "(default 2; 0 fails the request at once)",
    )
    s.add_argument(
        "--omni-stage-wait-timeout",
        type=float,
        default=defaults.STAGE_WAIT_TIMEOUT_S,
        help="seconds a request waits for a live replica before 503 (default 3)",
    )
    s.add_argument(
        "--omni-max-queue",
        type=int,
        default=defaults.MAX_QUEUE,
        help="requests per stage that may wait for a free replica slot; more get 429 "
        "(default 1024)",
    )
    s.add_argument(
        "--max-request-bytes",
        type=int,
        default=defaults.MAX_REQUEST_BYTES,
        help="largest accepted HTTP request body; larger ones get 413 (default 16 MiB)",
    )
    s.add_argument(
        "--omni-auth-token",
        default=envs.auth_token(),
        help="shared secret that authenticates registrations, handshakes and heartbeats "
        "(HMAC); head and replicas must agree (env OMNISTAGE_AUTH_TOKEN)",
    )
    s.add_argument(
        "--omni-curve-keys",
        default=None,
        metavar="DIR",
        help="encrypt every control and data socket with CURVE and admit only replicas "
        "holding a client key from DIR (make one with `omnistage curve-keys DIR`); "
        "head and replicas pass the same directory",
    )
    s.add_argument(
        "--omni-restart-policy",
        default=defaults.RESTART_POLICY,
        help="head: restart local replicas that exit: never, on-failure (default), always; "
        "with backoff from 1 s to 30 s",
    )
    s.add_argument(
        "--drain-timeout",
        type=float,
        default=defaults.DRAIN_TIMEOUT_S,
        help="replica: on SIGTERM/SIGINT, finish in-flight requests for up to this many "
        "seconds before exiting (default 30; a second signal stops at once)",
    )
    s.add_argument(
        "--stage-init-timeout",
        type=float,
        default=defaults.STAGE_INIT_TIMEOUT_S,
        help="seconds a replica may take to register and load (default 300)",
    )
    s.add_argument(
        "--init-timeout",
        type=float,
        default=defaults.INIT_TIMEOUT_S,
        help="seconds the head waits for every stage to have a replica (default 600)",
    )
    s.add_argument(
        "--worker-backend",
        default="multi_process",
        help="how the head runs its replicas: multi_process (local processes, default) or "
        "ray (one Ray actor per replica, placed by the stage's `ray:` resources)",
    )
    s.add_argument(
        "--ray-address",
        default=None,
        help="Ray cluster to run replicas on (HOST:PORT, ray://HOST:PORT or auto); "
        "default with --worker-backend ray: start a local Ray instance",
    )
    s.add_argument(
        "--api-key",
        default=envs.api_key(),
        help="require 'Authorization: Bearer KEY' on /v1/* (env OMNISTAGE_API_KEY)",
    )
    s.add_argument(
        "--api-server-count",
        type=int,
        default=1,
        metavar="N",
        help="HTTP API server processes in front of the orchestrator (default 1: the head "
        "serves HTTP itself); more spread the HTTP work over cores",
    )
    s.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="the model names the API answers to (/v1/models, `model` of requests and "
        "responses; the first is the one reported) instead of the pipeline name",
    )
    _add_diffusion_flags(s)
    s.add_argument("--log-stats", action="store_true", help="log request statistics")
    s.add_argument(
        "--otlp-traces-endpoint",
        default=None,
        metavar="URL",
        help="export OpenTelemetry traces of requests over OTLP HTTP/protobuf to URL "
        "(e.g. http://collector:4318/v1/traces; default: the OTEL_EXPORTER_OTLP_* "
        "variables, else off); needs `pip install omnistage[otel]`",
    )
    s.add_argument(
        "--log-level",
        default=envs.log_level() or defaults.LOG_LEVEL,
        help="DEBUG, INFO, WARNING, ERROR (env OMNISTAGE_LOG_LEVEL)",
    )
    return parser


def _add_status_parser(sub: argparse._SubParsersAction) -> None:
    from omnistage.cli.status import default_url

    st = sub.add_parser(
        "status",
        help="show a running pipeline's stages and replicas in the terminal",
        description="Print the head's stages, replicas, load and recent state changes "
        "(from GET /v1/omni/stages and /metrics); --watch redraws until Ctrl-C.",
    )
    st.add_argument(
        "--url",
        default=default_url(),
        help="the head's HTTP address (default $OMNISTAGE_URL or http://127.0.0.1:8091)",
    )
    st.add_argument(
        "--watch",
        nargs="?",
        type=float,
        const=1.0,
        default=None,
        metavar="SECONDS",
        help="redraw every SECONDS (default 1) until Ctrl-C",
    )
    st.add_argument(
        "--api-key",
        default=envs.api_key(),
        help="the head's --api-key, sent as a Bearer token (env OMNISTAGE_API_KEY)",
    )


def _add_diffusion_flags(s: argparse.ArgumentParser) -> None:
    """vLLM-Omni's diffusion flags: each sets that engine_args key of every diffusion
    stage (see cli/engine_flags.py)."""
    g = s.add_argument_group("diffusion stages")
    g.add_argument(
        "--diffusers-load-kwargs",
        default=None,
        metavar="JSON",
        help='JSON object passed to from_pretrained(), e.g. \'{"variant": "fp16"}\'',
    )
    g.add_argument(
        "--diffusers-call-kwargs",
        default=None,
        metavar="JSON",
        help="JSON object merged into every pipeline call (a request's own params win)",
    )
    g.add_argument(
        "--model-class-name",
        default=None,
        metavar="NAME",
        help="diffusers pipeline class (default: the one model_index.json names)",
    )
    g.add_argument(
        "--max-generated-image-size",
        type=int,
        default=None,
        metavar="N",
        help="largest image in pixels (width * height; default 1048576, i.e. 1024x1024)",
    )
    g.add_argument("--vae-use-slicing", action="store_true", help="decode with VAE slicing")
    g.add_argument("--vae-use-tiling", action="store_true", help="decode with VAE tiling")
    g.add_argument(
        "--enable-cpu-offload",
        action="store_true",
        help="keep idle pipeline components on the CPU (needs a GPU)",
    )


def _validate_diffusion_flags(args: argparse.Namespace) -> None:
    for flag in ("diffusers_load_kwargs", "diffusers_call_kwargs"):
        raw = getattr(args, flag)
        if raw is None:
            continue
        name = f"--{flag.replace('_', '-')}"
        try:
            value = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise UsageError(f"{name}: not valid JSON: {exc.msg}") from None
        if not isinstance(value, dict):
            raise UsageError(f"{name} must be a JSON object, got {raw!r}")
    name = args.model_class_name
    if name is not None and not name.isidentifier():
        raise UsageError(f"--model-class-name must be a Python class name, got {name!r}")
    size = args.max_generated_image_size
    if size is not None and size < 64 * 64:
        raise UsageError(f"--max-generated-image-size must be >= 4096 (64x64), got {size}")


def validate(args: argparse.Namespace) -> None:
    """Raise UsageError naming the flag for any invalid value or combination."""
    has_master = args.omni_master_address is not None and args.omni_master_port is not None
    if args.headless:
        if args.stage_id is None:
            raise UsageError("--headless requires --stage-id")
        if not has_master:
            raise UsageError(
                "--headless requires both --omni-master-address (-oma) and "
                "--omni-master-port (-omp)"
            )
    if args.stage_id is not None:
        if args.stage_id < 0:
            raise UsageError(f"--stage-id must be >= 0, got {args.stage_id}")
        if not has_master:
            raise UsageError(
                "--stage-id requires both --omni-master-address (-oma) and "
                "--omni-master-port (-omp)"
            )
    if args.omni_replica_address is not None and not args.headless:
        raise UsageError("--omni-replica-address requires --headless")
    if args.omni_replica_binds_sockets and not args.headless:
        raise UsageError("--omni-replica-binds-sockets requires --headless")
    if args.omni_dp_size_local < 1:
        raise UsageError(f"--omni-dp-size-local must be >= 1, got {args.omni_dp_size_local}")
    if args.omni_dp_size_local != 1 and args.stage_id is None:
        raise UsageError("--omni-dp-size-local != 1 requires --stage-id")
    if args.omni_lb_policy not in POLICIES:
        raise UsageError(
            f"--omni-lb-policy={args.omni_lb_policy!r} is not one of: {', '.join(POLICIES)}"
        )
    if args.omni_heartbeat_timeout <= 0:
        raise UsageError(
            f"--omni-heartbeat-timeout must be > 0, got {args.omni_heartbeat_timeout:g}"
        )
    if args.omni_heartbeat_timeout < 2 * HEARTBEAT_INTERVAL_S:
        raise UsageError(
            f"--omni-heartbeat-timeout must be at least twice the heartbeat interval "
            f"({2 * HEARTBEAT_INTERVAL_S:g}s), got {args.omni_heartbeat_timeout:g}"
        )
    if args.omni_restart_policy not in RESTART_POLICIES:
        raise UsageError(
            f"--omni-restart-policy={args.omni_restart_policy!r} is not one of: "
            f"{', '.join(RESTART_POLICIES)}"
        )
    if args.drain_timeout < 0:
        raise UsageError(f"--drain-timeout must be >= 0, got {args.drain_timeout:g}")
    for flag in ("stage_init_timeout", "init_timeout", "omni_stage_wait_timeout"):
        if getattr(args, flag) <= 0:
            raise UsageError(f"--{flag.replace('_', '-')} must be > 0, got {getattr(args, flag):g}")
    if args.omni_curve_keys is not None:
        from omnistage import curve
        from omnistage.protocol.errors import ConfigError

        try:
            if args.headless:
                curve.check_replica_dir(args.omni_curve_keys)
            else:
                curve.check_head_dir(args.omni_curve_keys)
                curve.check_replica_dir(args.omni_curve_keys)  # for its local replicas
        except ConfigError as exc:
            raise UsageError(str(exc)) from None
    if args.omni_max_retries < 0:
        raise UsageError(f"--omni-max-retries must be >= 0, got {args.omni_max_retries}")
    if args.omni_stall_timeout is None:
        args.omni_stall_timeout = max(defaults.STALL_TIMEOUT_S, args.omni_heartbeat_timeout)
    if args.omni_stall_timeout < 0:
        raise UsageError(f"--omni-stall-timeout must be >= 0, got {args.omni_stall_timeout:g}")
    if 0 < args.omni_stall_timeout < args.omni_heartbeat_timeout:
        raise UsageError(
            f"--omni-stall-timeout ({args.omni_stall_timeout:g}s) must be 0 or at least "
            f"--omni-heartbeat-timeout ({args.omni_heartbeat_timeout:g}s)"
        )
    if args.api_server_count < 1:
        raise UsageError(f"--api-server-count must be >= 1, got {args.api_server_count}")
    if args.api_server_count != 1 and args.headless:
        raise UsageError("--api-server-count is for the head; --headless serves no HTTP")
    if args.served_model_name is not None:
        if args.headless:
            raise UsageError("--served-model-name is for the head; --headless serves no HTTP")
        for name in args.served_model_name:
            if not name.strip():
                raise UsageError("--served-model-name: a name must not be empty")
    if args.omni_max_queue < 0:
        raise UsageError(f"--omni-max-queue must be >= 0, got {args.omni_max_queue}")
    if args.max_request_bytes < 1:
        raise UsageError(f"--max-request-bytes must be >= 1, got {args.max_request_bytes}")
    for flag in ("port", "omni_master_port"):
        value = getattr(args, flag)
        if value is not None and not 0 <= value <= 65535:
            raise UsageError(f"--{flag.replace('_', '-')} must be in 0..65535, got {value}")
    if args.worker_backend not in WORKER_BACKENDS:
        raise UsageError(
            f"--worker-backend={args.worker_backend!r} is not one of: {', '.join(WORKER_BACKENDS)}"
        )
    if args.worker_backend == "ray":
        if args.headless:
            raise UsageError(
                "--worker-backend ray is for the head; a --headless replica runs as a process"
            )
        if not _importable("ray"):
            raise UsageError("--worker-backend ray needs Ray: pip install 'omnistage[ray]'")
    if args.ray_address is not None:
        if args.worker_backend != "ray":
            raise UsageError("--ray-address requires --worker-backend ray")
        if not args.ray_address.strip():
            raise UsageError("--ray-address must not be empty (give HOST:PORT, ray://... or auto)")
    if args.headless and args.stage_overrides:
        _check_headless_overrides(args.stage_overrides, args.stage_id)
    _validate_diffusion_flags(args)
    if args.model_or_config and args.deploy_config:
        raise UsageError("give either MODEL_OR_CONFIG or --deploy-config, not both")


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
