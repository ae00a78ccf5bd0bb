"""Every environment variable omnistage reads, in one place."""

from __future__ import annotations

import os


def api_key() -> str | None:
    """OMNISTAGE_API_KEY: the default for --api-key."""
    return os.environ.get("OMNISTAGE_API_KEY") or None


def log_level() -> str | None:
    """OMNISTAGE_LOG_LEVEL: the default log level when --log-level is not given."""
    return os.environ.get("OMNISTAGE_LOG_LEVEL") or None


def cache_dir() -> str:
    """OMNISTAGE_CACHE_DIR: converted model weights (default ~/.cache/omnistage)."""
    return os.environ.get("OMNISTAGE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "omnistage"
    )


def store_url() -> str | None:
    """OMNISTAGE_STORE_URL: the default for --store-url (None: a SQLite file in the cache)."""
    return os.environ.get("OMNISTAGE_STORE_URL") or None


def media_url() -> str | None:
    """OMNISTAGE_MEDIA_URL: the default for --media-url (None: a directory in the cache)."""
    return os.environ.get("OMNISTAGE_MEDIA_URL") or None


_HUB_SWITCHES = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
# The switches keep_model_hubs_offline set itself, which are not the user's choice.
_hub_switches_set: set[str] = set()


def keep_model_hubs_offline() -> None:
    """Once a model is a local directory (``config.hub`` fetched any hub id before), tell
    the HF libraries not to reach for a hub (HF_HUB_OFFLINE, TRANSFORMERS_OFFLINE),
    unless the user chose."""
    for name in _HUB_SWITCHES:
        if name not in os.environ:
            os.environ[name] = "1"
            _hub_switches_set.add(name)


def hub_offline() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) as the user set it: models named by hub
    id come from the HF cache only."""
    return any(
        (os.environ.get(name) or "").strip().upper() in ("1", "ON", "YES", "TRUE")
        for name in _HUB_SWITCHES
        if name not in _hub_switches_set
    )


def hf_endpoint() -> str:
    """HF_ENDPOINT: the hub models are fetched from (default https://huggingface.co)."""
    return (os.environ.get("HF_ENDPOINT") or "https://huggingface.co").rstrip("/")


def hf_hub_cache() -> str:
    """HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub (XDG_CACHE_HOME
    honoured): where fetched models are kept, as the HF libraries keep them."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.path.expanduser(os.environ["HF_HUB_CACHE"])
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "huggingface"
    )
    return os.path.join(os.path.expanduser(home), "hub")


def hf_token() -> str | None:
    """HF_TOKEN: the token sent to the hub (None: huggingface_hub's own, if logged in)."""
    return os.environ.get("HF_TOKEN") or None


def auth_token() -> str | None:
    """OMNISTAGE_AUTH_TOKEN: the default for --omni-auth-token (how local replicas get it)."""
    return os.environ.get("OMNISTAGE_AUTH_TOKEN") or None


def load_nice() -> int:
    """OMNISTAGE_LOAD_NICE: how much lower the CPU priority of a replica the head restarts
    beside a live one of its stage is while it loads its model (nice steps, default 10;
    0: none). See ``replica.load_priority``."""
    raw = os.environ.get("OMNISTAGE_LOAD_NICE", "").strip()
    try:
        return max(0, int(raw)) if raw else 10
    except ValueError:
        return 10


def load_nice_s() -> float:
    """OMNISTAGE_LOAD_NICE_S: how long such a restart loads niced at most (seconds,
    default 3: the live replica's takeover of the failed one's requests); then it loads at
    full priority, so its stage is not left on one replica for the length of a niced
    load. See ``replica.load_priority``."""
    raw = os.environ.get("OMNISTAGE_LOAD_NICE_S", "").strip()
    try:
        return max(0.0, float(raw)) if raw else 3.0
    except ValueError:
        return 3.0


def death_watch_s() -> float:
    """OMNISTAGE_DEATH_WATCH_S: how often a launcher looks whether a local replica it
    watches has been killed, before its last thread has exited (seconds, default 0.05;
    0: off, a death is seen when the process is gone). See ``launch.death_watch``."""
    raw = os.environ.get("OMNISTAGE_DEATH_WATCH_S", "").strip()
    try:
        return max(0.0, float(raw)) if raw else 0.05
    except ValueError:
        return 0.05


def replica_options() -> str | None:
    """OMNISTAGE_REPLICA_OPTIONS: a replica process's options, encoded by its launcher
    (see omnistage.replica.options)."""
    return os.environ.get("OMNISTAGE_REPLICA_OPTIONS") or None


def api_server_options() -> str | None:
    """OMNISTAGE_API_SERVER_OPTIONS: an API server process's options, encoded by the head
    (see omnistage.api.server)."""
    return os.environ.get("OMNISTAGE_API_SERVER_OPTIONS") or None


def status_url() -> str | None:
    """OMNISTAGE_URL: the head ``omnistage status`` looks at by default."""
    return os.environ.get("OMNISTAGE_URL") or None


def otlp_traces_endpoint() -> str | None:
    """OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, else OTEL_EXPORTER_OTLP_ENDPOINT (the standard
    OpenTelemetry variables): where traces go when --otlp-traces-endpoint is not given."""
    return (
        os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        or None
    )


def otel_service_name() -> str | None:
    """OTEL_SERVICE_NAME: overrides the service name of exported spans."""
    return os.environ.get("OTEL_SERVICE_NAME") or None


def webrtc_hosts() -> tuple[str, ...]:
    """OMNISTAGE_WEBRTC_HOSTS: the only IPs a WebRTC call offers as ICE host candidates,
    comma-separated (empty: every interface's but loopback, aioice's own choice)."""
    return _list("OMNISTAGE_WEBRTC_HOSTS")


def webrtc_stun() -> tuple[str, ...]:
    """OMNISTAGE_WEBRTC_STUN: STUN servers (``stun:host:port``, comma-separated) a WebRTC
    call may ask for a server reflexive candidate (empty: none)."""
    return _list("OMNISTAGE_WEBRTC_STUN")


def peer_kept_requests() -> int | None:
    """OMNISTAGE_PEER_KEPT_REQUESTS: how many requests' sent tensors a replica keeps to
    feed a replaced downstream replica again (None: the default, 4096). 0 keeps none:
    every replacement runs the sending stage again (what the failure tests use)."""
    value = os.environ.get("OMNISTAGE_PEER_KEPT_REQUESTS")
    return int(value) if value else None


def _list(name: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in os.environ.get(name, "").split(",") if x.strip())
