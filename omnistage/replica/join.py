"""Joining a head: register, handshake, load the engine; and joining again, with backoff,
after the head was lost (keeping the loaded engine unless it must change)."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable

import zmq

from omnistage.config.load import apply_stage_overrides
from omnistage.config.schema import StageConfig
from omnistage.engines import build_engine
from omnistage.engines.base import Engine
from omnistage.heap import freeze_startup_objects, thaw
from omnistage.logs import tag_logs
from omnistage.net import detect_local_address, free_ports, is_loopback
from omnistage.protocol.auth import Signer
from omnistage.protocol.errors import IdConflict, OmniError
from omnistage.protocol.messages import HandshakeInit, ReplicaState
from omnistage.protocol.registration import RegisterReply
from omnistage.replica.heartbeat import HeartbeatSpec, HeartbeatThread, LoadReport, Reports
from omnistage.replica.options import ReplicaOptions
from omnistage.replica.register import (
    MasterLink,
    gives_way,
    handshake,
    register_in_fleet,
    registration,
    with_fleet_id,
)

log = logging.getLogger(__name__)


class Joiner:
    def __init__(
        self,
        ctx: zmq.Context,
        opts: ReplicaOptions,
        signer: Signer | None,
        sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
    ) -> None:
        """``sleep``: waits out the backoff between rejoin attempts."""
        self._sleep = sleep
        self._ctx = ctx
        self._opts = opts
        self._signer = signer
        # Set to abandon a registration or handshake in progress (a signal).
        self.cancel = threading.Event()
        self._link = MasterLink(ctx, opts.master_host, opts.master_port, signer, self.cancel)
        self.replica_id = opts.replica_id
        self.address: str | None = None  # advertised; kept across rejoins
        self.reply: RegisterReply | None = None
        self._head_instance = ""
        # Set once the replica serves other heads of a fleet under its id: registering
        # again (the first head restarted) asks for that id, not a new one.
        self.keep_id = False

    def new_id(self) -> None:
        """Register next time for a new id: the one we have is another replica's at
        another head of the fleet. (The first head keeps our old slot until the new
        registration arrives, so it cannot hand the same id back.)"""
        self.keep_id = False
        self._head_instance = ""

    async def join(self) -> tuple[HandshakeInit, Engine]:
        """Register, handshake and load the engine, all within --stage-init-timeout."""
        deadline = time.monotonic() + self._opts.stage_init_timeout_s
        init = await self._first_registration(deadline)
        return init, await self._load(self.stage_config(init), deadline, init)

    async def _first_registration(self, deadline: float) -> HandshakeInit:
        """Register and handshake by ``deadline``. An operator's --replica-id held by
        another live replica waits for that one to go (the head fences it once it sees
        it dead), trying again with backoff; an assigned id gives way as in ``rejoin``."""
        delay = 0.5
        while True:
            try:
                return await self._register_and_handshake(max(0.001, deadline - time.monotonic()))
            except IdConflict as exc:
                if gives_way(self._opts, exc):
                    log.warning("%s; registering for a new id", exc)
                    self.new_id()
                    continue
                if time.monotonic() + delay >= deadline:
                    raise
                log.warning(
                    "%s; waiting %.1fs for it to go (or start this one with another --replica-id)",
                    exc,
                    delay,
                )
            await self._sleep(delay)
            delay = min(5.0, delay * 2)

    async def rejoin(self, engine: Engine, failed: bool) -> tuple[HandshakeInit, Engine]:
        """Register again until a head takes us; reload the engine only if the new head's
        config for this stage differs from the one loaded, or the head failed us."""
        low, high = self._opts.rejoin_backoff_s
        delay = low
        while True:
            try:
                init = await self._register_and_handshake(max(2.0, 2 * high))
                break
            except IdConflict as exc:
                if gives_way(self._opts, exc):
                    log.warning("%s; registering for a new id", exc)
                    self.new_id()
                    continue
                log.info("rejoin refused (%s); trying again in %.1fs", exc, delay)
            except OmniError as exc:
                log.info("rejoin failed (%s); trying again in %.1fs", exc, delay)
            await self._sleep(delay)
            delay = min(high, delay * 2)
        stage = self.stage_config(init)
        changed = stage != engine.stage
        if changed or failed:
            # A head that failed us (a stalled engine, say) gets a fresh engine.
            why = "config for this stage changed" if changed else "marked this replica ERROR"
            log.info("the head's %s: reloading the engine", why)
            await engine.shutdown()
            deadline = time.monotonic() + self._opts.stage_init_timeout_s
            engine = await self._load(stage, deadline, init)
        log.info("rejoined the head as stage %d replica %d", self._opts.stage_id, self.replica_id)
        return init, engine

    def stage_config(self, init: HandshakeInit) -> StageConfig:
        raw, overrides = init.stage_config, self._opts.stage_overrides
        if overrides:
            raw = apply_stage_overrides({"stages": [raw]}, {str(raw["stage_id"]): overrides})
            raw = raw["stages"][0]
        return StageConfig.model_validate(raw)

    async def _register_and_handshake(self, timeout_s: float) -> HandshakeInit:
        deadline = time.monotonic() + timeout_s
        o = self._opts
        address = o.advertise_address or detect_local_address(o.master_host, o.master_port)
        if is_loopback(address) and self.address and not is_loopback(o.master_host):
            # No route to the head right now (a rejoin during an outage): the detection
            # falls back to loopback, which the head could not reach; keep what worked.
            address = self.address
        self.address = address
        ports = tuple(free_ports(3, address)) if o.binds_sockets else None
        previous = (self._head_instance, self.replica_id) if self._head_instance else None
        req = registration(o, address, ports, previous)
        if self.keep_id and self.replica_id >= 0:
            req = with_fleet_id(o, req, self.replica_id)
        reply = await asyncio.to_thread(register_in_fleet, o, self._link, req, timeout_s)
        self.replica_id, self._head_instance, self.reply = (
            reply.replica_id,
            reply.head_instance,
            reply,
        )
        tag_logs(o.stage_id, self.replica_id)
        log.info("registered as stage %d replica %d", o.stage_id, self.replica_id)
        left = max(0.001, deadline - time.monotonic())
        return await asyncio.to_thread(
            handshake, self._link, reply, o.stage_id, left, o.binds_sockets
        )

    async def _load(self, stage: StageConfig, deadline: float, init: HandshakeInit) -> Engine:
        thaw()  # a reload: the old engine's objects may be freed now
        engine = build_engine(stage)
        engine.starting = f"loading the {stage.engine} engine"
        log.info("loading engine %r for stage %r", stage.engine, stage.name)
        # Heartbeats while loading carry what the engine is doing (a STARTING detail
        # for /v1/omni/stages); the session's own heartbeats take over once it is READY.
        beats = self._starting_heartbeat(init, engine)
        try:
            await asyncio.wait_for(engine.start(), max(0.001, deadline - time.monotonic()))
        except TimeoutError:
            raise TimeoutError(
                f"engine did not load within --stage-init-timeout "
                f"({self._opts.stage_init_timeout_s:g}s)"
            ) from None
        finally:
            if beats is not None:
                await asyncio.to_thread(beats.stop, False)
        freeze_startup_objects()  # the engine's weights and modules: see omnistage.heap
        return engine

    def _starting_heartbeat(self, init: HandshakeInit, engine: Engine) -> HeartbeatThread | None:
        if self.reply is None:
            return None
        reports = Reports(
            load=lambda: LoadReport(0, 0, engine.progress),
            status=lambda: ReplicaState.STARTING,
            detail=lambda: engine.starting,
        )
        spec = HeartbeatSpec.of(self._opts.stage_id, self.reply, init)
        beats = HeartbeatThread(self._ctx, spec, reports, signer=self._signer)
        beats.start()
        return beats
