"""The replica process: register, handshake, load the engine, serve, heartbeat.

The same code runs as a local subprocess of the head and as a --headless replica on
another host. Socket I/O lives on the asyncio loop; the heartbeat has its own thread.

A headless replica (``rejoin``) outlives its head: when the head leaves (it says so,
or stops answering heartbeats, or no longer knows this replica) the replica drops its
requests (the head re-dispatches them) and its connections, keeps its loaded engine,
and registers again, with backoff, until a head takes it back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import zmq

from omnistage import curve
from omnistage.config.load import apply_stage_overrides
from omnistage.config.schema import StageConfig
from omnistage.control.replica_table import routing_id
from omnistage.engines import build_engine
from omnistage.engines.base import Engine, EngineRequest, StageInput
from omnistage.net import detect_local_address, free_ports, is_loopback
from omnistage.protocol import codec
from omnistage.protocol.auth import Signer, Verifier
from omnistage.protocol.errors import BadRequestError, OmniError, ProtocolError
from omnistage.protocol.messages import (
    Abort,
    AddRequest,
    HandshakeInit,
    InputChunk,
    OutputChunk,
    Ping,
    Ready,
    Shutdown,
)
from omnistage.replica.heartbeat import HeartbeatThread, LoadReport
from omnistage.replica.outputs import OutputCoalescer, ReplayFilter
from omnistage.replica.register import handshake, register
from omnistage.zmqio import Pump

log = logging.getLogger(__name__)


@dataclass
class ReplicaOptions:
    stage_id: int
    master_host: str
    master_port: int
    replica_id: int = -1  # -1: let the master assign one
    advertise_address: str | None = None
    stage_init_timeout_s: float = 300.0
    # Fields of this stage to override locally (e.g. devices on this host).
    stage_overrides: dict[str, Any] = field(default_factory=dict)
    # Bind our own data sockets on advertise_address and let the head dial in.
    binds_sockets: bool = False
    # On SIGTERM/SIGINT: finish in-flight requests for up to this long, then exit.
    drain_timeout_s: float = 30.0
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


@dataclass
class _Running:
    inputs: asyncio.Queue[InputChunk]
    task: asyncio.Task[None] | None = None


class ReplicaRuntime:
    def __init__(self, opts: ReplicaOptions) -> None:
        self.opts = opts
        self._sync_ctx = zmq.Context()
        if opts.curve_keys:
            curve.secure_replica(self._sync_ctx, opts.curve_keys)
        self._requests: dict[str, _Running] = {}
        self._engine: Engine | None = None
        self._stopping = asyncio.Event()
        self._cancel_join = threading.Event()
        self._draining = False
        self._signer = Signer(opts.auth_token) if opts.auth_token else None
        self._verifier = Verifier(opts.auth_token) if opts.auth_token else None
        self._head_lost = asyncio.Event()
        self._exit_code = 0
        self._failed_by_head = False
        self._head_instance = ""
        self.replica_id = opts.replica_id
        self.address: str | None = None  # advertised; kept across rejoins
        self.epoch = 0
        self._chunks_sent = 0
        self._outputs = OutputCoalescer()

    # -- lifecycle -------------------------------------------------------------------

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal, sig)
        # Joining runs as its own task so a signal can interrupt a slow engine load.
        self._join_task = asyncio.create_task(self._join())
        try:
            init = await self._join_task
        except (OmniError, TimeoutError) as exc:
            log.error("stage %d replica failed to start: %s", self.opts.stage_id, exc)
            await self._close()
            return 1
        except asyncio.CancelledError:
            await self._close()
            return 0
        try:
            while not self._stopping.is_set():
                await self._serve(init)
                # Draining means the operator wants us gone: do not look for a new head.
                if self._stopping.is_set() or not self.opts.rejoin or self._draining:
                    break
                await self._leave_head()
                self._join_task = asyncio.create_task(self._rejoin())
                try:
                    init = await self._join_task
                except asyncio.CancelledError:
                    break
                except (OmniError, TimeoutError) as exc:
                    log.error("stage %d replica failed to rejoin: %s", self.opts.stage_id, exc)
                    self._exit_code = 1
                    break
        finally:
            await self._close()
        return self._exit_code

    def _on_signal(self, sig: int) -> None:
        if self._draining or not self._join_task.done():
            # Still starting (nothing to finish) or a second signal: stop now.
            log.info("received %s; shutting down", signal.Signals(sig).name)
            self._stopping.set()
            self._cancel_join.set()
            if not self._join_task.done():
                self._join_task.cancel()
            return
        self._draining = True
        log.info(
            "received %s; draining %d request(s) for up to %gs (again to stop now)",
            signal.Signals(sig).name,
            len(self._requests),
            self.opts.drain_timeout_s,
        )
        heartbeat = getattr(self, "_heartbeat", None)
        if heartbeat is not None:
            heartbeat.beat_now()  # the head stops sending new work at once
        asyncio.get_running_loop().create_task(self._drain())

    async def _drain(self) -> None:
        deadline = time.monotonic() + self.opts.drain_timeout_s
        while self._requests and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self._requests:
            log.warning("drain timeout: %d request(s) cut short", len(self._requests))
        self._stopping.set()

    async def _join(self) -> HandshakeInit:
        """Register, handshake and load the engine, all within --stage-init-timeout."""
        deadline = time.monotonic() + self.opts.stage_init_timeout_s
        init = await self._register_and_handshake(self.opts.stage_init_timeout_s)
        await self._load_engine(self._stage_config(init), deadline)
        return init

    async def _register_and_handshake(self, timeout_s: float) -> HandshakeInit:
        deadline = time.monotonic() + timeout_s
        o = self.opts
        address = o.advertise_address or detect_local_address(o.master_host, o.master_port)
        previous_address = self.address
        if is_loopback(address) and previous_address and not is_loopback(o.master_host):
            # No route to the head right now (a rejoin during an outage): the detection
            # falls back to loopback, which the head could not reach; keep what worked.
            address = previous_address
        self.address = address
        ports = tuple(free_ports(3, address)) if o.binds_sockets else None
        previous = (self._head_instance, self.replica_id) if self._head_instance else None
        reply = await asyncio.to_thread(
            register,
            self._sync_ctx,
            o.master_host,
            o.master_port,
            o.stage_id,
            o.replica_id,
            address,
            timeout_s,
            o.stage_overrides or None,
            self._cancel_join,
            ports,
            self._signer,
            previous,
            o.local_key,
        )
        self.replica_id, self.epoch = reply.replica_id, reply.epoch
        self._head_instance = reply.head_instance
        self._reply = reply
        _tag_logs(o.stage_id, self.replica_id)
        log.info("registered as stage %d replica %d", o.stage_id, self.replica_id)
        return await asyncio.to_thread(
            handshake,
            self._sync_ctx,
            reply,
            o.stage_id,
            _left(deadline),
            o.master_host,
            self._cancel_join,
            o.binds_sockets,
            self._signer,
        )

    async def _load_engine(self, stage: StageConfig, deadline: float) -> None:
        self._engine = build_engine(stage)
        log.info("loading engine %r for stage %r", stage.engine, stage.name)
        try:
            await asyncio.wait_for(self._engine.start(), _left(deadline))
        except TimeoutError:
            raise TimeoutError(
                f"engine did not load within --stage-init-timeout "
                f"({self.opts.stage_init_timeout_s:g}s)"
            ) from None

    async def _rejoin(self) -> HandshakeInit:
        """Register again until a head takes us; reload the engine only if the new
        head's config for this stage differs from the one loaded."""
        low, high = self.opts.rejoin_backoff_s
        delay = low
        while True:
            try:
                init = await self._register_and_handshake(max(2.0, 2 * high))
                break
            except OmniError as exc:
                log.info("rejoin failed (%s); trying again in %.1fs", exc, delay)
            await asyncio.sleep(delay)
            delay = min(high, delay * 2)
        stage = self._stage_config(init)
        changed = self._engine is None or stage != self._engine.stage
        if changed or self._failed_by_head:
            # A head that failed us (a stalled engine, say) gets a fresh engine.
            why = "config for this stage changed" if changed else "marked this replica ERROR"
            log.info("the head's %s: reloading the engine", why)
            self._failed_by_head = False
            if self._engine is not None:
                await self._engine.shutdown()
            await self._load_engine(stage, time.monotonic() + self.opts.stage_init_timeout_s)
        log.info("rejoined the head as stage %d replica %d", self.opts.stage_id, self.replica_id)
        return init

    async def _leave_head(self) -> None:
        """Drop what belonged to the lost head: requests, connections, heartbeats."""
        self._draining = False
        self._head_lost.clear()
        tasks = [r.task for r in self._requests.values() if r.task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._outputs.drain()
        self._heartbeat.stop(send_down=False)
        self._in.close()
        self._out.close(linger=0)
        self._in = self._out = None

    def _on_head_lost(self, why: str, failed: bool = False) -> None:
        """Heartbeat thread: the head is gone or will not route to us (``failed``: it
        marked us ERROR)."""
        loop = self._loop
        self._failed_by_head = failed
        if self.opts.rejoin:
            log.warning("lost the head: %s; registering again", why)
            loop.call_soon_threadsafe(self._head_lost.set)
        else:
            # A failure exit, so the head's --omni-restart-policy on-failure restarts us.
            log.warning("lost the head: %s; exiting", why)
            self._exit_code = 1
            loop.call_soon_threadsafe(self._stopping.set)

    def _stage_config(self, init: HandshakeInit) -> StageConfig:
        raw = init.stage_config
        if self.opts.stage_overrides:
            raw = apply_stage_overrides(
                {"stages": [raw]}, {str(raw["stage_id"]): self.opts.stage_overrides}
            )["stages"][0]
        return StageConfig.model_validate(raw)

    async def _serve(self, init: HandshakeInit) -> None:
        """Serve the head until we stop or (``_head_lost``) must rejoin."""
        assert self._engine is not None
        loop = self._loop = asyncio.get_running_loop()
        ident = routing_id(self.opts.stage_id, self.replica_id, self.epoch)
        self._in = self._sync_ctx.socket(zmq.DEALER)
        self._in.setsockopt(zmq.ROUTING_ID, ident)
        self._in.setsockopt(zmq.LINGER, 0)
        self._in.setsockopt(zmq.RCVHWM, 100_000)
        self._out = self._sync_ctx.socket(zmq.PUSH)
        self._out.setsockopt(zmq.LINGER, 1000)
        self._out.setsockopt(zmq.SNDHWM, 100_000)
        if self.opts.binds_sockets:
            self._in.bind(self._reply.input_address)
            self._out.bind(self._reply.output_address)
        else:
            self._in.connect(init.input_address)
            self._out.connect(init.output_address)
        self._heartbeat = HeartbeatThread(
            self._sync_ctx,
            init.coordinator_address,
            self.opts.stage_id,
            self.replica_id,
            self.epoch,
            init.heartbeat_interval_s,
            self._load_report,
            lambda: "DRAINING" if self._draining else "UP",
            self._signer,
            self._on_head_lost,
            2 * init.heartbeat_timeout_s,
            verifier=self._verifier,
        )
        ready = Ready(
            stage_id=self.opts.stage_id,
            replica_id=self.replica_id,
            epoch=self.epoch,
            capacity=self._engine.capacity,
            engine=self._engine.name,
            pid=os.getpid(),
            address=self.address,
        )
        self._in.send_multipart(codec.encode(ready))
        self._pump = Pump(loop, self._in, self._on_frames)
        self._heartbeat.start()
        log.info("ready (capacity %d)", self._engine.capacity)
        stop = asyncio.ensure_future(self._stopping.wait())
        lost = asyncio.ensure_future(self._head_lost.wait())
        await asyncio.wait({stop, lost}, return_when=asyncio.FIRST_COMPLETED)
        stop.cancel()
        lost.cancel()
        self._pump.close()

    async def _close(self) -> None:
        for running in list(self._requests.values()):
            if running.task is not None:
                running.task.cancel()
        if self._requests:
            await asyncio.gather(
                *(r.task for r in self._requests.values() if r.task), return_exceptions=True
            )
        if getattr(self, "_out", None) is not None:
            self._flush()
        hb = getattr(self, "_heartbeat", None)
        if hb is not None:
            hb.stop(send_down=True)
        if self._engine is not None:
            with contextlib.suppress(Exception):
                await self._engine.shutdown()
        for name in ("_in", "_out"):
            sock = getattr(self, name, None)
            if sock is not None:
                sock.close()
        self._sync_ctx.term()
        log.info("stopped")

    # -- requests --------------------------------------------------------------------

    def _on_frames(self, frames: list[bytes]) -> None:
        try:
            messages = codec.decode_batch(frames)
        except ProtocolError as exc:
            log.warning("dropped a bad message from the head: %s", exc)
            return
        for msg in messages:
            if isinstance(msg, AddRequest):
                self._add(msg)
            elif isinstance(msg, InputChunk):
                running = self._requests.get(msg.request_id)
                if running is not None:
                    running.inputs.put_nowait(msg)
            elif isinstance(msg, Abort):
                # Forget it now, not when the task ends: a retry of the same request may
                # follow in this very batch (a silent replica that came back).
                running = self._requests.pop(msg.request_id, None)
                if running is not None and running.task is not None:
                    running.task.cancel()
            elif isinstance(msg, Ping):
                pass
            elif isinstance(msg, Shutdown):
                if self.opts.rejoin and not self._draining:
                    log.info("the head is leaving (%s); registering again", msg.reason)
                    self._head_lost.set()
                else:
                    log.info("head asked us to shut down (%s)", msg.reason)
                    self._stopping.set()
            else:
                log.warning("unexpected %s on the input channel", type(msg).__name__)

    def _add(self, msg: AddRequest) -> None:
        if msg.request_id in self._requests:
            log.warning("duplicate request id %s ignored", msg.request_id)
            return
        assert self._engine is not None
        running = _Running(inputs=asyncio.Queue())
        request = EngineRequest(
            request_id=msg.request_id,
            prompt=msg.prompt,
            params=msg.params,
            inputs=_upstream(running.inputs, set(msg.upstream)),
        )
        replay: ReplayFilter | None = None
        seq = 0
        if msg.resume is not None:
            # A retry of a request a failed replica had started: continue its output.
            seq = msg.resume.seq
            self._outputs.start_at(msg.request_id, seq)
            if self._engine.supports_resume:
                request.resume_text = msg.resume.text
            else:
                replay = ReplayFilter(len(msg.resume.text), msg.resume.data_chunks)
        self._requests[msg.request_id] = running
        running.task = asyncio.create_task(self._run_request(request, seq, replay, running))

    async def _run_request(
        self, request: EngineRequest, seq: int, replay: ReplayFilter | None, running: _Running
    ) -> None:
        assert self._engine is not None
        modality = self._engine.stage.output_modality
        finished = False
        try:
            async for chunk in self._engine.generate(request):
                if replay is not None:
                    chunk.text, chunk.data = replay.apply(chunk.text, chunk.data)
                    if not (chunk.text or chunk.data or chunk.finished):
                        continue
                self._send(
                    OutputChunk(
                        request_id=request.request_id,
                        stage_id=self.opts.stage_id,
                        replica_id=self.replica_id,
                        epoch=self.epoch,
                        seq=seq,
                        modality=chunk.modality,
                        text=chunk.text,
                        data=chunk.data,
                        finished=chunk.finished,
                        finish_reason=chunk.finish_reason,
                        usage=chunk.usage,
                        meta=chunk.meta,
                    )
                )
                seq += 1
                if chunk.finished:
                    finished = True
                    break
            if not finished:
                self._send(self._final(request.request_id, seq, modality, None))
        except asyncio.CancelledError:
            # Aborted: no more output wanted. Unless a retry of the same request already
            # took its place here (and set where its numbering starts).
            current = self._requests.get(request.request_id)
            if current is None or current is running:
                self._outputs.forget(request.request_id)
        except Exception as exc:
            log.warning("request %s failed: %s", request.request_id, exc)
            final = self._final(request.request_id, seq, modality, str(exc) or repr(exc))
            if isinstance(exc, BadRequestError):
                final.error_kind, final.error_param = "bad_request", exc.param
            self._send(final)
        finally:
            if self._requests.get(request.request_id) is running:
                self._requests.pop(request.request_id, None)

    def _final(self, request_id: str, seq: int, modality: str, error: str | None) -> OutputChunk:
        return OutputChunk(
            request_id=request_id,
            stage_id=self.opts.stage_id,
            replica_id=self.replica_id,
            epoch=self.epoch,
            seq=seq,
            modality=modality,
            finished=True,
            finish_reason="error" if error else "stop",
            error=error,
        )

    def _send(self, chunk: OutputChunk) -> None:
        # Outputs of one loop tick leave together, merged where possible (see outputs).
        if not self._outputs:
            asyncio.get_running_loop().call_soon(self._flush)
        self._outputs.add(chunk)
        self._chunks_sent += 1

    def _flush(self) -> None:
        frames: list[bytes] = []
        for chunk in self._outputs.drain():
            frames.extend(codec.encode(chunk))
        if not frames:
            return
        try:
            self._out.send_multipart(frames, zmq.NOBLOCK)
        except zmq.Again:
            # 100k messages queued: the head stopped reading. Keep them rather than drop.
            self._out.send_multipart(frames)

    def _load_report(self) -> LoadReport:
        engine = self._engine
        return LoadReport(
            queue_length=engine.queue_length if engine else 0,
            in_flight=len(self._requests),
            progress=(engine.progress if engine else 0) + self._chunks_sent,
        )


async def _upstream(queue: asyncio.Queue[InputChunk], open_sources: set[int]):
    """Yield upstream chunks until every upstream stage has sent its last one."""
    while open_sources:
        chunk = await queue.get()
        if chunk.text or chunk.data:
            yield StageInput(chunk.source_stage, chunk.modality, chunk.text, chunk.data, chunk.meta)
        if chunk.finished:
            open_sources.discard(chunk.source_stage)


def _left(deadline: float) -> float:
    return max(0.001, deadline - time.monotonic())


def _tag_logs(stage_id: int, replica_id: int) -> None:
    """Prefix this process's log lines with its stage and replica (replacing an earlier
    prefix: a replica that rejoins may get another id)."""
    prefix = f"[stage {stage_id} replica {replica_id}] "
    for handler in logging.getLogger().handlers:
        fmt = (handler.formatter._fmt if handler.formatter else None) or "%(message)s"
        base = getattr(handler, "_omni_untagged_fmt", fmt)
        handler._omni_untagged_fmt = base  # type: ignore[attr-defined]
        handler.setFormatter(logging.Formatter(base.replace("%(message)s", prefix + "%(message)s")))
