"""The head's shell: signals, the HTTP server, start-up and shutdown.

It builds the pieces in order (sockets, tables, pools, orchestrator, the event handlers,
the control plane, local replicas) and owns none of their logic.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib
import logging
import secrets
import signal
import threading
import time
import uuid
from collections.abc import Iterator

import uvicorn

from omnistage.control.coordinator import PrefixReport
from omnistage.control.replica_table import Transition
from omnistage.head import wiring
from omnistage.head.api_servers import ApiServers
from omnistage.head.events import ReplicaEvents
from omnistage.head.frontends import FrontendServer
from omnistage.head.history import History
from omnistage.head.jobs import build_runner, head_name
from omnistage.head.local import LocalHooks, LocalReplicas
from omnistage.head.options import HeadOptions
from omnistage.head.service import HeadService
from omnistage.head.sockets import HeadSockets
from omnistage.head.startup import StartupWatch, Verdict, stage_names
from omnistage.head.state import control_state
from omnistage.head.stats import log_stats
from omnistage.heap import freeze_startup_objects
from omnistage.jobs.runner import JobRunner
from omnistage.jobs.setup import StoreUnavailable, open_persistence
from omnistage.jobs.state import Persistence
from omnistage.launch.base import placed_nodes
from omnistage.net import listen_tcp
from omnistage.protocol.messages import ReplicaState, Shutdown

log = logging.getLogger(__name__)


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: the head owns SIGTERM/SIGINT."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _log_start(opts: HeadOptions, sockets: HeadSockets) -> None:
    log.info(
        "master listening on %s (-oma %s -omp %s); pipeline %r with stages %s",
        sockets.master_url,
        opts.master_host,
        sockets.master_port,
        opts.config.pipeline,
        ", ".join(f"{s.stage_id}:{s.name}" for s in opts.config.stages),
    )


class Head:
    def __init__(self, opts: HeadOptions) -> None:
        """Claims the HTTP port, then binds every ZMQ socket; OSError (or ZMQError) if
        either is taken, before any replica starts."""
        self.opts = opts
        self._http_socket = listen_tcp(opts.host, opts.port)
        # Names this run of the head: replicas that rejoin it get their old ids back.
        self.instance = uuid.uuid4().hex[:12]
        self.exit_code = 0
        self._stop = asyncio.Event()
        # Set once every stage has had a live replica: start-up is over.
        self._serving = threading.Event()
        self.sockets = HeadSockets(opts)
        # The other heads of its fleet (--omni-join), told to replicas with every ack.
        self.fleet = wiring.fleet(opts, self.sockets.master_url, self.instance)
        # Given to local replicas only (in their options): the key to head-local slots.
        local_key = secrets.token_hex(16)
        self.state = control_state(
            opts,
            self.instance,
            local_key,
            self._post_transition,
            self._post_prefixes,
            heads=self.fleet.heads,
        )
        self.slots, self.coordinator = self.state.slots, self.state.coordinator
        self.orchestrator = wiring.orchestrator(opts, self.sockets)
        self.pools = self.orchestrator.pools
        history = History({s.stage_id: s.name for s in opts.config.stages})
        self.events = ReplicaEvents(
            opts,
            self.sockets,
            self.state,
            self.orchestrator,
            history=history,
            on_serving=self._check_serving,
            heads=self.fleet.heads,
        )
        control = wiring.control_plane(opts, self.state, self.sockets, self.events, self.fleet)
        self.master, self.control = control
        restart = self._restart_note
        hooks = LocalHooks(self._serving.is_set, self._fail_soon, history.restarted, restart)
        self.local = LocalReplicas(
            opts, self.state, hooks, master_port=self.sockets.master_port, local_key=local_key
        )
        self.scaler = wiring.scaler(
            opts, self.orchestrator, self.coordinator, self.local, self._job_backlog
        )
        self.service = HeadService(
            opts,
            self.orchestrator,
            self.coordinator,
            master_url=self.sockets.master_url,
            history=history,
            scaling=self.scaler.status,
            nodes=functools.partial(placed_nodes, self.local.launcher),
            heads=self.fleet.snapshot,
        )
        self.frontends, self.api_servers = self._api_servers()
        self.persist: Persistence | None = None  # opened as the head starts (run)
        self.jobs: JobRunner | None = None

    def _api_servers(self) -> tuple[FrontendServer | None, ApiServers | None]:
        """With --api-server-count > 1: API server processes serve HTTP in front of this
        head, talking to it through the frontend server; else (None, None)."""
        if self.opts.api_server_count <= 1:
            return None, None
        frontends = FrontendServer(self.service)
        servers = ApiServers(
            self.opts, self._http_socket, frontends.address, self.service.started_at
        )
        return frontends, servers

    async def run(self) -> int:
        loop = self._loop = asyncio.get_running_loop()
        try:  # first: a store that cannot open stops the head before anything starts
            self.persist = await open_persistence(
                self.opts.store_url, self.opts.media_url, self.opts.media_ttl_s
            )
        except StoreUnavailable as exc:
            log.error("%s", exc)
            self.sockets.close()
            return 1
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal, sig)
        self.events.attach(loop)
        self.sockets.channels.start(self.events)
        self.control.start()
        self.fleet.start()
        _log_start(self.opts, self.sockets)
        name = head_name(self.opts.port)
        runner = build_runner(self.persist, self.service, self.pools, name, self.opts.job_lease_s)
        self.local.start(loop)
        if self.api_servers is None:  # else API server processes serve it, not the head
            # The HTTP API is imported once the replicas are starting, on a thread: it is
            # most of the head's imports (~1 s of one core on a small VM), and this way it
            # runs beside the replicas' own start while the loop takes registrations.
            await asyncio.to_thread(importlib.import_module, "omnistage.api.app")
        freeze_startup_objects()  # see omnistage.heap: full collections skip them
        server, server_task = self._serve_http(loop)
        helpers = [
            asyncio.create_task(self._await_stages(), name="omni-init-wait"),
            asyncio.create_task(self._observe_load(), name="omni-load"),
            asyncio.create_task(self.scaler.run(), name="omni-autoscale"),
        ]
        if runner is not None:
            self.jobs = runner
            helpers.append(asyncio.create_task(runner.run(), name="omni-jobs"))
        if self.opts.log_stats:
            stats = log_stats(self.orchestrator, self.pools, self.opts.stats_interval_s)
            helpers.append(asyncio.create_task(stats, name="omni-stats"))
        stop_task = asyncio.create_task(self._stop.wait())
        await asyncio.wait({server_task, stop_task}, return_when=asyncio.FIRST_COMPLETED)
        if server_task.done() and not self._stop.is_set():
            exc = server_task.exception()
            log.error("HTTP server exited%s", f": {exc}" if exc else "")
            self.exit_code = 1
        for task in (*helpers, stop_task):
            task.cancel()
        # The job runner frees its leases as it stops: another head runs them at once.
        await asyncio.gather(*helpers, return_exceptions=True)
        if server is not None:
            server.should_exit = True
        with contextlib.suppress(BaseException):
            await asyncio.wait_for(server_task, self.opts.shutdown_grace_s)
        await self._shutdown()
        return self.exit_code

    def _serve_http(
        self, loop: asyncio.AbstractEventLoop
    ) -> tuple[_Server | None, asyncio.Task[None]]:
        """uvicorn in this process; or, with --api-server-count > 1, API server processes
        on the same socket in front of this orchestrator (then the task ends at stop)."""
        if self.frontends is None or self.api_servers is None:
            server = _Server(_http_config(self.opts, self.service, self.persist))
            return server, loop.create_task(server.serve([self._http_socket]), name="omni-http")
        self.frontends.start(loop)
        self.api_servers.start(loop)
        task = self._run_api_servers(self.frontends, self.api_servers)
        return None, loop.create_task(task, name="omni-api-servers")

    async def _run_api_servers(self, frontends: FrontendServer, servers: ApiServers) -> None:
        """Until the head stops; then the servers finish their HTTP requests in flight."""
        await self._stop.wait()
        await servers.stop(self.opts.shutdown_grace_s)
        await frontends.stop()

    async def _await_stages(self) -> None:
        """Report stages still waiting for replicas; give up after --init-timeout."""
        watch = StartupWatch(time.monotonic, self.opts.init_timeout_s)
        while True:
            missing = self.service.stages_without_replicas()
            verdict = watch.judge(missing)
            if verdict is Verdict.SERVING:
                log.info(
                    "all stages have live replicas; serving on http://%s:%d",
                    self.opts.host,
                    self.opts.port,
                )
                return
            if verdict is Verdict.FAILED:
                log.error(
                    "stage(s) %s got no replica within --init-timeout (%gs); shutting down",
                    stage_names(missing),
                    watch.init_timeout_s,
                )
                self.exit_code = 1
                self._stop.set()
                return
            if verdict is Verdict.NOTE:
                log.info("waiting for replicas of stage(s) %s", stage_names(missing))
            await asyncio.sleep(0.1)

    async def _observe_load(self) -> None:
        while True:
            await asyncio.sleep(self.opts.heartbeat_interval_s)
            for reading in self.coordinator.loads():
                pool = self.pools.get(reading.stage_id)
                if pool is not None:
                    pool.observe(reading)

    # -- callbacks -------------------------------------------------------------------

    def _job_backlog(self, stage_id: int) -> int:
        """Jobs queued in the store for the stage: load the autoscaler scales for."""
        return self.jobs.backlog(stage_id) if self.jobs is not None else 0

    def _post_transition(self, t: Transition) -> None:
        if t.new == ReplicaState.UP and t.entry.local:
            self.local.came_up(t.entry.key)
        self.events.post_transition(t)

    def _post_prefixes(self, report: PrefixReport) -> None:
        self.events.post_prefixes(report)

    def _check_serving(self) -> None:
        # Start-up ends the moment every stage has a live replica (as /health sees it).
        if not self._serving.is_set() and not self.service.stages_without_replicas():
            self._serving.set()

    def _restart_note(self, stage_id: int, replica_id: int, at: float | None) -> None:
        """The loop: a local replica restarts at ``at`` (None: it will not after all)."""
        self.pools[stage_id].restart(replica_id, at)

    def _fail_soon(self) -> None:
        """From a launcher thread: a replica could not start; stop the head."""
        self.exit_code = 1
        self._loop.call_soon_threadsafe(self._stop.set)

    def _on_signal(self, sig: int) -> None:
        log.info("received %s; shutting down", signal.Signals(sig).name)
        self._stop.set()

    # -- shutdown --------------------------------------------------------------------

    async def _shutdown(self) -> None:
        self.master.closing = True
        channels = self.sockets.channels
        for pool in self.pools.values():
            for handle in pool.live():
                channels.post(handle.identity, Shutdown("head shutting down"))
        channels.outbox.flush()
        await asyncio.sleep(0.05)  # let the Shutdown messages leave
        await self.local.stop()
        await channels.stop()
        self.fleet.stop()
        self.control.stop()
        self.sockets.close()
        if self.persist is not None:
            await self.persist.store.close()
        log.info("head stopped")


def _http_config(
    opts: HeadOptions, service: HeadService, persist: Persistence | None
) -> uvicorn.Config:
    """The head's own HTTP server (one API server: ``--api-server-count`` 1)."""
    # Imported as the head runs, not with it (see ``Head.run``).
    from omnistage.api.app import create_app
    from omnistage.api.media_parts import MediaFetch
    from omnistage.api.routes.realtime import RealtimeLimits

    limits = RealtimeLimits(
        opts.realtime_max_sessions, opts.realtime_idle_timeout_s, opts.realtime_resume_ttl_s
    )
    fetch = MediaFetch(
        opts.allowed_media_domains, opts.media_fetch_timeout_s, opts.media_fetch_max_bytes
    )
    app = create_app(service, opts.api_key, opts.max_request_bytes, limits, persist, fetch)
    return uvicorn.Config(
        app,
        host=opts.host,
        port=opts.port,
        log_level=opts.log_level.lower(),
        lifespan="off",
        access_log=False,
        # Nothing reads the client address (no access log): skip the layer that
        # rewrites it from X-Forwarded-For on every request.
        proxy_headers=False,
    )
