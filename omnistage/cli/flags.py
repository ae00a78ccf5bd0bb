"""``omnistage serve``'s flags as data: one ``Flag`` per option, grouped by their reader.

Names follow vLLM-Omni's serve command. Defaults come from ``omnistage.defaults`` and
help shows them with ``%(default)s``, so a default is written once. An ``env`` default is
read when the parser is built; secrets never show it.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from omnistage import defaults, envs
from omnistage.control.balancing import POLICIES
from omnistage.launch.restart import POLICIES as RESTART_POLICIES

WORKER_BACKENDS = ("multi_process", "ray")


@dataclass(frozen=True)
class Flag:
    """One option: its names, its help and its other ``add_argument`` keywords."""

    names: tuple[str, ...]
    help: str
    options: Mapping[str, Any] = field(default_factory=dict)
    env: Callable[[], str | None] | None = None  # the default, read at parser build time

    @property
    def name(self) -> str:
        """The long name, as error messages give it."""
        return self.names[-1]

    @property
    def dest(self) -> str:
        return dest_of(self.name)

    def add_to(self, parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
        options = dict(self.options)
        if self.env is not None:
            options["default"] = self.env()
        parser.add_argument(*self.names, help=self.help, **options)


def dest_of(name: str) -> str:
    """The attribute a flag's value lands in: ``--omni-max-queue`` -> ``omni_max_queue``."""
    return name.lstrip("-").replace("-", "_")


def flag(
    *names: str, help: str, env: Callable[[], str | None] | None = None, **options: Any
) -> Flag:
    return Flag(names, help, options, env)


def add_flags(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup, flags: Iterable[Flag]
) -> None:
    for each in flags:
        each.add_to(parser)


MODEL_OR_CONFIG = flag(
    "model_or_config",
    nargs="?",
    default=None,
    metavar="MODEL_OR_CONFIG",
    help="a built-in pipeline name, a deploy config YAML, or a model checkpoint whose "
    "config.json picks the stage graph (model_type qwen2_5_omni: thinker -> talker -> "
    "token2wav; qwen3_omni_moe: thinker -> talker -> code2wav): a local directory, or a "
    "hub id org/name[@revision] fetched with huggingface_hub into the HF cache "
    "(HF_ENDPOINT, HF_HOME, HF_TOKEN and HF_HUB_OFFLINE honoured); default: the built-in "
    "default",
)

PIPELINE_FLAGS = (
    MODEL_OR_CONFIG,
    flag("--deploy-config", default=None, metavar="PATH", help="deploy config YAML"),
    flag(
        "--stage-overrides",
        default=None,
        metavar="JSON",
        help='per-stage field overrides, e.g. \'{"1": {"replicas": 2}}\'',
    ),
    flag(
        "--stage-id",
        metavar="N",
        type=int,
        default=None,
        help="launch only this stage locally (head) or serve it (--headless)",
    ),
)

