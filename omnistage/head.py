"""The head process: API, orchestrator, stage pools, master, coordinator, launcher."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import uvicorn
import zmq

from omnistage import curve, status
from omnistage.api.app import create_app
from omnistage.config.schema import DeployConfig
from omnistage.control.balancing import make_policy
from omnistage.control.coordinator import Coordinator
from omnistage.control.handshake import HandshakeServer
from omnistage.control.master import HeadAddresses, Master
from omnistage.control.plane import ControlPlane, bind_router
from omnistage.control.replica_table import ReplicaState, ReplicaTable, Transition, routing_id
from omnistage.control.slots import Slot, SlotTable
from omnistage.dataplane.channels import DataChannels
from omnistage.dataplane.graph import StageGraph
from omnistage.dataplane.orchestrator import Orchestrator
from omnistage.dataplane.stage_pool import StagePool
from omnistage.net import is_loopback, listen_tcp, tcp_url
from omnistage.protocol.auth import Signer, Verifier
from omnistage.protocol.messages import (
    HandshakeInit,
    OutputChunk,
    Ping,
    Ready,
    RegisterRequest,
    Shutdown,
)
from omnistage.replica.launch import LocalLauncher, LocalReplicaProcess, ReplicaSpec
from omnistage.replica.restart import RestartPolicy

log = logging.getLogger(__name__)


@dataclass
class HeadOptions:
    config: DeployConfig
    host: str = "127.0.0.1"
    port: int = 8091
    master_host: str = "127.0.0.1"
    master_port: int = 0  # 0: pick a free port (logged at start)
    stage_id: int | None = None  # only this stage runs locally; others join headless
    dp_size_local: int = 1
    lb_policy: str = "random"
    heartbeat_interval_s: float = 1.0
    heartbeat_timeout_s: float = 5.0
    stage_init_timeout_s: float = 300.0
    init_timeout_s: float = 600.0
    no_replica_wait_s: float = 3.0
    max_retries: int = 2
    stall_timeout_s: float = 60.0
    shutdown_grace_s: float = 10.0
    log_level: str = "INFO"
    api_key: str | None = None
    max_queue: int = 1024
    restart_policy: str = "on-failure"
    auth_token: str | None = None
    curve_keys: str | None = None  # --omni-curve-keys DIR
    max_request_bytes: int = 16 * 1024 * 1024
    log_stats: bool = False
    stats_interval_s: float = 10.0

    def local_replicas(self) -> dict[int, int]:
        """How many replicas of each stage this head launches itself."""
        if self.stage_id is not None:
            return {
                s.stage_id: (self.dp_size_local if s.stage_id == self.stage_id else 0)
                for s in self.config.stages
            }
        return {s.stage_id: s.replicas for s in self.config.stages}


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: the head owns SIGTERM/SIGINT."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class Head:
    def __init__(self, opts: HeadOptions) -> None:
        self.opts = opts
        self.config = opts.config
        self.graph = StageGraph(opts.config)
        self.model_names = {opts.config.pipeline}
        self.started_at = int(time.time())
        # Names this run of the head: replicas that rejoin it get their old ids back.
        self.instance = uuid.uuid4().hex[:12]
        # Given to local replicas only (in their environment): the key to head-local slots.
        self.local_key = secrets.token_hex(16)
        self._lock = threading.Lock()
        self._stop = asyncio.Event()
        self.restarts = RestartPolicy(opts.restart_policy, time.monotonic)
        # Set once every stage has had a live replica: start-up is over.
        self._serving = threading.Event()
        # (stage, replica) -> the handshake, input and output endpoints the head dials
        # for a replica that binds its own sockets.
        self._dialled: dict[tuple[int, int], tuple[str, ...]] = {}
        self.exit_code = 0

    # -- start-up --------------------------------------------------------------------

    async def run(self) -> int:
        self._loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._loop.add_signal_handler(sig, self._on_signal, sig)
        try:
            # Claim the HTTP port first: a taken port should fail before anything starts.
            http_socket = listen_tcp(self.opts.host, self.opts.port)
        except OSError as exc:
            log.error(
                "cannot listen on %s:%d (--host/--port): %s",
                self.opts.host,
                self.opts.port,
                exc.strerror or exc,
            )
            return 1
        self._start_control_and_data()
        self._launch_local()
        app = create_app(self, self.opts.api_key, self.opts.max_request_bytes)
        server = _Server(
            uvicorn.Config(
                app,
                host=self.opts.host,
                port=self.opts.port,
                log_level=self.opts.log_level.lower(),
                lifespan="off",
                access_log=False,
            )
        )
        self._server = server
        server_task = asyncio.create_task(server.serve([http_socket]), name="omni-http")
        watch_task = asyncio.create_task(self._await_stages(), name="omni-init-wait")
        observe_task = asyncio.create_task(self._observe_load(), name="omni-load")
        stats_task = asyncio.create_task(self._log_stats(), name="omni-stats")
        stop_task = asyncio.create_task(self._stop.wait())
        await asyncio.wait({server_task, stop_task}, return_when=asyncio.FIRST_COMPLETED)
        if server_task.done() and not self._stop.is_set():
            exc = server_task.exception()
            log.error("HTTP server exited%s", f": {exc}" if exc else "")
            self.exit_code = 1
        for task in (watch_task, observe_task, stats_task, stop_task):
            task.cancel()
        server.should_exit = True
        with contextlib.suppress(BaseException):
            await asyncio.wait_for(server_task, self.opts.shutdown_grace_s)
        await self._shutdown()
        return self.exit_code

    def _start_control_and_data(self) -> None:
        opts = self.opts
        self._zctx = zmq.Context()
        # CURVE goes on the context before any socket exists (see omnistage.curve).
        self._zauth = curve.secure_head(self._zctx, opts.curve_keys) if opts.curve_keys else None
        host = opts.master_host
        master_sock, master_url = bind_router(self._zctx, tcp_url(host, opts.master_port))
        handshake_sock, handshake_url = bind_router(self._zctx, tcp_url(host, 0))
        self._handshake_sock = handshake_sock
        coord_sock, coord_url = bind_router(self._zctx, tcp_url(host, 0))
        self.master_url = master_url
        self.channels = DataChannels(
            self._zctx,
            host,
            self._on_outputs,
            self._on_ready,
            self._on_unreachable_identity,
            self._on_disconnect,
        )
        self.addresses = HeadAddresses(
            handshake=handshake_url,
            input=self.channels.input_url,
            output=self.channels.output_url,
            coordinator=coord_url,
        )
        local = opts.local_replicas()
        self.slots = SlotTable(
            self.config.stage_ids,
            preallocated=local,
            head_local={sid: list(range(n)) for sid, n in local.items()},
            instance=self.instance,
            epoch_base=int(time.time() * 1000),
            local_key=self.local_key,
        )
        table = ReplicaTable(time.monotonic, opts.heartbeat_timeout_s, opts.stall_timeout_s)

        # One verifier per socket: each keeps its own replay cache.
        def verifier() -> Verifier | None:
            return Verifier(opts.auth_token) if opts.auth_token else None

        if not (opts.auth_token or opts.curve_keys) and not is_loopback(host):
            log.warning(
                "the control plane listens on %s without --omni-auth-token or "
                "--omni-curve-keys: anyone who "
                "can reach it can register replicas or forge heartbeats",
                host,
            )
        self.coordinator = Coordinator(
            table,
            self._lock,
            self._post_transition,
            verifier(),
            Signer(opts.auth_token) if opts.auth_token else None,
            self.instance,
        )
        master = self.master = Master(
            self.slots, self.addresses, self._on_register, self._lock, verifier()
        )
        handshake = HandshakeServer(self.slots, self._lock, self._init_for, verifier())
        self.control = ControlPlane(self.coordinator.tick)
        self.control.add(master_sock, master.handle)
        self.control.add(handshake_sock, handshake.handle)
        self.control.add(coord_sock, self.coordinator.handle)
        self.control.start()
        self.pools = {
            s.stage_id: StagePool(s.stage_id, s.name, make_policy(opts.lb_policy), opts.max_queue)
            for s in self.config.stages
        }
        self.orchestrator = Orchestrator(
            self.graph, self.pools, self.channels, opts.no_replica_wait_s, opts.max_retries
        )
        self.channels.start()
        log.info(
            "master listening on %s (-oma %s -omp %s); pipeline %r with stages %s",
            master_url,
            host,
            master_url.rsplit(":", 1)[1],
            self.config.pipeline,
            ", ".join(f"{s.stage_id}:{s.name}" for s in self.config.stages),
        )

    def _launch_local(self) -> None:
        self.launcher = LocalLauncher(on_exit=self._on_process_exit)
        port = int(self.master_url.rsplit(":", 1)[1])
        connect_host = self.opts.master_host
        if connect_host in ("0.0.0.0", "::", "*"):
            connect_host = "127.0.0.1"
        for sid, count in self.opts.local_replicas().items():
            for rid in range(count):
                self._start_local(
                    ReplicaSpec(
                        stage_id=sid,
                        replica_id=rid,
                        master_host=connect_host,
                        master_port=port,
                        stage_init_timeout_s=self.opts.stage_init_timeout_s,
                        log_level=self.opts.log_level,
                        auth_token=self.opts.auth_token,
                        curve_keys=self.opts.curve_keys,
                        local_key=self.local_key,
                    )
                )

    def _start_local(self, spec: ReplicaSpec) -> None:
        if self._stop.is_set():
            return
        self.restarts.started((spec.stage_id, spec.replica_id))
        self.launcher.launch(spec)

    async def _await_stages(self) -> None:
        """Report stages still waiting for replicas; give up after --init-timeout."""
        deadline = time.monotonic() + self.opts.init_timeout_s
        announced = False
        next_note = time.monotonic() + 10
        while True:
            missing = self.stages_without_replicas()
            if not missing:
                if not announced:
                    log.info(
                        "all stages have live replicas; serving on http://%s:%d",
                        self.opts.host,
                        self.opts.port,
                    )
                    announced = True
            elif time.monotonic() > deadline:
                names = ", ".join(f"{sid} ({n})" for sid, n in missing)
                log.error(
                    "stage(s) %s got no replica within --init-timeout (%gs); shutting down",
                    names,
                    self.opts.init_timeout_s,
                )
                self.exit_code = 1
                self._stop.set()
                return
            elif time.monotonic() > next_note:
                names = ", ".join(f"{sid} ({n})" for sid, n in missing)
                log.info("waiting for replicas of stage(s) %s", names)
                next_note = time.monotonic() + 10
            if announced:
                return
            await asyncio.sleep(0.1)

    async def _observe_load(self) -> None:
        while True:
            await asyncio.sleep(self.opts.heartbeat_interval_s)
            for entry in self.coordinator.snapshot():
                pool = self.pools.get(entry.stage_id)
                if pool is not None:
                    pool.observe(entry)

    async def _log_stats(self) -> None:
        """--log-stats: one line per interval with throughput and replica counts."""
        if not self.opts.log_stats:
            return
        last = self.orchestrator.started_total
        while True:
            await asyncio.sleep(self.opts.stats_interval_s)
            total = self.orchestrator.started_total
            rate = (total - last) / self.opts.stats_interval_s
            last = total
            pools = ", ".join(
                f"{p.name}: {len(p.live())} up/{sum(r.in_flight for r in p.live())} busy"
                for p in self.pools.values()
            )
            log.info(
                "stats: %.1f req/s, %d in flight, %d total; %s",
                rate,
                self.orchestrator.in_flight,
                total,
                pools,
            )

    # -- events ----------------------------------------------------------------------

    def _on_register(self, slot: Slot, req: RegisterRequest) -> None:
        """Control thread: a replica registered; it is STARTING until READY."""
        self.coordinator.register(
            (slot.stage_id, slot.replica_id),
            slot.epoch,
            req.replica_bind_address or "",
            slot.head_local,
            self.opts.stage_init_timeout_s,
        )
        key = (slot.stage_id, slot.replica_id)
        with self._lock:
            stale = self._dialled.pop(key, None)
        if stale is not None:
            # The slot's previous incarnation bound its own sockets: stop redialling them.
            with contextlib.suppress(zmq.ZMQError):
                self._handshake_sock.disconnect(stale[0])
            self._loop.call_soon_threadsafe(self.channels.disconnect_replica, *stale[1:])
        if slot.binds_sockets and slot.replica_ports and slot.bind_address:
            # The replica binds its own sockets: dial them. The handshake socket belongs
            # to this (control) thread; the data sockets to the loop.
            urls = tuple(tcp_url(slot.bind_address, port) for port in slot.replica_ports)
            with self._lock:
                self._dialled[key] = urls
            self._handshake_sock.connect(urls[0])
            self._loop.call_soon_threadsafe(self.channels.connect_replica, urls[1], urls[2])

    def _init_for(self, stage_id: int) -> HandshakeInit:
        """Control thread: what a replica of ``stage_id`` needs to serve."""
        return HandshakeInit(
            stage_config=self.config.stage(stage_id).model_dump(mode="json"),
            input_address=self.addresses.input,
            output_address=self.addresses.output,
            coordinator_address=self.addresses.coordinator,
            heartbeat_interval_s=self.opts.heartbeat_interval_s,
            stage_init_timeout_s=self.opts.stage_init_timeout_s,
            heartbeat_timeout_s=self.opts.heartbeat_timeout_s,
        )

    def _on_ready(self, identity: bytes, ready: Ready) -> None:
        if identity != routing_id(ready.stage_id, ready.replica_id, ready.epoch):
            log.warning("READY with a mismatched routing id %r dropped", identity)
            return
        ok = self.coordinator.ready(
            (ready.stage_id, ready.replica_id), ready.epoch, ready.capacity, ready.pid
        )
        if not ok:
            log.warning(
                "READY from stage %d replica %d epoch %d ignored (not a current registration)",
                ready.stage_id,
                ready.replica_id,
                ready.epoch,
            )
            self.channels.post(identity, Shutdown("stale registration"))

    def _on_outputs(self, chunks: list[OutputChunk]) -> None:
        self.orchestrator.on_outputs(chunks)

    def _post_transition(self, t: Transition) -> None:
        # Called from the control thread, launcher threads or the loop itself.
        self._loop.call_soon_threadsafe(self._on_transition, t)

    def _on_transition(self, t: Transition) -> None:
        self.orchestrator.on_transition(t)
        if t.new == ReplicaState.DOWN:
            with self._lock:
                self.slots.release(t.entry.stage_id, t.entry.replica_id, t.entry.epoch)
                gone = self._dialled.get((t.entry.stage_id, t.entry.replica_id))
            if gone is not None:
                # It left for good: stop redialling its data sockets. (Its handshake
                # endpoint, owned by the control thread, goes when the slot is reused.)
                self.channels.disconnect_replica(*gone[1:])
        # Start-up ends the moment every stage has a live replica (as /health sees it).
        started = t.new == ReplicaState.UP and not self._serving.is_set()
        if started and not self.stages_without_replicas():
            self._serving.set()

    def _on_disconnect(self) -> None:
        """Some replica's data connection closed: find which by probing them all, now
        and again shortly (ZMQ may drop the peer a moment after the event)."""
        for delay in (0.0, 0.1, 0.5):
            self._loop.call_later(delay, self._probe_replicas)

    def _probe_replicas(self) -> None:
        for pool in self.pools.values():
            for handle in list(pool.replicas.values()):
                self.channels.post(handle.identity, Ping())
        self.channels.outbox.flush()

    def _on_unreachable_identity(self, identity: bytes, reason: str) -> None:
        try:
            stage_id, replica_id, epoch = (int(p) for p in identity.split(b"."))
        except ValueError:
            return
        self.coordinator.mark((stage_id, replica_id), epoch, ReplicaState.ERROR, reason)

    def _on_process_exit(self, proc: LocalReplicaProcess, code: int) -> None:
        """Launcher thread: a local replica process ended."""
        spec = proc.spec
        if code != 0 and not self._serving.is_set() and not self._stop.is_set():
            # A replica that cannot even start has a configuration or install problem
            # that neither waiting out --init-timeout nor a restart fixes: fail now,
            # pointing at the replica's own error above.
            name = self.config.stage(spec.stage_id).name
            log.error(
                "stage %d (%s) replica %d exited with code %d while starting; see its "
                "log lines above. Shutting down.",
                spec.stage_id,
                name,
                spec.replica_id,
                code,
            )
            self.exit_code = 1
            self._loop.call_soon_threadsafe(self._stop.set)
            return
        self.coordinator.mark(
            (spec.stage_id, spec.replica_id),
            None,
            ReplicaState.ERROR,
            f"local process exited with code {code}",
        )
        if self._stop.is_set():
            return
        delay = self.restarts.delay_after_exit((spec.stage_id, spec.replica_id), code)
        if delay is not None:
            log.info(
                "restarting stage %d replica %d in %.0fs (--omni-restart-policy %s)",
                spec.stage_id,
                spec.replica_id,
                delay,
                self.restarts.mode,
            )
            self._loop.call_soon_threadsafe(
                lambda: self._loop.call_later(delay, self._start_local, spec)
            )

    def _on_signal(self, sig: int) -> None:
        log.info("received %s; shutting down", signal.Signals(sig).name)
        self._stop.set()

    # -- shutdown --------------------------------------------------------------------

    async def _shutdown(self) -> None:
        self.master.closing = True
        for pool in self.pools.values():
            for handle in pool.live():
                self.channels.post(handle.identity, Shutdown("head shutting down"))
        self.channels.outbox.flush()
        await asyncio.sleep(0.05)  # let the Shutdown messages leave
        await asyncio.to_thread(self.launcher.stop_all, self.opts.shutdown_grace_s)
        await self.channels.stop()
        self.control.stop()
        if self._zauth is not None:
            self._zauth.stop()
        self._zctx.term()
        log.info("head stopped")

    # -- status for the API ----------------------------------------------------------

    def stages_without_replicas(self) -> list[tuple[int, str]]:
        return [(sid, p.name) for sid, p in self.pools.items() if not p.live()]

    def stages_status(self) -> dict[str, Any]:
        return status.stages_status(
            self.config,
            self.pools,
            self.coordinator.snapshot(),
            {
                "master_address": self.master_url,
                "lb_policy": self.opts.lb_policy,
                "heartbeat_timeout_s": self.opts.heartbeat_timeout_s,
            },
        )
