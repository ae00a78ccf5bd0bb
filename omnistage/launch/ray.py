"""Replicas as Ray actors (``--worker-backend ray``): Ray places them, omnistage runs them.

One actor per replica, created with the stage's resource request (``ray:`` in the deploy
config: CPUs, GPUs, memory, custom resources, spread or pack). The actor starts the same
replica runtime as a local launch (``python -m omnistage.replica`` with its options in the
environment) as its child process, on whichever node Ray chose. From there on nothing is
Ray-specific: the replica registers with the master, does the handshake, heartbeats and
serves over the same sockets, and the coordinator alone decides UP/DOWN/ERROR.

Why a child process and not the runtime inside the actor: the replica's drain on SIGTERM
and its event loop need a process's main thread, which a Ray worker keeps for Ray's own
task loop; and a child keeps the runtime byte for byte the one that local and headless
replicas run. The child is bound to the actor (SIGKILL when the actor's process dies),
so a dead actor or a lost node takes its replica with it, as a crashed local process does.

Noticing: when the replica process exits, the actor's ``wait`` returns its exit code at
once; when the actor itself dies (killed, its node lost), the pending ``wait`` fails as
soon as Ray knows, and the head counts the replica as exited. Either way the launcher's
``on_exit`` fires, and the head's restart policy asks for a replacement, which Ray places
on a node with room. Until it is UP (placement included), requests for its stage wait for
it, as for a local replica's restart (``head.local``).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
from typing import Any

from omnistage.config.schema import DeployConfig, RaySpec
from omnistage.launch.base import OnExit, TrackingLauncher
from omnistage.launch.local import REPLICA_ARGV, die_with_parent
from omnistage.net import address_host, is_loopback
from omnistage.replica.options import ReplicaOptions, encode_options

log = logging.getLogger(__name__)

INSTALL_HINT = "--worker-backend ray needs Ray: pip install 'omnistage[ray]'"
# Ray's namespace for omnistage's actors, so `ray list actors` tells them apart.
NAMESPACE = "omnistage"
# How long a replica may wait for Ray to place it before the head says why it waits.
PLACEMENT_NOTE_S = 10.0
# Exit code reported for a replica whose actor died (killed, or its node lost).
ACTOR_DIED = -9


class ReplicaHost:
    """The actor: one replica process on the node Ray put this actor on."""

    def __init__(self, options_blob: str) -> None:
        env = dict(os.environ)
        env["OMNISTAGE_REPLICA_OPTIONS"] = options_blob
        self._started = threading.Event()
        self._ended = threading.Event()
        self._proc: subprocess.Popen[bytes] | None = None
        self._code = 0
        # The child is started by a thread that lives exactly as long as it: Linux sends
        # the parent-death signal when the *thread* that forked the child ends, and the
        # threads a Ray actor runs its methods on are not ours to keep.
        threading.Thread(target=self._keep, args=(env,), daemon=True).start()
        self._started.wait()
        if self._proc is None:  # the actor fails, and the head sees why in its log
            raise RuntimeError(f"could not start {' '.join(REPLICA_ARGV)} on this node")

    def _keep(self, env: dict[str, str]) -> None:
        try:
            self._proc = subprocess.Popen(REPLICA_ARGV, env=env, preexec_fn=_die_with_actor)
        finally:
            self._started.set()
        self._code = self._proc.wait()
        self._ended.set()

    def where(self) -> tuple[int, str, str]:
        """The replica's pid, and the Ray node id and IP it runs on."""
        import ray

        assert self._proc is not None
        context = ray.get_runtime_context()
        return self._proc.pid, context.get_node_id(), ray.util.get_node_ip_address()

    def wait(self) -> int:
        self._ended.wait()
        return self._code

    def terminate(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()


class RayReplicaProcess:
    """The head's handle on one replica actor."""

    def __init__(self, options: ReplicaOptions, actor: Any) -> None:
        self.options = options
        self.actor = actor
        self._pid = 0  # known once Ray has placed and started the actor
        self.node: str | None = None
        self.node_ip: str | None = None

    @property
    def pid(self) -> int:
        return self._pid

    def placed(self, pid: int, node: str, node_ip: str) -> None:
        self._pid, self.node, self.node_ip = pid, node, node_ip

    def terminate(self) -> None:
        """Ask the replica to drain and exit (the actor is removed once it has)."""
        try:
            self.actor.terminate.remote()
        except Exception:  # the actor is already gone: nothing left to drain
            pass

    def kill(self) -> None:
        import ray

        try:
            ray.kill(self.actor, no_restart=True)
        except Exception:
            pass


class RayLauncher(TrackingLauncher[RayReplicaProcess]):
    """Launches each replica as an actor on the Ray cluster at ``address``.

    ``address`` None starts a local Ray instance for this head (stopped with it); an
    address (``auto``, ``HOST:PORT``, ``ray://...``) joins that cluster.
    """

    def __init__(
        self, config: DeployConfig, address: str | None, on_exit: OnExit | None = None
    ) -> None:
        if address is not None and _is_loopback(address):
            # Ray "resolves" a loopback address to this host's routable IP before it
            # connects, which misses a cluster that listens on loopback only (one started
            # with --node-ip-address 127.0.0.1). Asked for loopback, stay on loopback:
            # this switch (read when Ray is imported) makes Ray take 127.0.0.1 as this
            # node's address.
            os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
        try:
            import ray
        except ImportError:  # the CLI checks first; this covers embedding
            raise RuntimeError(INSTALL_HINT) from None
        self._ray = ray
        self._config = config
        super().__init__(on_exit)
        # Ray would report usage statistics to its makers; a serving system should not.
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        if not ray.is_initialized():
            kwargs: dict[str, Any] = {
                "namespace": NAMESPACE,
                "logging_level": logging.WARNING,
                "log_to_driver": True,
            }
            if address is None:
                # Our own instance, even where another Ray runs on this host ("local";
                # plain None would join the latest `ray start`): on loopback, since its
                # replicas are all here; no dashboard; workers at normal priority (Ray
                # runs them at nice 15 by default, behind everything else on the host).
                kwargs.update(
                    _node_ip_address="127.0.0.1",
                    include_dashboard=False,
                    _system_config={"worker_niceness": 0},
                )
            ray.init(address=address or "local", **kwargs)
        self._actor_class = ray.remote(ReplicaHost)
        log.info("ray backend: connected to the cluster (%s)", address or "a new local instance")

    def launch(self, options: ReplicaOptions) -> RayReplicaProcess:
        """Create the replica's actor; returns at once (Ray places it in the background)."""
        stage = self._config.stage(options.stage_id)
        actor = self._actor_class.options(**actor_options(stage.ray)).remote(
            encode_options(options)
        )
        handle = RayReplicaProcess(options, actor)
        return self._track(handle, self._watch, f"omni-ray-{options.stage_id}-{options.replica_id}")

    def _watch(self, handle: RayReplicaProcess) -> None:
        ray = self._ray
        o = handle.options
        where = handle.actor.where.remote()
        noted = False
        code = ACTOR_DIED
        try:
            while not ray.wait([where], timeout=PLACEMENT_NOTE_S)[0]:
                if self._stopping:
                    return
                if not noted:
                    noted = True
                    log.warning(
                        "stage %d replica %d is waiting for Ray to place it: no node has "
                        "room for %s",
                        o.stage_id,
                        o.replica_id,
                        actor_options(self._config.stage(o.stage_id).ray),
                    )
            handle.placed(*ray.get(where))
            log.info(
                "started stage %d replica %d on ray node %s (%s), pid %d",
                o.stage_id,
                o.replica_id,
                handle.node,
                handle.node_ip,
                handle.pid,
            )
            code = ray.get(handle.actor.wait.remote())
        except Exception as exc:  # RayActorError and kin: the actor (or its node) is gone
            what = ""  # said here
            if not self._stopping:
                log.warning(
                    "stage %d replica %d: its ray actor died (%s)",
                    o.stage_id,
                    o.replica_id,
                    type(exc).__name__,
                )
        else:
            what = f"stage {o.stage_id} replica {o.replica_id}"
        # The replica has ended: free its actor's resources for the replacement.
        handle.kill()
        with self._lock:
            if handle in self._procs:
                self._procs.remove(handle)
        self._ended(handle, code, what)

    def stop_all(self, grace_s: float = 10.0) -> None:
        """Drain every replica, kill what outlives ``grace_s``, remove every actor."""
        self._stopping = True
        procs = self.processes
        for p in procs:
            p.terminate()
        waits = [p.actor.wait.remote() for p in procs]
        if waits:
            try:
                self._ray.wait(waits, num_returns=len(waits), timeout=grace_s)
            except Exception:
                pass
        for p in procs:
            p.kill()
        self._ray.shutdown()


def actor_options(spec: RaySpec) -> dict[str, Any]:
    """Ray's actor options for a stage's ``ray:`` spec."""
    out: dict[str, Any] = {"num_cpus": spec.num_cpus, "num_gpus": spec.num_gpus, "max_restarts": 0}
    if spec.memory_bytes is not None:
        out["memory"] = spec.memory_bytes
    if spec.resources:
        out["resources"] = dict(spec.resources)
    if spec.placement == "spread":
        out["scheduling_strategy"] = "SPREAD"
    # wait() blocks one thread; terminate and where run beside it.
    out["max_concurrency"] = 4
    return out


def _is_loopback(address: str) -> bool:
    return is_loopback(address_host(address))


def _die_with_actor() -> None:
    """The replica dies with its actor (SIGKILL), as a local one dies with a crash."""
    die_with_parent(signal.SIGKILL)