HEAD_FLAGS = (
    flag("--host", default="127.0.0.1", help="HTTP bind address (default %(default)s)"),
    flag("--port", type=int, default=defaults.HTTP_PORT, help="HTTP port (default %(default)s)"),
    flag(
        "--api-key",
        metavar="KEY",
        env=envs.api_key,
        help="require 'Authorization: Bearer KEY' on /v1/* (env OMNISTAGE_API_KEY); "
        "several keys, comma-separated, each see only the jobs and stored responses "
        "made with it",
    ),
    flag(
        "--api-server-count",
        type=int,
        default=1,
        metavar="N",
        help="HTTP API server processes in front of the orchestrator (default %(default)s: "
        "the head serves HTTP itself); more spread the HTTP work over cores",
    ),
    flag(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="the model names the API answers to (/v1/models, `model` of requests and "
        "responses; the first is the one reported) instead of the pipeline name",
    ),
    flag(
        "--max-request-bytes",
        metavar="BYTES",
        type=int,
        default=defaults.MAX_REQUEST_BYTES,
        help="largest accepted HTTP request body; larger ones get 413 (default %(default)s)",
    ),
    flag(
        "--allowed-media-domains",
        nargs="+",
        default=None,
        metavar="HOST",
        help="hosts whose http(s) image and video URLs a chat may name; the server fetches "
        "them (no redirects), '*' any host; default: none, only data: URLs are taken",
    ),
    flag(
        "--media-fetch-timeout",
        metavar="S",
        type=float,
        default=defaults.MEDIA_FETCH_TIMEOUT_S,
        help="seconds one image or video URL may take to fetch (default %(default)g)",
    ),
    flag(
        "--media-fetch-max-bytes",
        metavar="BYTES",
        type=int,
        default=defaults.MEDIA_FETCH_MAX_BYTES,
        help="largest image or video a URL may hold; larger ones are a 400 (default %(default)s)",
    ),
    flag(
        "--realtime-max-sessions",
        metavar="N",
        type=int,
        default=defaults.REALTIME_MAX_SESSIONS,
        help="Realtime WebSocket sessions (/v1/realtime) each API server process holds at "
        "once; more are refused with 429 (default %(default)s)",
    ),
    flag(
        "--store-url",
        metavar="URL",
        env=envs.store_url,
        help="the database of jobs and stored responses: sqlite:///PATH or "
        "postgresql://USER:PASS@HOST/DB (env OMNISTAGE_STORE_URL; default: a SQLite file "
        "in the cache directory); heads sharing one database share their jobs",
    ),
    flag(
        "--media-url",
        metavar="URL",
        env=envs.media_url,
        help="where generated media (videos, thumbnails) are kept: a directory or an "
        "fsspec URL such as s3://bucket/prefix (env OMNISTAGE_MEDIA_URL; default: a "
        "directory in the cache directory)",
    ),
    flag(
        "--media-ttl",
        metavar="S",
        type=float,
        default=defaults.MEDIA_TTL_S,
        help="seconds a completed job (a video) and its media are kept before they expire "
        "and are removed (default %(default)g; 0 keeps them until deleted)",
    ),
    flag(
        "--job-lease",
        metavar="S",
        type=float,
        default=defaults.JOB_LEASE_S,
        help="seconds a head holds a running job without renewing it; a job whose head "
        "died runs again on another head after this (default %(default)g)",
    ),
    flag(
        "--realtime-idle-timeout",
        metavar="S",
        type=float,
        default=defaults.REALTIME_IDLE_TIMEOUT_S,
        help="seconds a Realtime session may send nothing before it is closed with a "
        "session_idle_timeout error (default %(default)g)",
    ),
    flag(
        "--realtime-resume-ttl",
        metavar="S",
        type=float,
        default=defaults.REALTIME_RESUME_TTL_S,
        help="seconds a Realtime session stays resumable (in the store) after its last "
        "change or its connection's end; 0 saves no sessions (default %(default)g)",
    ),
    flag(
        "--omni-max-queue",
        metavar="N",
        type=int,
        default=defaults.MAX_QUEUE,
        help="requests per stage that may wait for a free replica slot; more get 429 "
        "(default %(default)s)",
    ),
    flag(
        "--omni-stage-wait-timeout",
        metavar="S",
        type=float,
        default=defaults.STAGE_WAIT_TIMEOUT_S,
        help="seconds a request waits for a live replica before 503, when none is "
        "coming back (default %(default)s)",
    ),
    flag(
        "--omni-restart-wait-timeout",
        metavar="S",
        type=float,
        default=defaults.RESTART_WAIT_TIMEOUT_S,
        help="seconds a request waits for a replica that is restarting or starting, when "
        "its stage has none live, before 503; the default covers the longest restart "
        "backoff (30 s) plus a model load on a busy machine (default %(default)g)",
    ),
    flag(
        "--omni-max-retries",
        metavar="N",
        type=int,
        default=defaults.MAX_RETRIES,
        help="times a request's stage is dispatched again after its replica fails "
        "(default %(default)s; 0 fails the request at once)",
    ),
    flag(
        "--omni-lb-policy",
        default=defaults.LB_POLICY,
        choices=tuple(POLICIES),
        help="replica balancing (default %(default)s)",
    ),
    flag(
        "--omni-heartbeat-timeout",
        metavar="S",
        type=float,
        default=defaults.HEARTBEAT_TIMEOUT_S,
        help="seconds of silence before a replica is marked ERROR (default %(default)s)",
    ),
    flag(
        "--omni-stall-timeout",
        metavar="S",
        type=float,
        default=None,
        help="seconds a replica may hold work without its engine making progress before "
        "it is marked ERROR and its requests move elsewhere; 0 disables (default "
        f"{defaults.STALL_TIMEOUT_S:g}, or the heartbeat timeout if that is longer)",
    ),
    flag(
        "--init-timeout",
        metavar="S",
        type=float,
        default=defaults.INIT_TIMEOUT_S,
        help="seconds the head waits for every stage to have a replica (default %(default)s)",
    ),
    flag(
        "--omni-restart-policy",
        default=defaults.RESTART_POLICY,
        choices=RESTART_POLICIES,
        help="restart the head's local replicas that exit (default %(default)s): at once "
        "after serving 10 s, else with backoff from 1 s to 30 s",
    ),
    flag(
        "--worker-backend",
        default=WORKER_BACKENDS[0],
        choices=WORKER_BACKENDS,
        help="how the head runs its replicas: multi_process (local processes) or ray (one "
        "Ray actor per replica, placed by the stage's `ray:` resources; default %(default)s)",
    ),
    flag(
        "--ray-address",
        metavar="ADDRESS",
        default=None,
        help="Ray cluster to run replicas on (HOST:PORT, ray://HOST:PORT or auto); "
        "default with --worker-backend ray: start a local Ray instance",
    ),
)

