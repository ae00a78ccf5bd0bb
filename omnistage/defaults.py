"""Defaults shared by the CLI flags and the options of each process role, in one place."""

from __future__ import annotations

from omnistage.protocol.enums import LbPolicy

HTTP_PORT = 8091
HEARTBEAT_INTERVAL_S = 1.0
HEARTBEAT_TIMEOUT_S = 5.0
STAGE_INIT_TIMEOUT_S = 300.0
INIT_TIMEOUT_S = 600.0
DRAIN_TIMEOUT_S = 30.0
STALL_TIMEOUT_S = 60.0
STAGE_WAIT_TIMEOUT_S = 3.0
# A request waits this long for a replica coming back: the longest restart backoff
# (30 s, launch.restart) plus a model load on a busy machine (the voice models: 4 s on a
# calm machine, 17 s with two loading at once on two busy cores), with room to spare.
RESTART_WAIT_TIMEOUT_S = 60.0
MAX_RETRIES = 2
MAX_QUEUE = 1024
MAX_REQUEST_BYTES = 16 * 1024 * 1024
REALTIME_MAX_SESSIONS = 32  # per API server process
REALTIME_IDLE_TIMEOUT_S = 600.0
# How long a Realtime session stays resumable after its last change (session resume).
REALTIME_RESUME_TTL_S = 600.0
# A chat's image URL, where the operator allows its host: the longest fetch and the
# largest file (OpenAI's image input limit).
MEDIA_FETCH_TIMEOUT_S = 10.0
MEDIA_FETCH_MAX_BYTES = 20 * 1024 * 1024
# Jobs (videos, background responses): media kept a week; a running job's lease is
# renewed every third of JOB_LEASE_S, so a head that dies frees its jobs within it; a
# job interrupted this many times fails instead of running again.
MEDIA_TTL_S = 7 * 24 * 3600.0
JOB_LEASE_S = 30.0
JOB_MAX_ATTEMPTS = 3
LB_POLICY = LbPolicy.RANDOM
RESTART_POLICY = "on-failure"
LOG_LEVEL = "INFO"
# The store (jobs, stored responses) and generated media, under envs.cache_dir() unless
# --store-url / --media-url say otherwise.
STORE_FILE = "store.db"
MEDIA_DIR = "media"
