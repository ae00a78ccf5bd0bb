"""The head's options: one frozen value, built from the CLI flags in one place."""

from __future__ import annotations

from dataclasses import dataclass

from omnistage import defaults
from omnistage.config.devices import split_devices
from omnistage.config.schema import DeployConfig
from omnistage.launch.devices import replica_visible_devices
from omnistage.net import address_host, detect_local_address, is_loopback
from omnistage.protocol.auth import Signer, Verifier
from omnistage.replica.options import ReplicaOptions


@dataclass(frozen=True)
class HeadOptions:
    config: DeployConfig
    host: str = "127.0.0.1"
    port: int = defaults.HTTP_PORT
    master_host: str = "127.0.0.1"
    master_port: int = 0  # 0: pick a free port (logged at start)
    stage_id: int | None = None  # only this stage runs locally; others join headless
    dp_size_local: int = 1
    lb_policy: str = defaults.LB_POLICY
    heartbeat_interval_s: float = defaults.HEARTBEAT_INTERVAL_S
    heartbeat_timeout_s: float = defaults.HEARTBEAT_TIMEOUT_S
    stage_init_timeout_s: float = defaults.STAGE_INIT_TIMEOUT_S
    init_timeout_s: float = defaults.INIT_TIMEOUT_S
    no_replica_wait_s: float = defaults.STAGE_WAIT_TIMEOUT_S
    restart_wait_s: float = defaults.RESTART_WAIT_TIMEOUT_S
    max_retries: int = defaults.MAX_RETRIES
    stall_timeout_s: float = defaults.STALL_TIMEOUT_S
    shutdown_grace_s: float = 10.0
    log_level: str = defaults.LOG_LEVEL
    api_key: str | None = None
    max_queue: int = defaults.MAX_QUEUE
    restart_policy: str = defaults.RESTART_POLICY
    auth_token: str | None = None
    curve_keys: str | None = None  # --omni-curve-keys DIR
    max_request_bytes: int = defaults.MAX_REQUEST_BYTES
    realtime_max_sessions: int = defaults.REALTIME_MAX_SESSIONS  # per API server process
    realtime_idle_timeout_s: float = defaults.REALTIME_IDLE_TIMEOUT_S
    realtime_resume_ttl_s: float = defaults.REALTIME_RESUME_TTL_S
    # A chat's image URLs: the hosts fetched from (none: only data: URLs), the limits.
    allowed_media_domains: tuple[str, ...] = ()
    media_fetch_timeout_s: float = defaults.MEDIA_FETCH_TIMEOUT_S
    media_fetch_max_bytes: int = defaults.MEDIA_FETCH_MAX_BYTES
    store_url: str | None = None  # None: a SQLite file in the cache directory
    media_url: str | None = None  # None: a directory in the cache directory
    media_ttl_s: float = defaults.MEDIA_TTL_S  # 0: kept until deleted
    job_lease_s: float = defaults.JOB_LEASE_S
    log_stats: bool = False
    stats_interval_s: float = 10.0
    api_server_count: int = 1  # > 1: that many API server processes serve HTTP
    served_model_names: tuple[str, ...] = ()  # --served-model-name; (): the pipeline name
    otlp_traces_endpoint: str | None = None  # None: the OTEL_* variables decide (tracing)
    worker_backend: str = "multi_process"  # or "ray": the head's replicas are Ray actors
    ray_address: str | None = None  # --ray-address; None: start a local Ray instance
    join: str | None = None  # --omni-join: another head's master (tcp://HOST:PORT)

    @property
    def model_names(self) -> tuple[str, ...]:
        """The names the API answers to; the first is the one it reports."""
        return self.served_model_names or (self.config.pipeline,)

    def signer(self) -> Signer | None:
        """Stamps the head's control messages (None: no --omni-auth-token)."""
        return Signer(self.auth_token) if self.auth_token else None

    def verifier(self) -> Verifier | None:
        """Checks stamps on one socket: each socket gets its own (its replay cache)."""
        return Verifier(self.auth_token) if self.auth_token else None

    def local_replicas(self) -> dict[int, int]:
        """How many replicas of each stage this head launches itself."""
        if self.stage_id is not None:
            return {
                s.stage_id: (self.dp_size_local if s.stage_id == self.stage_id else 0)
                for s in self.config.stages
            }
        return {s.stage_id: s.replicas for s in self.config.stages}

    def local_replica(
        self, stage_id: int, replica_id: int, master_port: int, local_key: str
    ) -> ReplicaOptions:
        """The options of one of the head's own replicas (it registers into its slot)."""
        connect_host = self.master_host
        if connect_host in ("0.0.0.0", "::", "*"):
            connect_host = "127.0.0.1"
        return ReplicaOptions(
            stage_id=stage_id,
            replica_id=replica_id,
            master_host=connect_host,
            master_port=master_port,
            stage_init_timeout_s=self.stage_init_timeout_s,
            log_level=self.log_level,
            auth_token=self.auth_token,
            curve_keys=self.curve_keys,
            local_key=local_key,
            otlp_traces_endpoint=self.otlp_traces_endpoint,
            visible_devices=self.replica_devices(stage_id, replica_id),
        )

    def replica_devices(self, stage_id: int, replica_id: int) -> str | None:
        """The devices the head's replica ``replica_id`` of a stage sees (the value of
        CUDA_VISIBLE_DEVICES), its share of the stage's ``devices`` by replica id; None:
        ``devices: cpu``. A replica id past the list (one added beyond the devices the
        stage lists) raises DevicesError naming the stage: see ``config.devices``."""
        if self.worker_backend == "ray":
            return None  # Ray sets CUDA_VISIBLE_DEVICES for each actor from its num_gpus
        stage = self.config.stage(stage_id)
        label = f"stage {stage_id} ({stage.name})"
        return replica_visible_devices(stage.devices, replica_id, stage.devices_each, label)

    def check_devices(self) -> None:
        """Raise DevicesError if a stage's ``devices`` cannot give each of the head's
        replicas its share: the CLI makes it a usage error (exit 2) before anything
        starts, not a replica that fails later. An autoscaled stage must fit its
        max_replicas (they take the lowest free ids). Under Ray, Ray assigns devices
        (``ray: {num_gpus}``) and ``devices`` is not used."""
        if self.worker_backend == "ray":
            return
        for stage_id, count in self.local_replicas().items():
            stage = self.config.stage(stage_id)
            label = f"stage {stage_id} ({stage.name})"
            scaling = getattr(stage, "autoscaling", None)
            if count and scaling is not None and scaling.max_replicas > count:
                count = scaling.max_replicas
                label += f" with autoscaling.max_replicas {count}"
            split_devices(stage.devices, count, stage.devices_each, label)
            for replica_id in range(count):
                self.replica_devices(stage_id, replica_id)


def default_master_host(worker_backend: str, ray_address: str | None) -> str:
    """Where the master listens when -oma is not given: loopback, except on a Ray
    cluster that may span hosts, whose replicas must reach it from their nodes: then
    this host's address on the route toward the cluster."""
    if worker_backend != "ray" or ray_address is None:
        return "127.0.0.1"  # a Ray instance of our own lives on this host
    host = address_host(ray_address)
    if is_loopback(host):
        return "127.0.0.1"
    # "auto" (the cluster this host is part of): the address of the default route.
    return detect_local_address("8.8.8.8" if host == "auto" else host, 6379)