DISTRIBUTED_FLAGS = (
    flag(
        "--headless",
        action="store_true",
        help="run replicas of --stage-id that join a head at -oma/-omp",
    ),
    flag(
        "-oma",
        "--omni-master-address",
        metavar="HOST",
        default=None,
        help="master (registration) address; head default 127.0.0.1",
    ),
    flag(
        "-omp",
        "--omni-master-port",
        metavar="PORT",
        type=int,
        default=None,
        help="master port; head default: a free port, logged at start",
    ),
    flag(
        "-ora",
        "--omni-replica-address",
        metavar="HOST",
        default=None,
        help="this host's address as seen by the head (headless; auto-detected)",
    ),
    flag(
        "--replica-id",
        metavar="N",
        type=int,
        default=None,
        help="headless: register as this replica id of the stage (default: one is "
        "assigned); refused while another live replica holds it",
    ),
    flag(
        "--omni-replica-binds-sockets",
        action="store_true",
        help="headless: bind the replica's data sockets on its own address and let the "
        "head dial in (default: the replica dials the head)",
    ),
    flag(
        "--omni-dp-size-local",
        metavar="N",
        type=int,
        default=1,
        help="replicas of --stage-id to run in this process tree (default %(default)s)",
    ),
    flag(
        "--omni-join",
        metavar="HOST:PORT",
        default=None,
        help="head: join the fleet of the head whose master is at HOST:PORT (its -oma "
        "and -omp): serve the same API with the same replicas, so that either head "
        "can die (see docs/distributed.md, 'Several heads')",
    ),
    flag(
        "--omni-auth-token",
        metavar="TOKEN",
        env=envs.auth_token,
        help="shared secret that authenticates registrations, handshakes and heartbeats "
        "(HMAC); head and replicas must agree (env OMNISTAGE_AUTH_TOKEN)",
    ),
    flag(
        "--omni-curve-keys",
        default=None,
        metavar="DIR",
        help="encrypt every control and data socket with CURVE and admit only replicas "
        "holding a client key from DIR (make one with `omnistage curve-keys DIR`); "
        "head and replicas pass the same directory",
    ),
)

REPLICA_FLAGS = (
    flag(
        "--stage-init-timeout",
        metavar="S",
        type=float,
        default=defaults.STAGE_INIT_TIMEOUT_S,
        help="seconds a replica may take to register and load (default %(default)s)",
    ),
    flag(
        "--drain-timeout",
        metavar="S",
        type=float,
        default=defaults.DRAIN_TIMEOUT_S,
        help="on SIGTERM/SIGINT, finish in-flight requests for up to this many seconds "
        "before exiting (default %(default)s; a second signal stops at once)",
    ),
)

# Each sets the engine_args key of its dest in every diffusion stage (cli/engine_flags.py).
DIFFUSION_FLAGS = (
    flag(
        "--diffusers-load-kwargs",
        default=None,
        metavar="JSON",
        help='JSON object passed to from_pretrained(), e.g. \'{"variant": "fp16"}\'',
    ),
    flag(
        "--diffusers-call-kwargs",
        default=None,
        metavar="JSON",
        help="JSON object merged into every pipeline call (a request's own params win)",
    ),
    flag(
        "--model-class-name",
        default=None,
        metavar="NAME",
        help="diffusers pipeline class (default: the one model_index.json names)",
    ),
    flag(
        "--max-generated-image-size",
        type=int,
        default=None,
        metavar="N",
        help="largest image in pixels (width * height; default 1048576, i.e. 1024x1024)",
    ),
    flag("--vae-use-slicing", action="store_true", help="decode with VAE slicing"),
    flag("--vae-use-tiling", action="store_true", help="decode with VAE tiling"),
    flag(
        "--enable-cpu-offload",
        action="store_true",
        help="keep idle pipeline components on the CPU (needs a GPU)",
    ),
)

# The diffusion flags whose value is a JSON object, merged key by key into the stage's own.
DIFFUSION_JSON = ("diffusers_load_kwargs", "diffusers_call_kwargs")

LOGGING_FLAGS = (
    flag("--log-stats", action="store_true", help="log request statistics"),
    flag(
        "--otlp-traces-endpoint",
        default=None,
        metavar="URL",
        help="export OpenTelemetry traces of requests over OTLP HTTP/protobuf to URL "
        "(e.g. http://collector:4318/v1/traces; default: the OTEL_EXPORTER_OTLP_* "
        "variables, else off); needs `pip install omnistage[otel]`",
    ),
    flag(
        "--log-level",
        metavar="LEVEL",
        env=lambda: envs.log_level() or defaults.LOG_LEVEL,
        help="DEBUG, INFO, WARNING, ERROR (default %(default)s; env OMNISTAGE_LOG_LEVEL)",
    ),
)

# (title, flags): the help groups of ``omnistage serve``, in order.
SERVE_GROUPS: tuple[tuple[str, tuple[Flag, ...]], ...] = (
    ("pipeline", PIPELINE_FLAGS),
    ("head (the API server and its orchestrator)", HEAD_FLAGS),
    ("distributed (head and --headless)", DISTRIBUTED_FLAGS),
    ("replicas", REPLICA_FLAGS),
    ("diffusion stages", DIFFUSION_FLAGS),
    ("logging and tracing", LOGGING_FLAGS),
)
