"""A replica's options: one typed value, handed to a child process as one encoded blob.

The head (for its local replicas) and ``--headless`` build a ``ReplicaOptions`` and a
launcher starts ``python -m omnistage.replica`` with it in the environment
(``OMNISTAGE_REPLICA_OPTIONS``): the environment, unlike a command line, is private to
the process's user, and the options carry the auth token and the head-local key.
"""

from __future__ import annotations

from typing import Any

import msgspec

from omnistage import defaults
from omnistage.protocol import codec


class ReplicaOptions(msgspec.Struct, frozen=True, kw_only=True):
    stage_id: int
    master_host: str
    master_port: int
    replica_id: int = -1  # -1: let the master assign one
    advertise_address: str | None = None
    stage_init_timeout_s: float = defaults.STAGE_INIT_TIMEOUT_S
    # Fields of this stage to override locally (e.g. devices on this host).
    stage_overrides: dict[str, Any] = {}
    # Bind our own data sockets on advertise_address and let the head dial in.
    binds_sockets: bool = False
    # On SIGTERM/SIGINT: finish in-flight requests for up to this long, then exit.
    drain_timeout_s: float = defaults.DRAIN_TIMEOUT_S
    # Shared secret for the control plane (registration, HELLO, heartbeats).
    auth_token: str | None = None
    # Register again when the head goes away (headless); a local replica just exits.
    rejoin: bool = False
    # Backoff between registration attempts while rejoining.
    rejoin_backoff_s: tuple[float, float] = (0.5, 5.0)
    # --omni-curve-keys DIR: encrypt every socket, pinned to the head's public key.
    curve_keys: str | None = None
    # Set for the head's own replicas: lets them fill head-local slots.
    local_key: str | None = None
    log_level: str = defaults.LOG_LEVEL
    # --otlp-traces-endpoint (see ``omnistage.tracing``); None: the OTEL_* variables decide.
    otlp_traces_endpoint: str | None = None
    # This replica's devices as the value of config.devices.DEVICE_ENV_VAR, which its
    # launcher sets in the child's environment; None: the child inherits the launcher's.
    visible_devices: str | None = None
    # Nice steps the model loads at (``replica.load_priority``): the head sets
    # OMNISTAGE_LOAD_NICE for a restart beside a live replica of the stage, else 0.
    load_nice: int = 0


def encode_options(opts: ReplicaOptions) -> str:
    return codec.encode_blob(opts)


def decode_options(blob: str) -> ReplicaOptions:
    return codec.decode_blob(blob, ReplicaOptions)
