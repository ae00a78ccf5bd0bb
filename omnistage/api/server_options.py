"""What the head tells each API server process it starts (``--api-server-count N``):
``api.server`` reads them from ``OMNISTAGE_API_SERVER_OPTIONS``.

Apart from ``api.server`` so that the head can write them without importing the HTTP
app, which it imports only once its replicas are starting (``head.process``).
"""

from __future__ import annotations

from typing import Any

import msgspec

from omnistage import defaults
from omnistage.protocol import codec


class ApiServerOptions(msgspec.Struct, frozen=True, kw_only=True):
    index: int
    listen_fd: int
    head_address: str  # the head's FrontendServer
    config: dict[str, Any]  # the head's DeployConfig, as JSON-ready data
    started_at: int
    api_key: str | None = None
    max_request_bytes: int = defaults.MAX_REQUEST_BYTES
    realtime_max_sessions: int = defaults.REALTIME_MAX_SESSIONS
    realtime_idle_timeout_s: float = defaults.REALTIME_IDLE_TIMEOUT_S
    realtime_resume_ttl_s: float = defaults.REALTIME_RESUME_TTL_S
    allowed_media_domains: tuple[str, ...] = ()
    media_fetch_timeout_s: float = defaults.MEDIA_FETCH_TIMEOUT_S
    media_fetch_max_bytes: int = defaults.MEDIA_FETCH_MAX_BYTES
    log_level: str = defaults.LOG_LEVEL
    refresh_s: float = 0.5
    served_model_names: tuple[str, ...] = ()  # (): the pipeline name
    store_url: str | None = None
    media_url: str | None = None
    media_ttl_s: float = defaults.MEDIA_TTL_S


def encode_options(opts: ApiServerOptions) -> str:
    return codec.encode_blob(opts)


def decode_options(blob: str) -> ApiServerOptions:
    return codec.decode_blob(blob, ApiServerOptions)
