"""How big a fleet one head serves (issue 24): N simulated replicas on the real wire protocol.

A real head (``omnistage serve echo-1stage`` with no replicas of its own: the stage's
``replicas`` overridden to 0) and ``--workers`` fleet processes that each drive N/W
simulated replicas from one asyncio loop. Each simulated replica does what a headless
``omnistage serve --headless`` replica does on the wire, with the project's own code:

- registration on the master (``replica.register.registration`` / ``wire_map``,
  ``codec.encode_register_request``), then HELLO and the head's ``HandshakeInit``;
- READY on its input DEALER (routing id ``stage.replica.epoch``), outputs on its own PUSH,
  heartbeats (``Heartbeat`` with the load report a replica sends) on its own DEALER at the
  interval the head gave it, reading the ``HeartbeatAck``s;
- requests answered by a ``replica.requests.RequestRunner`` per replica over an echo engine
  (``engines.build_engine``) shared by the replicas of a fleet process, so outputs are the
  bytes a real echo replica sends. No thread per replica: sockets are read with
  ``zmqio.Pump`` (one epoll registration each) and heartbeats are loop timers.

Left out, as not what a fleet at rest or in a storm does: the STARTING heartbeats while an
engine loads (echo loads at once), the peer socket (READY offers none, so inputs come
through the head), rejoining a lost head, and DRAINING / DOWN goodbyes. The fleet
processes run at ``--fleet-nice`` more than the benchmark, so the head wins the CPU.

Per fleet size (``--sizes``), with a fresh head each time:

1. idle head, no replicas: its CPU and RSS (the baseline for "per 100 replicas");
2. registration storm: every replica starts cold at once; time until the head's
   ``/v1/omni/stages`` shows all N UP (and 50% / 90%), and when each replica sent READY;
   the head's CPU by thread (loop / control plane / libzmq I/O), replicas seen in ERROR
   and the oldest heartbeat of a replica UP in the polls (a starved control plane), the
   fleet's lateness sending beats, and the host's TCP listen-queue overflows;
3. at rest (all UP, no requests) for ``--rest`` s: the head's CPU (% of one core, its
   threads and any children; by thread) and RSS, per 100 replicas, also above the idle
   head's; the fleet processes' own CPU;
4. req/s: ``bench_pipeline``'s closed-loop HTTP client (``--concurrency`` keep-alive
   connections) on ``/v1/chat/completions``, and how the requests spread over the replicas;
5. detection: ``--victims`` replicas stop heartbeating (no goodbye, sockets left open: a
   hung or partitioned host); time until the head marks them (state change times from
   ``recent_state_changes``) against ``--omni-heartbeat-timeout``;
6. crash: ``--victims`` other replicas close their sockets (a process that died); time until
   the head marks them, and the head's CPU in the seconds after.

Two joined heads (``--heads 2``; ``--heads 1,2``, the default, runs both per size): head A,
then head B started with ``--omni-join`` A's master, both with no replicas of their own;
once each lists the other UP, the same N replicas are given A only. Each learns B as a
headless replica does (``HandshakeInit.heads``, then every ``HeartbeatAck.heads``: see
``replica.runtime._learn_heads``) and serves it too, as ``replica.fleet.OtherHead`` does:
registration at B under the id A gave (``replica_id`` in the registration; an unanswered
or refused one tried again), its own handshake, data sockets, READY and heartbeats
(``Heartbeat.others`` from a shared ``Admission``), a ``RequestRunner`` per head over the
one engine. Measured at each head: the idle pair (their gossip), the storm from cold until
all N are UP at A and at B, CPU per 100 idle replicas and RSS at rest, req/s with the
client split over both (half the connections and requests on each, at once), and when
each head marks the silenced and the crashed victims (its own incarnation of each, from
its own last beat). The report sets one head and each of the two joined heads side by
side, per size.

    nice -n 10 python bench/bench_fleet.py [--sizes 100,1000,5000] [--workers 4] [--quick]
        [--heads 1,2] [--rest 20] [--requests 2000] [--concurrency 32] [--victims 5]
        [--json out.json]

Everything it starts (the head, the fleet processes) runs in its own process group, is
stopped however the run ends, and is killed with the benchmark (PR_SET_PDEATHSIG). It
exits 1 when any registration failed (the figures are then not the fleet's), or when a
run stopped early or its requests failed (its figures are partial). See README.md.
"""

import argparse
import asyncio
import contextlib
import ctypes
import http.client
import itertools
import json
import logging
import math
import os
import queue
import re
import resource
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import IO, Any

import common
import msgspec
import psutil
import zmq
from bench_pipeline import Target, load
from common import HOST, ServerProcess

from omnistage.config.schema import StageConfig
from omnistage.engines import build_engine
from omnistage.engines.base import Engine
from omnistage.net import connectable_url, split_tcp_url, tcp_url
from omnistage.protocol import codec
from omnistage.protocol.errors import ProtocolError
from omnistage.protocol.messages import (
    AddRequest,
    HandshakeInit,
    Heartbeat,
    HeartbeatAck,
    Hello,
    OutputChunk,
    Ready,
    ReplicaState,
    routing_id,
)
from omnistage.replica.options import ReplicaOptions
from omnistage.replica.other_heads import REGISTER_WAIT_S, RETRY_S, Admission
from omnistage.replica.register import registration, wire_map
from omnistage.replica.requests import RequestRunner
from omnistage.zmqio import NOBLOCK, Pump

PIPELINES = {
    # name: (stage ids, text every response ends with)
    "echo-1stage": ([0], b"[echo]"),
    "echo": ([0, 1, 2], b"[vocoder]"),
}
TARGET_STORM_S = 10.0  # 1000 replicas registered and UP within this
TARGET_STORM_N = 1000
TARGET_CPU_PER_100 = 1.0  # % of one core per 100 idle replicas
# A silent replica is marked on the head's first 0.1 s expiry tick past the heartbeat
# timeout (since its last heartbeat): allowed that tick and as much again for scheduling.
DETECT_SLACK_S = 0.25
IDLE_BUSY_PCT = 20.0  # an idle head above this share of a core is noted
PR_SET_PDEATHSIG = 1

log = logging.getLogger("bench_fleet")


def die_with_parent() -> None:
    """SIGKILL this process when the one that started it dies (Linux; else a no-op)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def raise_fd_limit() -> int:
    """Open files up to the hard limit (a replica holds ~3 connections, a socket 2 fds)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        want = hard if hard != resource.RLIM_INFINITY else 1 << 20
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


# ==========================================================================================
# The fleet process (this file with --fleet-worker SPEC): many replicas on one loop
# ==========================================================================================


async def ask(ctx: zmq.Context, url: str, frames: list[bytes], timeout: float) -> list[bytes]:
    """One request and its answer on a fresh DEALER, without blocking the loop (what
    ``replica.register.register`` / ``handshake`` do on a thread, for many at once)."""
    loop = asyncio.get_running_loop()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    fd = sock.getsockopt(zmq.FD)
    ready = loop.create_future()

    def check() -> None:
        if not ready.done() and sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            ready.set_result(None)

    try:
        sock.connect(url)
        sock.send_multipart(frames)
        loop.add_reader(fd, check)
        try:
            check()
            async with asyncio.timeout(timeout):
                await ready
        finally:
            loop.remove_reader(fd)
        return sock.recv_multipart(NOBLOCK)
    finally:
        sock.close(linger=0)


class HeadLink:
    """A simulated replica's session with one head: registration, handshake, READY,
    heartbeats, requests. The first head's link registers without an id (the head
    assigns it); a link to another head of the fleet registers under that id, as
    ``replica.fleet.OtherHead`` does."""

    def __init__(self, rep: "SimReplica", master: str, first: bool) -> None:
        self.rep = rep
        self.master = master  # tcp://HOST:PORT
        self.port = split_tcp_url(master)[1]
        self.first = first
        self.replica_id = -1
        self.epoch = 0
        self.runner: RequestRunner | None = None
        self.requests = 0  # AddRequests received
        self.ready_at: float | None = None  # monotonic, READY sent
        self.error = ""  # the last failed attempt's (other heads: tried again)
        self.attempts = 0
        self.beating = False
        self.closed = False
        self.seq = 0
        self.last_beat_wall = 0.0
        self.head_state = ""  # the state in the head's last ack
        self.heads: list[str] = []  # the fleet's heads in this head's last ack
        self._timer: asyncio.TimerHandle | None = None
        self._pump: Pump | None = None
        self._socks: list[zmq.Socket] = []

    async def join(self, timeout: float) -> HandshakeInit:
        """Register, handshake, say READY and start beating; returns the head's init."""
        rep, f = self.rep, self.rep.fleet
        self.attempts += 1
        host, port = split_tcp_url(self.master)
        opts = ReplicaOptions(stage_id=rep.stage_id, master_host=host, master_port=port)
        req = msgspec.structs.replace(registration(opts, HOST), replica_instance=rep.instance)
        if not self.first:  # the id the first head gave: the fleet's id for this replica
            req = msgspec.structs.replace(req, replica_id=rep.replica_id)
        answer = await ask(
            f.ctx, self.master, [codec.encode_register_request(wire_map(req))], timeout
        )
        reply = codec.decode_register_reply(answer[-1])
        if not self.first and reply.replica_id != rep.replica_id:
            raise ProtocolError(f"{self.master} gave id {reply.replica_id}, not {rep.replica_id}")
        self.replica_id, self.epoch = reply.replica_id, reply.epoch
        hello = Hello(rep.stage_id, reply.replica_id, reply.epoch, os.getpid(), f.hostname)
        frames = await ask(
            f.ctx,
            connectable_url(reply.handshake_address, host),
            codec.encode(hello),
            timeout,
        )
        init = codec.decode_frames(frames)
        if not isinstance(init, HandshakeInit) or init.error:
            raise ProtocolError(f"handshake refused: {getattr(init, 'error', init)}")
        engine = await f.engine(init.stage_config)
        if self.closed:
            raise ProtocolError("closed while joining")
        self.runner = RequestRunner(rep.stage_id, engine, self._on_shutdown)
        self.runner.admission = rep.admission
        rep.admission.runners.append(self.runner)
        self._open(host, init, engine)
        return init

    async def join_other(self) -> None:
        """Another head of the fleet: try until it takes the replica (``OtherHead._run``:
        an unanswered or refused attempt is tried again after ``RETRY_S``)."""
        while not self.closed:
            try:
                await self.join(REGISTER_WAIT_S)
                return
            except Exception as exc:
                self.error = common.describe(exc, REGISTER_WAIT_S)
                self._close_socks()
                await asyncio.sleep(RETRY_S)

    def _open(self, host: str, init: HandshakeInit, engine: Engine) -> None:
        """What ``replica.session.HeadSession.open`` does, minus the peer socket (inputs
        come through the head) and the heartbeat thread (a loop timer instead)."""
        f = self.rep.fleet
        stage_id = self.rep.stage_id
        inp = f.ctx.socket(zmq.DEALER)
        inp.setsockopt(zmq.ROUTING_ID, routing_id(stage_id, self.replica_id, self.epoch))
        inp.setsockopt(zmq.LINGER, 0)
        inp.setsockopt(zmq.RCVHWM, 100_000)
        out = f.ctx.socket(zmq.PUSH)
        out.setsockopt(zmq.LINGER, 0)
        out.setsockopt(zmq.SNDHWM, 100_000)
        beats = f.ctx.socket(zmq.DEALER)
        beats.setsockopt(zmq.LINGER, 0)
        beats.setsockopt(zmq.SNDHWM, 16)
        self._socks = [inp, out, beats]
        inp.connect(connectable_url(init.input_address, host))
        out.connect(connectable_url(init.output_address, host))
        beats.connect(connectable_url(init.coordinator_address, host))
        self.inp, self.out, self.beats = inp, out, beats
        assert self.runner is not None
        self.runner.bind(self.replica_id, self.epoch, self)
        ready = Ready(
            stage_id=stage_id,
            replica_id=self.replica_id,
            epoch=self.epoch,
            capacity=engine.capacity,
            engine=engine.name,
            pid=os.getpid(),
            address=HOST,
        )
        inp.send(codec.pack(ready))
        self.ready_at = time.monotonic()
        self._pump = Pump(f.loop, inp, self._on_frames)
        self.interval = init.heartbeat_interval_s
        self.beating = True
        self._due = f.loop.time()
        self._beat()

    # -- heartbeats ------------------------------------------------------------------------

    def _beat(self) -> None:
        if not self.beating:
            return
        f = self.rep.fleet
        now = f.loop.time()
        f.lags.append(now - self._due)
        while True:  # the acks since the last beat (HeartbeatThread reads them as they come)
            try:
                frames = self.beats.recv_multipart(NOBLOCK)
            except zmq.Again:
                break
            try:
                ack = codec.decode_signed(frames, None, HeartbeatAck)
            except ProtocolError:
                f.bad_acks += 1
                continue
            self.head_state = ack.state
            f.acks[ack.state] += 1
            if ack.heads != self.heads:  # as HeartbeatThread._read_ack calls on_heads
                self.heads = list(ack.heads)
                self.rep.learn("" if self.first else self.master, self.heads)
        runner = self.runner
        assert runner is not None
        self.seq += 1
        msg = Heartbeat(
            stage_id=self.rep.stage_id,
            replica_id=self.replica_id,
            epoch=self.epoch,
            status=ReplicaState.UP,
            queue_length=runner.engine.queue_length,
            in_flight=len(runner.requests),
            # The session's progress, per replica (the engine is shared here).
            progress=runner.chunks_sent + runner.pieces_taken,
            seq=self.seq,
            others=self.rep.admission.others(runner),
        )
        try:
            self.beats.send_multipart(codec.encode(msg), NOBLOCK)
            f.beats_sent += 1
        except zmq.Again:
            f.beats_dropped += 1
        self.last_beat_wall = time.time()
        self._due = max(self._due + self.interval, now)
        self._timer = f.loop.call_at(self._due, self._beat)

    def silence(self) -> None:
        self.beating = False
        if self._timer is not None:
            self._timer.cancel()

    def close(self) -> None:
        self.closed = True
        self.silence()
        if self._pump is not None:
            self._pump.close()
            self._pump = None
        if self.runner is not None:
            for running in self.runner.requests.values():
                if running.task is not None:
                    running.task.cancel()
        self._close_socks()

    def _close_socks(self) -> None:
        for sock in self._socks:
            sock.close(linger=0)
        self._socks = []

    # -- requests (RequestRunner's Outlet) ---------------------------------------------------

    def _on_frames(self, frames: list[bytes]) -> None:
        assert self.runner is not None
        for msg in codec.decode_batch_or_drop(frames, log, "from the head"):
            if isinstance(msg, AddRequest):
                self.requests += 1
            self.runner.handle(msg)

    def to_head(self, chunks: list[OutputChunk]) -> None:
        batch = b"".join([codec.pack(chunk) for chunk in chunks])
        try:
            self.out.send(batch, NOBLOCK)
        except zmq.Again:
            self.out.send(batch)

    def to_peer(self, address: str, chunks: list[OutputChunk]) -> None:
        self.rep.fleet.peer_drops += len(chunks)  # never named: READY offers no peer address

    def _on_shutdown(self, reason: str) -> None:
        self.beating = False  # the head is leaving; the benchmark is ending


class SimReplica:
    """One simulated replica: its first head's link and, in a fleet of heads, a link to
    each other head it learned of (``HandshakeInit.heads``, ``HeartbeatAck.heads``), as
    ``replica.runtime.ReplicaRuntime._learn_heads`` does, over one shared engine."""

    def __init__(self, fleet: "Fleet", stage_id: int) -> None:
        self.fleet = fleet
        self.stage_id = stage_id
        self.error = ""
        self.admission = Admission()
        # A replica process's own instance (``register.INSTANCE`` is one per process, and
        # this process plays many): a head sees a registration with the instance of a
        # replica it holds as that replica moving to a new id, and lets its old one go.
        self.instance = secrets.token_hex(8)
        first = HeadLink(self, tcp_url(fleet.host, fleet.port), first=True)
        self.links: list[HeadLink] = [first]
        self.first_head = ""  # the first head's own URL in its list of heads

    @property
    def first(self) -> HeadLink:
        return self.links[0]

    @property
    def replica_id(self) -> int:
        return self.first.replica_id

    @property
    def beating(self) -> bool:
        return self.first.beating

    @property
    def requests(self) -> int:
        return self.first.requests

    @property
    def ready_at(self) -> float | None:
        return self.first.ready_at

    @property
    def head_state(self) -> str:
        return self.first.head_state

    # -- joining ---------------------------------------------------------------------------

    async def join(self, delay: float) -> None:
        if delay > 0:
            await asyncio.sleep(delay)
        f = self.fleet
        try:
            init = await self.first.join(f.timeout)
        except Exception as exc:  # reported, counted; the others go on
            self.error = common.describe(exc, f.timeout)
            return
        if init.heads:
            self.learn("", init.heads)

    def learn(self, source: str, heads: list[str]) -> None:
        """A head (``source``: its URL; "" for the first head) named the fleet's heads,
        itself first: a link to each one not served yet (``_learn_heads``)."""
        if not heads or self.error:
            return
        if not source:
            self.first_head = heads[0]
        known = {link.master for link in self.links[1:]}
        for master in heads:
            if master in known or master == self.first_head:
                continue
            link = HeadLink(self, master, first=False)
            self.links.append(link)
            known.add(master)
            self.fleet.spawn(link.join_other())

    # -- victims ---------------------------------------------------------------------------

    def silence(self) -> dict[str, Any]:
        """Stop heartbeating (to every head), say nothing, keep the sockets: a hung or
        cut-off replica."""
        for link in self.links:
            link.silence()
        return self.victim()

    def crash(self) -> dict[str, Any]:
        """Close every socket at once, as the kernel does for a process that died."""
        victim = self.silence()
        victim["at_wall"] = time.time()
        self.close()
        return victim

    def victim(self) -> dict[str, Any]:
        first = self.first
        return {
            "stage_id": self.stage_id,
            "replica_id": first.replica_id,
            "epoch": first.epoch,
            "last_beat_wall": first.last_beat_wall,
            "at_wall": time.time(),
            # Per head (by its master port): that head's incarnation and last beat.
            "links": {
                str(link.port): {"epoch": link.epoch, "last_beat_wall": link.last_beat_wall}
                for link in self.links
                if link.ready_at is not None
            },
        }

    def close(self) -> None:
        for link in self.links:
            link.close()


class Fleet:
    """One fleet process: its replicas, one ZMQ context and one asyncio loop."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        self.host, self.port = spec["master_host"], spec["master_port"]
        self.timeout = float(spec["register_timeout_s"])
        self.hostname = socket.gethostname()
        self.ctx = zmq.Context(io_threads=1)
        # Each replica holds 3 sockets per head, 2 more while it registers; libzmq's
        # default is 1023.
        self.heads = int(spec.get("heads", 1))  # heads of the fleet each replica serves
        self.ctx.set(zmq.MAX_SOCKETS, (3 * self.heads + 2) * spec["count"] + 64)
        stages = spec["stage_ids"]
        first = spec["first"]
        self.replicas = [
            SimReplica(self, stages[(first + i) % len(stages)]) for i in range(spec["count"])
        ]
        self._engines: dict[int, asyncio.Future[Engine]] = {}
        self.lags: list[float] = []
        self.acks: Counter[str] = Counter()
        self.bad_acks = self.beats_sent = self.beats_dropped = self.peer_drops = 0
        self._tasks: set[asyncio.Task[None]] = set()

    def spawn(self, coro: Any) -> None:
        """A task of this fleet (a link to another head joining), kept until it ends."""
        task = self.loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def engine(self, stage_config: dict[str, Any]) -> Engine:
        """The echo engine of a stage, built (and started) once for this process."""
        sid = int(stage_config["stage_id"])
        if sid not in self._engines:
            self._engines[sid] = asyncio.ensure_future(self._build(stage_config))
        return await asyncio.shield(self._engines[sid])

    async def _build(self, stage_config: dict[str, Any]) -> Engine:
        engine = build_engine(StageConfig.model_validate(stage_config))
        await engine.start()
        return engine

    async def run(self) -> None:
        self.loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(limit=1 << 24)
        await self.loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        emit({"event": "hello", "pid": os.getpid(), "fd_limit": raise_fd_limit()})
        tasks: set[asyncio.Task[None]] = set()
        try:
            while line := await reader.readline():
                cmd = json.loads(line)
                if cmd["cmd"] == "stop":
                    emit({"id": cmd["id"]})
                    break
                task = asyncio.create_task(self._command(cmd))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
        finally:
            for task in [*tasks, *self._tasks]:
                task.cancel()
            for rep in self.replicas:
                rep.close()
            self.ctx.destroy(linger=0)

    async def _command(self, cmd: dict[str, Any]) -> None:
        name, reply = cmd["cmd"], {"id": cmd["id"]}
        try:
            if name == "start":
                reply.update(await self._start(cmd["at"], cmd["ramp_s"]))
            elif name == "stats":
                reply.update(self._stats())
            elif name in ("silence", "crash"):
                reply["victims"] = self._victims(name, cmd["count"])
            else:
                reply["error"] = f"unknown command {name!r}"
        except Exception as exc:
            reply["error"] = common.describe(exc)
        emit(reply)

    async def _start(self, at: float, ramp_s: float) -> dict[str, Any]:
        """Every replica registers, handshakes and says READY, from ``at`` (monotonic,
        the same clock in every process), spread over ``ramp_s``."""
        await asyncio.sleep(max(0.0, at - time.monotonic()))
        n = len(self.replicas)
        await asyncio.gather(*(r.join(ramp_s * i / n) for i, r in enumerate(self.replicas)))
        errors = Counter(r.error for r in self.replicas if r.error)
        out: dict[str, Any] = {
            "ready": [r.ready_at - at for r in self.replicas if r.ready_at is not None],
            "failed": sum(errors.values()),
            "errors": errors.most_common(3),
        }
        if self.heads > 1:
            out.update(await self._other_heads(at))
        return out

    async def _other_heads(self, at: float) -> dict[str, Any]:
        """Wait (up to the registration timeout from ``at``) until every replica that
        joined its first head is READY at each other head it learned of too."""
        joined = [r for r in self.replicas if not r.error]

        def done(r: SimReplica) -> bool:
            return len(r.links) >= self.heads and all(x.ready_at for x in r.links)

        while any(not done(r) for r in joined) and time.monotonic() < at + self.timeout:
            await asyncio.sleep(0.05)
        others = [x for r in joined for x in r.links[1:]]
        errors = Counter(x.error for x in others if x.error)
        return {
            "ready_other": [x.ready_at - at for x in others if x.ready_at is not None],
            # Replicas not READY at every head in time (learned of too few, or not taken).
            "failed_other": sum(1 for r in joined if not done(r)),
            "retried_other": sum(max(0, x.attempts - 1) for x in others),
            "errors_other": errors.most_common(3),
        }

    def _stats(self) -> dict[str, Any]:
        lags, self.lags = sorted(self.lags), []
        out = {
            "requests": [r.requests for r in self.replicas],
            # Requests from the fleet's other heads, per replica (0 with one head).
            "requests_other": [sum(x.requests for x in r.links[1:]) for r in self.replicas],
            "beats_sent": self.beats_sent,
            "beats_dropped": self.beats_dropped,
            "acks": dict(self.acks),
            "bad_acks": self.bad_acks,
            "peer_drops": self.peer_drops,
            "beat_lag_max_s": lags[-1] if lags else 0.0,
            "beat_lag_p99_s": common.pct(lags, 99) if lags else 0.0,
            "head_states": dict(Counter(r.head_state for r in self.replicas if r.beating)),
        }
        self.acks.clear()
        return out

    def _victims(self, how: str, count: int) -> list[dict[str, Any]]:
        """Silenced ones from the front of the list, crashed ones from the back."""
        live = [r for r in self.replicas if r.beating]
        picked = live[:count] if how == "silence" else live[::-1][:count]
        return [r.silence() if how == "silence" else r.crash() for r in picked]


def emit(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def fleet_worker(spec_json: str) -> int:
    die_with_parent()
    spec = json.loads(spec_json)
    with contextlib.suppress(OSError):
        os.nice(spec["nice"])
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(message)s")
    asyncio.run(Fleet(spec).run())
    return 0


# ==========================================================================================
# The benchmark process: the head, the fleet processes, the measurements
# ==========================================================================================


class Worker:
    """A fleet process, spoken to by JSON lines on its stdin / stdout."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        self.log: IO[bytes] = tempfile.TemporaryFile()  # noqa: SIM115 (closed in stop)
        cmd = [sys.executable, os.path.abspath(__file__), "--fleet-worker", json.dumps(spec)]
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            start_new_session=True,
        )
        self.ps = psutil.Process(self.proc.pid)
        self._lines: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._early: dict[int, dict[str, Any]] = {}
        self._next_id = 0
        threading.Thread(target=self._read, daemon=True).start()

    def wait_hello(self, timeout: float = 60.0) -> None:
        self._get(None, timeout)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with contextlib.suppress(ValueError):
                self._lines.put(json.loads(line))
        self._lines.put(None)

    def send(self, cmd: str, **kw: Any) -> int:
        self._next_id += 1
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps({"cmd": cmd, "id": self._next_id, **kw}) + "\n").encode())
        self.proc.stdin.flush()
        return self._next_id

    def wait(self, ident: int, timeout: float) -> dict[str, Any]:
        return self._get(ident, timeout)

    def call(self, cmd: str, timeout: float = 60.0, **kw: Any) -> dict[str, Any]:
        return self.wait(self.send(cmd, **kw), timeout)

    def _get(self, ident: int | None, timeout: float) -> dict[str, Any]:
        if ident in self._early:
            return self._early.pop(ident)
        deadline = time.monotonic() + timeout
        while True:
            try:
                msg = self._lines.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"fleet worker {self.spec['index']}: no answer") from None
            if msg is None:
                raise RuntimeError(f"fleet worker {self.spec['index']} exited: {self.log_tail()}")
            if msg.get("id") == ident or (ident is None and msg.get("event") == "hello"):
                if "error" in msg:
                    raise RuntimeError(f"fleet worker {self.spec['index']}: {msg['error']}")
                return msg
            self._early[msg.get("id", -1)] = msg

    def cpu_s(self) -> float:
        try:
            t = self.ps.cpu_times()
            return t.user + t.system
        except psutil.Error:
            return 0.0

    def log_tail(self, n: int = 1500) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")[-n:].strip()

    def stop(self) -> None:
        if self.log.closed:
            return
        with contextlib.suppress(Exception):
            if self.proc.poll() is None:
                self.call("stop", timeout=10.0)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10.0)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5.0)
        self.log.close()


class Head:
    """The head under test, its CPU (all threads, and children if any) and RSS."""

    def __init__(
        self,
        args: argparse.Namespace,
        stage_ids: list[int],
        join: "Head | None" = None,
        name: str = "head",
    ) -> None:
        """``join``: a head whose fleet this one joins (``--omni-join``)."""
        self.name = name
        self.port, self.master_port = distinct_free_ports(2)
        self.master_url = tcp_url(HOST, self.master_port)
        overrides = json.dumps({str(s): {"replicas": 0} for s in stage_ids})
        cmd = [sys.executable, os.path.abspath(__file__), "--exec-with-pdeathsig"]
        cmd += [sys.executable, "-m", "omnistage", "serve", args.pipeline]
        cmd += ["--host", HOST, "--port", str(self.port)]
        cmd += ["-oma", HOST, "-omp", str(self.master_port)]
        cmd += ["--stage-overrides", overrides, "--init-timeout", "36000"]
        cmd += ["--omni-heartbeat-timeout", f"{args.heartbeat_timeout:g}"]
        cmd += ["--log-level", args.head_log_level]
        if join is not None:
            cmd += ["--omni-join", f"{HOST}:{join.master_port}"]
        self.server = ServerProcess(name, cmd, self.port)
        self.ps = psutil.Process(self.server.pid)

    def wait_http(self, timeout: float) -> None:
        self.server.wait_ready(timeout, path="/v1/omni/stages")

    def cpu_s(self) -> float:
        total = 0.0
        with contextlib.suppress(psutil.Error):
            for p in [self.ps, *self.ps.children(recursive=True)]:
                with contextlib.suppress(psutil.Error):
                    t = p.cpu_times()
                    total += t.user + t.system
        return total

    def threads_s(self) -> dict[str, float]:
        """The head process's CPU seconds by thread: ``loop`` (the main thread: asyncio,
        HTTP, the orchestrator), ``zmq`` (libzmq's I/O threads), ``control`` (the rest: the
        control-plane thread, which handles registrations, HELLOs and heartbeats)."""
        out = dict.fromkeys(("loop", "control", "zmq"), 0.0)
        tick = os.sysconf("SC_CLK_TCK")
        pid = self.server.pid
        with contextlib.suppress(OSError):
            for tid in os.listdir(f"/proc/{pid}/task"):
                try:
                    with open(f"/proc/{pid}/task/{tid}/stat", "rb") as f:
                        fields = f.read().rsplit(b")", 1)[1].split()
                    with open(f"/proc/{pid}/task/{tid}/comm", "rb") as f:
                        comm = f.read()
                except OSError:
                    continue  # the thread ended
                cpu = (int(fields[11]) + int(fields[12])) / tick  # utime, stime
                group = (
                    "loop" if int(tid) == pid else "zmq" if comm.startswith(b"ZMQ") else "control"
                )
                out[group] += cpu
        return out

    def rss_mib(self) -> float:
        total = 0
        with contextlib.suppress(psutil.Error):
            for p in [self.ps, *self.ps.children(recursive=True)]:
                with contextlib.suppress(psutil.Error):
                    total += p.memory_info().rss
        return total / 2**20

    def stages(self, timeout: float = 60.0) -> tuple[dict[str, Any], float]:
        """``GET /v1/omni/stages`` and the seconds it took."""
        t0 = time.monotonic()
        conn = http.client.HTTPConnection(HOST, self.port, timeout=timeout)
        try:
            conn.request("GET", "/v1/omni/stages")
            resp = conn.getresponse()
            body = resp.read()
        finally:
            conn.close()
        if resp.status != 200:
            raise RuntimeError(f"/v1/omni/stages: HTTP {resp.status}")
        return json.loads(body), time.monotonic() - t0

    def problems(self) -> list[str]:
        """The head log's WARNING / ERROR lines, counted by message (numbers blanked)."""
        seen: Counter[str] = Counter()
        for line in self.server.log_text().splitlines():
            if " WARNING " in line or " ERROR " in line:
                text = line.split(" ", 2)[-1]
                seen[re.sub(r"\d+", "#", text)[:160]] += 1
        return [f"{n}x {text}" for text, n in seen.most_common(5)]

    def stop(self) -> None:
        self.server.stop()


def note_busy_idle(notes: list[str], name: str, cpu_pct: float | None) -> None:
    """A head with no replica and no request should sleep: say so when it does not
    (every other figure of that head is then measured against a busy baseline)."""
    if cpu_pct is not None and cpu_pct > IDLE_BUSY_PCT:
        notes.append(f"{name} idle with no replica: {cpu_pct:.0f}% of a core (a busy thread?)")
        print(f"! {notes[-1]}", flush=True)


def distinct_free_ports(count: int) -> list[int]:
    """``count`` free ports, all different: ``free_port`` twice may hand out the same one,
    and a master on the HTTP port answers HTTP clients with silence."""
    socks = [socket.socket() for _ in range(count)]
    try:
        for s in socks:
            s.bind((HOST, 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def replica_states(status: dict[str, Any]) -> dict[tuple[int, int, int], str]:
    return {
        (s["stage_id"], r["replica_id"], r["epoch"]): r["state"]
        for s in status["stages"]
        for r in s["replicas"]
    }


def heartbeat_age_max(status: dict[str, Any]) -> float:
    """The longest the head has gone without a heartbeat from a replica it has UP."""
    ages = [
        r["last_heartbeat_age_s"]
        for s in status["stages"]
        for r in s["replicas"]
        if r["state"] == ReplicaState.UP
    ]
    return max(ages, default=0.0)


# -- per size -----------------------------------------------------------------------------


@dataclass
class SizeResult:
    n: int
    workers: int
    notes: list[str] = field(default_factory=list)
    partial: bool = False  # stopped early, or its requests failed: figures missing
    phases: dict[str, float] = field(default_factory=dict)  # wall time each phase began
    # idle head, no replica
    idle_cpu_pct: float | None = None
    idle_rss_mib: float | None = None
    # registration storm
    storm_all_up_s: float | None = None  # head view: all N UP at once (None: not in time)
    storm_up_at_end: int = 0
    # Head view: the first poll with 50% / 90% / all of the replicas past STARTING.
    storm_t50_s: float | None = None
    storm_t90_s: float | None = None
    storm_all_ready_s: float | None = None
    storm_poll_every_s: float | None = None  # median time between those polls
    storm_ready_p50_s: float | None = None  # replica side: READY sent
    storm_ready_p90_s: float | None = None
    storm_ready_max_s: float | None = None
    storm_failed: int = 0
    storm_head_cpu_s: float | None = None
    storm_fleet_cpu_s: float | None = None
    storm_threads_s: dict[str, float] = field(default_factory=dict)  # head CPU-s by thread
    storm_poll_max_ms: float | None = None
    storm_listen_overflows: int | None = None  # TcpExt ListenOverflows during the storm
    # The head's view in the polls: replicas in ERROR at once, and the oldest heartbeat
    # of a replica UP; and the fleet's own lateness in sending heartbeats.
    storm_error_seen: int = 0
    storm_hb_age_max_s: float = 0.0
    storm_beat_lag_max_ms: float | None = None
    # at rest
    rest_s: float = 0.0
    rest_cpu_pct: float | None = None
    rest_cpu_pct_per_100: float | None = None
    rest_cpu_pct_per_100_above_idle: float | None = None
    rest_rss_mib: float | None = None
    rest_rss_mib_per_100: float | None = None  # above the idle head's
    rest_fleet_cpu_pct: float | None = None
    rest_not_up: int | None = None
    rest_beat_lag_max_ms: float | None = None
    rest_acks_not_up: int | None = None
    rest_hb_age_max_s: float | None = None
    rest_threads_pct: dict[str, float] = field(default_factory=dict)  # head CPU % by thread
    stages_poll_ms: float | None = None  # one /v1/omni/stages at rest
    # req/s
    rps: float | None = None
    p50_ms: float | None = None
    p99_ms: float | None = None
    req_head_cpu_pct: float | None = None
    req_fleet_cpu_pct: float | None = None
    req_threads_pct: dict[str, float] = field(default_factory=dict)
    req_total: int = 0
    served_replicas: int | None = None
    served_expected: float | None = None
    served_max: int | None = None
    # detection of a silent replica
    silent_timeout_s: float = 0.0
    silent_detect_s: list[float] = field(default_factory=list)  # from its last heartbeat
    silent_detect_from_stop_s: list[float] = field(default_factory=list)
    silent_missed: int = 0
    # detection of a crashed replica (sockets closed)
    crash_detect_s: list[float] = field(default_factory=list)
    crash_missed: int = 0
    crash_head_cpu_s: float | None = None  # head CPU in the 3 s after the crash


def run_size(n: int, args: argparse.Namespace) -> SizeResult:
    stage_ids, expect = PIPELINES[args.pipeline]
    w = max(1, min(args.workers, n))
    res = SizeResult(n, w, silent_timeout_s=args.heartbeat_timeout)
    head: Head | None = None
    workers: list[Worker] = []
    try:
        for attempt in (1, 2):
            head = Head(args, stage_ids)
            try:
                head.wait_http(args.health_timeout)
                break
            except RuntimeError as exc:
                # Seen once in many runs on a shared host: a head that never answered
                # HTTP on its (free_port) port. A fresh head on fresh ports, once.
                why = str(exc).splitlines()[0]
                res.notes.append(f"head {attempt} not ready ({why}); started another")
                print(f"! N={n}: {res.notes[-1]}", flush=True)
                head.stop()
                if attempt == 2:
                    raise
        # 1. the head alone
        time.sleep(1.0)
        c0, t0 = head.cpu_s(), time.monotonic()
        time.sleep(args.idle)
        res.idle_cpu_pct = (head.cpu_s() - c0) / (time.monotonic() - t0) * 100
        res.idle_rss_mib = head.rss_mib()
        note_busy_idle(res.notes, "head", res.idle_cpu_pct)
        # the fleet processes
        per, first = [n // w + (i < n % w) for i in range(w)], 0
        for i, count in enumerate(per):
            spec = {
                "index": i,
                "count": count,
                "first": first,
                "stage_ids": stage_ids,
                "master_host": HOST,
                "master_port": head.master_port,
                "register_timeout_s": args.storm_timeout,
                "nice": args.fleet_nice,
            }
            workers.append(Worker(spec))
            first += count
        for wk in workers:
            wk.wait_hello()
        res.phases["storm"] = time.time()
        storm(head, workers, n, res, args)
        res.phases["rest"] = time.time()
        rest(head, workers, n, res, args)
        res.phases["requests"] = time.time()
        requests(head, workers, n, res, args, Target(args.pipeline, len(stage_ids), expect))
        res.phases["silence"] = time.time()
        detect(head, workers, res, args, "silence")
        res.phases["crash"] = time.time()
        detect(head, workers, res, args, "crash")
    except Exception as exc:
        why = common.describe(exc)
        res.notes.append(f"stopped early: {why.splitlines()[0]}")
        res.partial = True
        print(f"! N={n}: stopped early: {why}", flush=True)
    finally:
        if head is not None and not head.server.log.closed:
            res.notes += [f"head log: {p}" for p in head.problems()]
            if args.keep_logs:
                keep_logs(args.keep_logs, n, head, workers, res)
            # The head first: a fleet that leaves first is N disconnects to it.
            head.stop()
        for wk in workers:
            wk.stop()
    return res


def keep_logs(folder: str, n: int, head: Head, workers: list[Worker], res: SizeResult) -> None:
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, f"head-{n}.log"), "w") as f:
        f.write(head.server.log_text())
    for wk in workers:
        with open(os.path.join(folder, f"fleet-{n}-{wk.spec['index']}.log"), "w") as f:
            f.write(wk.log_tail(1 << 30))
    with open(os.path.join(folder, f"phases-{n}.json"), "w") as f:
        json.dump(res.phases, f)


def listen_overflows() -> int | None:
    """TcpExt ListenOverflows (this host, all sockets): connections the kernel dropped
    because a listening socket's accept queue was full; None where unreadable."""
    try:
        with open("/proc/net/netstat") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for names, values in zip(lines[::2], lines[1::2], strict=False):
        if names.startswith("TcpExt:"):
            row = dict(zip(names.split(), values.split(), strict=True))
            return int(row.get("ListenOverflows", 0))
    return None


def storm(head: Head, workers: list[Worker], n: int, res: SizeResult, args: argparse.Namespace):
    at = time.monotonic() + 0.5
    c0, f0 = head.cpu_s(), sum(wk.cpu_s() for wk in workers)
    th0 = head.threads_s()
    overflows = listen_overflows()
    ids = [wk.send("start", at=at, ramp_s=args.ramp) for wk in workers]
    # When each count of replicas past STARTING (READY reached the head: UP, or ERROR
    # since) was first seen; "all UP" needs every one of them UP in the same poll.
    ready_at: list[float] = []
    poll_ms: list[float] = []
    polled: list[float] = []
    deadline = at + args.storm_timeout
    up = past = 0
    time.sleep(max(0.0, at - time.monotonic()))
    while time.monotonic() < deadline:
        status, took = head.stages()
        seen = time.monotonic() - at
        poll_ms.append(took * 1e3)
        polled.append(seen)
        states = Counter(replica_states(status).values())
        up = states[ReplicaState.UP]
        now_past = sum(states.values()) - states[ReplicaState.STARTING]
        ready_at += [seen] * max(0, now_past - past)
        past = max(past, now_past)
        res.storm_error_seen = max(res.storm_error_seen, states[ReplicaState.ERROR])
        res.storm_hb_age_max_s = max(res.storm_hb_age_max_s, heartbeat_age_max(status))
        if up >= n:
            res.storm_all_up_s = seen
            break
        # A poll of 5000 replicas costs the head ~0.1 s: at most ~10% of its time.
        time.sleep(max(args.poll_interval, 9 * took))
    res.storm_head_cpu_s = head.cpu_s() - c0
    res.storm_fleet_cpu_s = sum(wk.cpu_s() for wk in workers) - f0
    res.storm_threads_s = {k: v - th0[k] for k, v in head.threads_s().items()}
    after = listen_overflows()
    if overflows is not None and after is not None:
        res.storm_listen_overflows = after - overflows
    res.storm_up_at_end = up
    res.storm_poll_max_ms = max(poll_ms) if poll_ms else None
    gaps = sorted(b - a for a, b in itertools.pairwise(polled))
    res.storm_poll_every_s = common.pct(gaps, 50) if gaps else None

    def when(share: float) -> float | None:
        k = math.ceil(n * share)
        return ready_at[k - 1] if len(ready_at) >= k else None

    res.storm_t50_s, res.storm_t90_s, res.storm_all_ready_s = when(0.5), when(0.9), when(1.0)
    ready: list[float] = []
    for wk, ident in zip(workers, ids, strict=True):
        answer = wk.wait(ident, args.storm_timeout + 30)
        ready += answer["ready"]
        res.storm_failed += answer["failed"]
        for text, count in answer["errors"]:
            res.notes.append(f"registration: {count}x {text}")
    lags = [wk.call("stats")["beat_lag_max_s"] for wk in workers]
    res.storm_beat_lag_max_ms = max(lags) * 1e3
    ready.sort()
    if ready:
        res.storm_ready_p50_s = common.pct(ready, 50)
        res.storm_ready_p90_s = common.pct(ready, 90)
        res.storm_ready_max_s = ready[-1]
    if res.storm_all_up_s is None:
        res.notes.append(f"storm: {up} of {n} UP after {args.storm_timeout:g}s")
    print(
        f"  N={n}: storm all UP {fmt(res.storm_all_up_s, 's')} (replicas READY p50 "
        f"{fmt(res.storm_ready_p50_s, 's')}, max {fmt(res.storm_ready_max_s, 's')}), "
        f"{res.storm_failed} failed, head {res.storm_head_cpu_s:.1f} CPU-s",
        flush=True,
    )


def rest(head: Head, workers: list[Worker], n: int, res: SizeResult, args: argparse.Namespace):
    time.sleep(args.settle)
    for wk in workers:
        wk.call("stats")  # resets the beat lag and ack counts
    h0, f0, t0 = head.cpu_s(), sum(wk.cpu_s() for wk in workers), time.monotonic()
    th0 = head.threads_s()
    time.sleep(args.rest)
    wall = time.monotonic() - t0
    res.rest_threads_pct = {k: (v - th0[k]) / wall * 100 for k, v in head.threads_s().items()}
    h1, f1 = head.cpu_s(), sum(wk.cpu_s() for wk in workers)
    res.rest_s = wall
    res.rest_cpu_pct = (h1 - h0) / wall * 100
    res.rest_cpu_pct_per_100 = res.rest_cpu_pct / (n / 100)
    if res.idle_cpu_pct is not None:
        res.rest_cpu_pct_per_100_above_idle = (res.rest_cpu_pct - res.idle_cpu_pct) / (n / 100)
    res.rest_rss_mib = head.rss_mib()
    if res.idle_rss_mib is not None:
        res.rest_rss_mib_per_100 = (res.rest_rss_mib - res.idle_rss_mib) / (n / 100)
    res.rest_fleet_cpu_pct = (f1 - f0) / wall * 100
    stats = [wk.call("stats") for wk in workers]
    res.rest_beat_lag_max_ms = max(s["beat_lag_max_s"] for s in stats) * 1e3
    res.rest_acks_not_up = sum(v for s in stats for k, v in s["acks"].items() if k != "UP")
    status, took = head.stages()
    res.stages_poll_ms = took * 1e3
    res.rest_hb_age_max_s = heartbeat_age_max(status)
    res.rest_not_up = sum(1 for s in replica_states(status).values() if s != ReplicaState.UP)
    print(
        f"  N={n}: at rest head {res.rest_cpu_pct:.1f}% of a core "
        f"({res.rest_cpu_pct_per_100:.2f}% per 100), RSS {res.rest_rss_mib:.0f} MiB, "
        f"fleet {res.rest_fleet_cpu_pct:.0f}%, not UP {res.rest_not_up}",
        flush=True,
    )


def requests(
    head: Head,
    workers: list[Worker],
    n: int,
    res: SizeResult,
    args: argparse.Namespace,
    target: Target,
) -> None:
    if args.requests <= 0:
        return
    before = [wk.call("stats")["requests"] for wk in workers]
    h0, f0, t0 = head.cpu_s(), sum(wk.cpu_s() for wk in workers), time.monotonic()
    th0 = head.threads_s()
    try:
        r = asyncio.run(
            load(
                target,
                head.port,
                args.concurrency,
                args.requests,
                args.warmup,
                args.request_timeout,
            )
        )
    except Exception as exc:
        res.notes.append(f"requests: {common.describe(exc, args.request_timeout)}")
        res.partial = True
        return
    wall = time.monotonic() - t0
    res.req_head_cpu_pct = (head.cpu_s() - h0) / wall * 100
    res.req_threads_pct = {k: (v - th0[k]) / wall * 100 for k, v in head.threads_s().items()}
    res.req_fleet_cpu_pct = (sum(wk.cpu_s() for wk in workers) - f0) / wall * 100
    res.rps, res.p50_ms, res.p99_ms = r.rps, r.p50_ms, r.p99_ms
    after = [wk.call("stats")["requests"] for wk in workers]
    counts = [
        a - b for aa, bb in zip(after, before, strict=True) for a, b in zip(aa, bb, strict=True)
    ]
    stages = len(PIPELINES[args.pipeline][0])
    res.req_total = args.requests + args.warmup
    res.served_replicas = sum(1 for c in counts if c)
    res.served_max = max(counts) if counts else 0
    # Uniform random choice: each stage's N/stages replicas share every request.
    per_stage = n / stages
    res.served_expected = n * (1 - (1 - 1 / per_stage) ** res.req_total)
    print(
        f"  N={n}: {res.rps:.0f} req/s (p50 {res.p50_ms:.1f} ms), served by "
        f"{res.served_replicas} replicas (uniform random: {res.served_expected:.0f})",
        flush=True,
    )


def detect(
    head: Head, workers: list[Worker], res: SizeResult, args: argparse.Namespace, how: str
) -> None:
    """Silence (or crash) ``--victims`` replicas; when does the head mark each one?"""
    k = args.victims
    if k <= 0:
        return
    c0 = head.cpu_s()
    shares = [k // len(workers) + (i < k % len(workers)) for i in range(len(workers))]
    victims: list[dict[str, Any]] = []
    for wk, share in zip(workers, shares, strict=True):
        if share:
            victims += wk.call(how, count=share)["victims"]
    keys = {(v["stage_id"], v["replica_id"], v["epoch"]): v for v in victims}
    marked: dict[tuple[int, int, int], float] = {}  # wall time of the head's change
    deadline = time.monotonic() + 3 * args.heartbeat_timeout + 10
    crash_cpu: float | None = None
    crashed_at = time.monotonic()
    while time.monotonic() < deadline and len(marked) < len(keys):
        time.sleep(0.25 if how == "silence" else 0.05)
        if how == "crash" and crash_cpu is None and time.monotonic() - crashed_at >= 3.0:
            crash_cpu = head.cpu_s() - c0
        status, _ = head.stages()
        polled = time.time()
        for change in status["recent_state_changes"]:
            key = (change["stage_id"], change["replica_id"], change["epoch"])
            if key in keys and change["old"] == "UP" and key not in marked:
                marked[key] = change["time"]
        for key, state in replica_states(status).items():
            if key in keys and state != ReplicaState.UP and key not in marked:
                marked[key] = polled  # the change left the ring: the poll's time bounds it
    if how == "crash":
        left = 3.0 - (time.monotonic() - crashed_at)
        if crash_cpu is None:
            time.sleep(max(0.0, left))
            crash_cpu = head.cpu_s() - c0
        res.crash_head_cpu_s = crash_cpu
        res.crash_detect_s = sorted(marked[k] - keys[k]["at_wall"] for k in marked)
        res.crash_missed = len(keys) - len(marked)
    else:
        res.silent_detect_s = sorted(marked[k] - keys[k]["last_beat_wall"] for k in marked)
        res.silent_detect_from_stop_s = sorted(marked[k] - keys[k]["at_wall"] for k in marked)
        res.silent_missed = len(keys) - len(marked)
    shown = res.crash_detect_s if how == "crash" else res.silent_detect_s
    print(
        f"  N={res.n}: {how} of {len(keys)}: marked {len(marked)}, after "
        f"{', '.join(f'{x:.2f}' for x in shown)} s",
        flush=True,
    )


# -- report ---------------------------------------------------------------------------------


def fmt(x: float | None, unit: str = "", digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}{unit}"


def by_thread(values: dict[str, float], digits: int) -> str:
    if not values:
        return "-"
    return "/".join(f"{values[k]:.{digits}f}" for k in ("loop", "control", "zmq"))


def span(xs: list[float], missed: int, digits: int = 2) -> str:
    if not xs:
        return "-" if not missed else f"{missed} missed"
    text = f"{xs[0]:.{digits}f}" if len(xs) == 1 else f"{xs[0]:.{digits}f}..{xs[-1]:.{digits}f}"
    return text + (f" ({missed} missed)" if missed else "")


def report(
    results: list[SizeResult], joined: list["JoinedResult"], args: argparse.Namespace
) -> list[dict[str, Any]]:
    if results:
        report_one(results, args)
    if joined:
        report_joined({r.n: r for r in results}, joined, args)
    goals = one_goals(results, args) + joined_goals(joined, args)
    print("\ntargets:")
    for goal, value, met in goals:
        shown = "n/a" if value is None else f"{value:.2f}"
        print(f"  {goal:<62} {shown:>8}  {'PASS' if met else 'MISS'}")
    return [{"goal": g, "value": v, "met": m} for g, v, m in goals]


def report_one(results: list[SizeResult], args: argparse.Namespace) -> None:
    rows: list[tuple[str, list[str]]] = [
        ("fleet processes", [str(r.workers) for r in results]),
        ("idle head (no replica): CPU %", [fmt(r.idle_cpu_pct, digits=2) for r in results]),
        ("idle head: RSS MiB", [fmt(r.idle_rss_mib, digits=0) for r in results]),
        ("storm: all UP at once s (head)", [fmt(r.storm_all_up_s, digits=2) for r in results]),
        (
            "storm: 50%/90%/all READY s (head)",
            [
                f"{fmt(r.storm_t50_s)}/{fmt(r.storm_t90_s)}/{fmt(r.storm_all_ready_s)}"
                for r in results
            ],
        ),
        ("storm: polled every s", [fmt(r.storm_poll_every_s, digits=2) for r in results]),
        (
            "storm: READY sent p50/p90/max s",
            [
                f"{fmt(r.storm_ready_p50_s)}/{fmt(r.storm_ready_p90_s)}/{fmt(r.storm_ready_max_s)}"
                for r in results
            ],
        ),
        ("storm: failed registrations", [str(r.storm_failed) for r in results]),
        ("storm: head CPU-s", [fmt(r.storm_head_cpu_s) for r in results]),
        ("storm: head loop/control/zmq CPU-s", [by_thread(r.storm_threads_s, 1) for r in results]),
        ("storm: fleet CPU-s", [fmt(r.storm_fleet_cpu_s) for r in results]),
        ("storm: most in ERROR at once", [str(r.storm_error_seen) for r in results]),
        ("storm: oldest beat of an UP s", [fmt(r.storm_hb_age_max_s, digits=2) for r in results]),
        (
            "storm: max beat lag ms (fleet)",
            [fmt(r.storm_beat_lag_max_ms, digits=0) for r in results],
        ),
        (
            "storm: listen queue overflows",
            [
                str(r.storm_listen_overflows) if r.storm_listen_overflows is not None else "-"
                for r in results
            ],
        ),
        ("rest: head CPU % of a core", [fmt(r.rest_cpu_pct, digits=2) for r in results]),
        (
            "rest: head CPU % per 100 repl.",
            [fmt(r.rest_cpu_pct_per_100, digits=2) for r in results],
        ),
        (
            "rest: ... per 100 above idle",
            [fmt(r.rest_cpu_pct_per_100_above_idle, digits=2) for r in results],
        ),
        ("rest: head loop/control/zmq %", [by_thread(r.rest_threads_pct, 1) for r in results]),
        ("rest: head RSS MiB", [fmt(r.rest_rss_mib, digits=0) for r in results]),
        (
            "rest: RSS MiB per 100 (> idle)",
            [fmt(r.rest_rss_mib_per_100, digits=2) for r in results],
        ),
        ("rest: fleet CPU % (all procs)", [fmt(r.rest_fleet_cpu_pct, digits=0) for r in results]),
        ("rest: max beat lag ms (fleet)", [fmt(r.rest_beat_lag_max_ms, digits=0) for r in results]),
        ("rest: oldest beat of an UP s", [fmt(r.rest_hb_age_max_s, digits=2) for r in results]),
        (
            "rest: not UP after / non-UP acks",
            [f"{r.rest_not_up} / {r.rest_acks_not_up}" for r in results],
        ),
        ("GET /v1/omni/stages ms", [fmt(r.stages_poll_ms, digits=0) for r in results]),
        (f"req/s (c={args.concurrency})", [fmt(r.rps, digits=0) for r in results]),
        ("p50 / p99 ms", [f"{fmt(r.p50_ms)} / {fmt(r.p99_ms)}" for r in results]),
        (
            "req: head CPU % / fleet CPU %",
            [
                f"{fmt(r.req_head_cpu_pct, digits=0)} / {fmt(r.req_fleet_cpu_pct, digits=0)}"
                for r in results
            ],
        ),
        ("req: head loop/control/zmq %", [by_thread(r.req_threads_pct, 0) for r in results]),
        (
            "req: replicas served (random)",
            [
                "-"
                if r.served_replicas is None
                else f"{r.served_replicas} ({r.served_expected:.0f})"
                for r in results
            ],
        ),
        (
            "req: most on one replica",
            [str(r.served_max) if r.served_max is not None else "-" for r in results],
        ),
        (
            "silent: marked after last beat s",
            [span(r.silent_detect_s, r.silent_missed) for r in results],
        ),
        ("silent: after it went silent s", [span(r.silent_detect_from_stop_s, 0) for r in results]),
        ("crash: marked after s", [span(r.crash_detect_s, r.crash_missed, 3) for r in results]),
        ("crash: head CPU-s in 3 s after", [fmt(r.crash_head_cpu_s, digits=2) for r in results]),
    ]
    width = max(len(name) for name, _ in rows) + 2
    cols = [max(12, *(len(v[i]) + 2 for _, v in rows)) for i in range(len(results))]
    print(f"\none head, {args.pipeline}, --omni-heartbeat-timeout {args.heartbeat_timeout:g}s:")
    print(
        f"{'N replicas':<{width}}"
        + "".join(f"{r.n:>{c}}" for r, c in zip(results, cols, strict=True))
    )
    for name, values in rows:
        print(f"{name:<{width}}" + "".join(f"{v:>{c}}" for v, c in zip(values, cols, strict=True)))
    for r in results:
        for note in r.notes:
            print(f"  N={r.n}: {note}")


def one_goals(results: list[SizeResult], args: argparse.Namespace) -> list[tuple[str, Any, bool]]:
    goals: list[tuple[str, Any, bool]] = []
    storm_n = [r for r in results if r.n == TARGET_STORM_N]
    if storm_n:
        t = storm_n[0].storm_all_up_s
        goals.append(
            (
                f"{TARGET_STORM_N} replicas UP < {TARGET_STORM_S:g} s",
                t,
                t is not None and t < TARGET_STORM_S,
            )
        )
    for r in results:
        # What the replicas cost: the head's own idle CPU (its timers) is not theirs.
        per = r.rest_cpu_pct_per_100_above_idle
        goals.append(
            (
                f"N={r.n}: head CPU per 100 idle replicas < {TARGET_CPU_PER_100:g}% of a core",
                per,
                per is not None and per < TARGET_CPU_PER_100,
            )
        )
    for r in results:
        # The head marks a replica once it has been silent for longer than the timeout,
        # on its 0.1 s expiry tick: "within the timeout" is at most DETECT_SLACK_S later.
        worst = r.silent_detect_s[-1] if r.silent_detect_s else None
        limit = args.heartbeat_timeout + DETECT_SLACK_S
        ok = worst is not None and not r.silent_missed and worst <= limit
        goals.append(
            (f"N={r.n}: silent replica marked <= {limit:g} s after its last beat", worst, ok)
        )
    return goals


# -- two joined heads (--omni-join) ----------------------------------------------------------


@dataclass
class HeadFigures:
    """One head's figures in a fleet of two joined heads."""

    name: str
    idle_cpu_pct: float | None = None  # joined, no replica yet
    idle_rss_mib: float | None = None
    storm_all_up_s: float | None = None  # this head: all N UP in one poll
    storm_up_at_end: int = 0
    storm_head_cpu_s: float | None = None
    storm_threads_s: dict[str, float] = field(default_factory=dict)
    storm_error_seen: int = 0
    storm_hb_age_max_s: float = 0.0
    storm_ready_p50_s: float | None = None  # replica side: READY sent to this head
    storm_ready_max_s: float | None = None
    rest_cpu_pct: float | None = None
    rest_cpu_pct_per_100: float | None = None
    rest_cpu_pct_per_100_above_idle: float | None = None
    rest_threads_pct: dict[str, float] = field(default_factory=dict)
    rest_rss_mib: float | None = None
    rest_rss_mib_per_100: float | None = None
    rest_not_up: int | None = None
    rest_hb_age_max_s: float | None = None
    stages_poll_ms: float | None = None
    rps: float | None = None  # its half of the client
    p50_ms: float | None = None
    p99_ms: float | None = None
    req_head_cpu_pct: float | None = None
    served_replicas: int | None = None
    silent_detect_s: list[float] = field(default_factory=list)  # from its last beat here
    silent_detect_from_stop_s: list[float] = field(default_factory=list)
    silent_missed: int = 0
    crash_detect_s: list[float] = field(default_factory=list)
    crash_missed: int = 0
    crash_head_cpu_s: float | None = None


@dataclass
class JoinedResult:
    """One fleet of N replicas serving two joined heads: A (the replicas' -oma/-omp)
    and B (started with --omni-join A), both with no replica of their own."""

    n: int
    workers: int
    heads: list[HeadFigures] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    partial: bool = False  # stopped early, or its requests failed: figures missing
    phases: dict[str, float] = field(default_factory=dict)
    join_s: float | None = None  # B's HTTP up -> each head lists the other UP
    storm_all_up_s: float | None = None  # all N UP at both heads
    storm_failed: int = 0  # registrations with A that failed
    storm_failed_other: int = 0  # replicas not READY at B in time
    storm_retried_other: int = 0  # registrations with B tried again
    storm_fleet_cpu_s: float | None = None
    storm_listen_overflows: int | None = None
    rest_fleet_cpu_pct: float | None = None
    rest_beat_lag_max_ms: float | None = None
    rest_acks_not_up: int | None = None
    rps: float | None = None  # both halves of the client together
    req_fleet_cpu_pct: float | None = None
    req_total: int = 0
    served_replicas: int | None = None  # by either head
    served_max: int | None = None  # most requests on one replica (both heads')


def run_joined(n: int, args: argparse.Namespace) -> JoinedResult:
    """Head A, then head B joined to it; N replicas given A learn B and serve both."""
    stage_ids, expect = PIPELINES[args.pipeline]
    w = max(1, min(args.workers, n))
    res = JoinedResult(n, w)
    heads: list[Head] = []
    workers: list[Worker] = []
    try:
        a = Head(args, stage_ids, name="head-A")
        heads.append(a)
        a.wait_http(args.health_timeout)
        b = Head(args, stage_ids, join=a, name="head-B")
        heads.append(b)
        b.wait_http(args.health_timeout)
        res.heads = [HeadFigures("A"), HeadFigures("B")]
        res.join_s = wait_joined(heads, args.health_timeout)
        print(f"  N={n}, two heads: joined after {res.join_s:.2f}s", flush=True)
        # 1. the heads alone, joined (their gossip runs)
        time.sleep(1.0)
        c0, t0 = [h.cpu_s() for h in heads], time.monotonic()
        time.sleep(args.idle)
        for h, fig, c in zip(heads, res.heads, c0, strict=True):
            fig.idle_cpu_pct = (h.cpu_s() - c) / (time.monotonic() - t0) * 100
            fig.idle_rss_mib = h.rss_mib()
            note_busy_idle(res.notes, h.name, fig.idle_cpu_pct)
        # the fleet processes: every replica is given A, and learns B from A
        per, first = [n // w + (i < n % w) for i in range(w)], 0
        for i, count in enumerate(per):
            spec = {
                "index": i,
                "count": count,
                "first": first,
                "stage_ids": stage_ids,
                "master_host": HOST,
                "master_port": a.master_port,
                "heads": len(heads),
                "register_timeout_s": args.storm_timeout,
                "nice": args.fleet_nice,
            }
            workers.append(Worker(spec))
            first += count
        for wk in workers:
            wk.wait_hello()
        res.phases["storm"] = time.time()
        joined_storm(heads, workers, n, res, args)
        res.phases["rest"] = time.time()
        joined_rest(heads, workers, n, res, args)
        res.phases["requests"] = time.time()
        joined_requests(heads, workers, res, args, Target(args.pipeline, len(stage_ids), expect))
        res.phases["silence"] = time.time()
        joined_detect(heads, workers, res, args, "silence")
        res.phases["crash"] = time.time()
        joined_detect(heads, workers, res, args, "crash")
    except Exception as exc:
        why = common.describe(exc)
        res.notes.append(f"stopped early: {why.splitlines()[0]}")
        res.partial = True
        print(f"! N={n}, two heads: stopped early: {why}", flush=True)
    finally:
        for h in heads:
            if not h.server.log.closed:
                res.notes += [f"{h.name} log: {p}" for p in h.problems()]
        if args.keep_logs:
            keep_joined_logs(args.keep_logs, n, heads, workers)
        for h in heads:
            h.stop()
        for wk in workers:
            wk.stop()
    return res


def keep_joined_logs(folder: str, n: int, heads: list[Head], workers: list[Worker]) -> None:
    os.makedirs(folder, exist_ok=True)
    for h in heads:
        if not h.server.log.closed:
            with open(os.path.join(folder, f"{h.name}-{n}-joined.log"), "w") as f:
                f.write(h.server.log_text())
    for wk in workers:
        if not wk.log.closed:
            with open(os.path.join(folder, f"fleet-{n}-joined-{wk.spec['index']}.log"), "w") as f:
                f.write(wk.log_tail(1 << 30))


def wait_joined(heads: list[Head], timeout: float) -> float:
    """Seconds until every head lists every other one UP (``heads`` in its status)."""
    t0 = time.monotonic()
    want = {h.master_url for h in heads}
    while True:
        ok = True
        for h in heads:
            rows = h.stages()[0].get("heads") or []
            up = {r["address"] for r in rows if r["state"] == "UP"}
            ok = ok and up >= want
        if ok:
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(f"the heads did not see each other UP within {timeout:g}s")
        time.sleep(0.1)


def joined_storm(
    heads: list[Head], workers: list[Worker], n: int, res: JoinedResult, args: argparse.Namespace
) -> None:
    """Every replica starts cold at once, given A: until all N are UP at A and at B."""
    at = time.monotonic() + 0.5
    c0 = [h.cpu_s() for h in heads]
    th0 = [h.threads_s() for h in heads]
    f0 = sum(wk.cpu_s() for wk in workers)
    overflows = listen_overflows()
    ids = [wk.send("start", at=at, ramp_s=args.ramp) for wk in workers]
    deadline = at + args.storm_timeout
    time.sleep(max(0.0, at - time.monotonic()))
    while time.monotonic() < deadline:
        took = 0.0
        for h, fig in zip(heads, res.heads, strict=True):
            if fig.storm_all_up_s is not None:
                continue
            status, t = h.stages()
            took += t
            seen = time.monotonic() - at
            states = Counter(replica_states(status).values())
            fig.storm_up_at_end = states[ReplicaState.UP]
            fig.storm_error_seen = max(fig.storm_error_seen, states[ReplicaState.ERROR])
            fig.storm_hb_age_max_s = max(fig.storm_hb_age_max_s, heartbeat_age_max(status))
            if fig.storm_up_at_end >= n:
                fig.storm_all_up_s = seen
        if all(fig.storm_all_up_s is not None for fig in res.heads):
            res.storm_all_up_s = max(fig.storm_all_up_s or 0.0 for fig in res.heads)
            break
        time.sleep(max(args.poll_interval, 9 * took))
    for h, fig, c, th in zip(heads, res.heads, c0, th0, strict=True):
        fig.storm_head_cpu_s = h.cpu_s() - c
        fig.storm_threads_s = {k: v - th[k] for k, v in h.threads_s().items()}
    res.storm_fleet_cpu_s = sum(wk.cpu_s() for wk in workers) - f0
    after = listen_overflows()
    if overflows is not None and after is not None:
        res.storm_listen_overflows = after - overflows
    ready: list[list[float]] = [[], []]
    for wk, ident in zip(workers, ids, strict=True):
        answer = wk.wait(ident, args.storm_timeout + 30)
        ready[0] += answer["ready"]
        ready[1] += answer.get("ready_other", [])
        res.storm_failed += answer["failed"]
        res.storm_failed_other += answer.get("failed_other", 0)
        res.storm_retried_other += answer.get("retried_other", 0)
        for text, count in answer["errors"]:
            res.notes.append(f"registration with A: {count}x {text}")
        for text, count in answer.get("errors_other", []):
            res.notes.append(f"registration with B (last error of a link): {count}x {text}")
    for fig, xs in zip(res.heads, ready, strict=True):
        xs.sort()
        if xs:
            fig.storm_ready_p50_s, fig.storm_ready_max_s = common.pct(xs, 50), xs[-1]
    for fig in res.heads:
        if fig.storm_all_up_s is None:
            res.notes.append(
                f"storm: {fig.storm_up_at_end} of {n} UP at {fig.name} after "
                f"{args.storm_timeout:g}s"
            )
    a, b = res.heads
    print(
        f"  N={n}, two heads: storm all UP at A {fmt(a.storm_all_up_s, 's', 2)}, at B "
        f"{fmt(b.storm_all_up_s, 's', 2)} (READY to B p50 {fmt(b.storm_ready_p50_s, 's')}, "
        f"max {fmt(b.storm_ready_max_s, 's')}), {res.storm_failed}/{res.storm_failed_other} "
        f"failed, head CPU-s {fmt(a.storm_head_cpu_s)}/{fmt(b.storm_head_cpu_s)}",
        flush=True,
    )


def joined_rest(
    heads: list[Head], workers: list[Worker], n: int, res: JoinedResult, args: argparse.Namespace
) -> None:
    time.sleep(args.settle)
    for wk in workers:
        wk.call("stats")  # resets the beat lag and ack counts
    c0 = [h.cpu_s() for h in heads]
    th0 = [h.threads_s() for h in heads]
    f0, t0 = sum(wk.cpu_s() for wk in workers), time.monotonic()
    time.sleep(args.rest)
    wall = time.monotonic() - t0
    for h, fig, c, th in zip(heads, res.heads, c0, th0, strict=True):
        fig.rest_threads_pct = {k: (v - th[k]) / wall * 100 for k, v in h.threads_s().items()}
        fig.rest_cpu_pct = (h.cpu_s() - c) / wall * 100
        fig.rest_cpu_pct_per_100 = fig.rest_cpu_pct / (n / 100)
        if fig.idle_cpu_pct is not None:
            fig.rest_cpu_pct_per_100_above_idle = (fig.rest_cpu_pct - fig.idle_cpu_pct) / (n / 100)
        fig.rest_rss_mib = h.rss_mib()
        if fig.idle_rss_mib is not None:
            fig.rest_rss_mib_per_100 = (fig.rest_rss_mib - fig.idle_rss_mib) / (n / 100)
    res.rest_fleet_cpu_pct = (sum(wk.cpu_s() for wk in workers) - f0) / wall * 100
    stats = [wk.call("stats") for wk in workers]
    res.rest_beat_lag_max_ms = max(s["beat_lag_max_s"] for s in stats) * 1e3
    res.rest_acks_not_up = sum(v for s in stats for k, v in s["acks"].items() if k != "UP")
    for h, fig in zip(heads, res.heads, strict=True):
        status, took = h.stages()
        fig.stages_poll_ms = took * 1e3
        fig.rest_hb_age_max_s = heartbeat_age_max(status)
        fig.rest_not_up = sum(
            1 for s in replica_states(status).values() if s != ReplicaState.UP
        ) + max(0, n - len(replica_states(status)))
    a, b = res.heads
    print(
        f"  N={n}, two heads: at rest A {fmt(a.rest_cpu_pct)}% / B {fmt(b.rest_cpu_pct)}% "
        f"of a core, RSS {fmt(a.rest_rss_mib, digits=0)} / {fmt(b.rest_rss_mib, digits=0)} "
        f"MiB, fleet {fmt(res.rest_fleet_cpu_pct, digits=0)}%, not UP "
        f"{a.rest_not_up} / {b.rest_not_up}",
        flush=True,
    )


def joined_requests(
    heads: list[Head],
    workers: list[Worker],
    res: JoinedResult,
    args: argparse.Namespace,
    target: Target,
) -> None:
    """The closed-loop client split over both heads (half the connections and half the
    requests each), at once."""
    if args.requests <= 0:
        return
    k = len(heads)

    def split(x: int) -> list[int]:
        return [x // k + (i < x % k) for i in range(k)]

    conc, reqs, warm = split(args.concurrency), split(args.requests), split(args.warmup)
    before = [wk.call("stats") for wk in workers]
    c0 = [h.cpu_s() for h in heads]
    f0, t0 = sum(wk.cpu_s() for wk in workers), time.monotonic()

    async def both() -> list[Any]:
        return await asyncio.gather(
            *(
                load(target, h.port, c, r, wu, args.request_timeout)
                for h, c, r, wu in zip(heads, conc, reqs, warm, strict=True)
            )
        )

    try:
        results = asyncio.run(both())
    except Exception as exc:
        res.notes.append(f"requests: {common.describe(exc, args.request_timeout)}")
        res.partial = True
        return
    wall = time.monotonic() - t0
    for h, fig, c, r in zip(heads, res.heads, c0, results, strict=True):
        fig.req_head_cpu_pct = (h.cpu_s() - c) / wall * 100
        fig.rps, fig.p50_ms, fig.p99_ms = r.rps, r.p50_ms, r.p99_ms
    res.req_fleet_cpu_pct = (sum(wk.cpu_s() for wk in workers) - f0) / wall * 100
    # Measured together: all the requests over the longer half's measured time.
    res.rps = sum(reqs) / max(n / r.rps for n, r in zip(reqs, results, strict=True))
    res.req_total = args.requests + args.warmup
    after = [wk.call("stats") for wk in workers]

    def deltas(key: str) -> list[int]:
        return [
            x - y
            for aa, bb in zip(after, before, strict=True)
            for x, y in zip(aa[key], bb[key], strict=True)
        ]

    at_a, at_b = deltas("requests"), deltas("requests_other")
    res.heads[0].served_replicas = sum(1 for c in at_a if c)
    res.heads[1].served_replicas = sum(1 for c in at_b if c)
    total = [x + y for x, y in zip(at_a, at_b, strict=True)]
    res.served_replicas = sum(1 for c in total if c)
    res.served_max = max(total) if total else 0
    a, b = res.heads
    print(
        f"  N={res.n}, two heads: {res.rps:.0f} req/s (A {fmt(a.rps, digits=0)} p50 "
        f"{fmt(a.p50_ms)} ms, B {fmt(b.rps, digits=0)} p50 {fmt(b.p50_ms)} ms), served by "
        f"{res.served_replicas} replicas",
        flush=True,
    )


def joined_detect(
    heads: list[Head],
    workers: list[Worker],
    res: JoinedResult,
    args: argparse.Namespace,
    how: str,
) -> None:
    """Silence (or crash) ``--victims`` replicas, at every head at once; when does each
    head mark each one (its own incarnation of it, from its own last beat)?"""
    k = args.victims
    if k <= 0:
        return
    c0 = [h.cpu_s() for h in heads]
    shares = [k // len(workers) + (i < k % len(workers)) for i in range(len(workers))]
    victims: list[dict[str, Any]] = []
    for wk, share in zip(workers, shares, strict=True):
        if share:
            victims += wk.call(how, count=share)["victims"]
    # Per head: (stage, replica, that head's epoch) -> (last beat to it, when it stopped).
    keys: list[dict[tuple[int, int, int], tuple[float, float]]] = []
    for h in heads:
        mine = {}
        for v in victims:
            link = v["links"].get(str(h.master_port))
            if link is not None:
                key = (v["stage_id"], v["replica_id"], link["epoch"])
                mine[key] = (link["last_beat_wall"], v["at_wall"])
        keys.append(mine)
    marked: list[dict[tuple[int, int, int], float]] = [{} for _ in heads]
    deadline = time.monotonic() + 3 * args.heartbeat_timeout + 10
    cpu: list[float | None] = [None for _ in heads]
    started = time.monotonic()
    while time.monotonic() < deadline and any(
        len(m) < len(ks) for m, ks in zip(marked, keys, strict=True)
    ):
        time.sleep(0.25 if how == "silence" else 0.05)
        if how == "crash" and cpu[0] is None and time.monotonic() - started >= 3.0:
            cpu = [h.cpu_s() - c for h, c in zip(heads, c0, strict=True)]
        for h, ks, m in zip(heads, keys, marked, strict=True):
            if len(m) >= len(ks):
                continue
            status, _ = h.stages()
            polled = time.time()
            for change in status["recent_state_changes"]:
                key = (change["stage_id"], change["replica_id"], change["epoch"])
                if key in ks and change["old"] == "UP" and key not in m:
                    m[key] = change["time"]
            for key, state in replica_states(status).items():
                if key in ks and state != ReplicaState.UP and key not in m:
                    m[key] = polled  # the change left the ring: the poll's time bounds it
    if how == "crash" and cpu[0] is None:
        time.sleep(max(0.0, 3.0 - (time.monotonic() - started)))
        cpu = [h.cpu_s() - c for h, c in zip(heads, c0, strict=True)]
    for fig, ks, m, c in zip(res.heads, keys, marked, cpu, strict=True):
        # A victim with no session at this head (never READY there) counts as missed.
        missed = len(victims) - len(m)
        if how == "crash":
            fig.crash_head_cpu_s = c
            fig.crash_detect_s = sorted(m[x] - ks[x][1] for x in m)
            fig.crash_missed = missed
        else:
            fig.silent_detect_s = sorted(m[x] - ks[x][0] for x in m)
            fig.silent_detect_from_stop_s = sorted(m[x] - ks[x][1] for x in m)
            fig.silent_missed = missed
    shown = [
        ", ".join(f"{x:.2f}" for x in (f.crash_detect_s if how == "crash" else f.silent_detect_s))
        for f in res.heads
    ]
    print(
        f"  N={res.n}, two heads: {how} of {len(victims)}: marked at A after {shown[0]} s; "
        f"at B after {shown[1]} s",
        flush=True,
    )


def report_joined(
    single: dict[int, SizeResult], joined: list[JoinedResult], args: argparse.Namespace
) -> None:
    """Per fleet size: one head, and each of two joined heads, side by side."""
    print(
        f"\none head vs two joined heads (--omni-join; replicas given A learn B), "
        f"{args.pipeline}, --omni-heartbeat-timeout {args.heartbeat_timeout:g}s; "
        f"'two heads' = the fleet (A and B together, or the later of the two):"
    )
    for j in joined:
        if len(j.heads) < 2:
            print(f"\nN={j.n}: two heads not measured")
            for note in j.notes:
                print(f"  two heads: {note}")
            continue
        joined_table(single.get(j.n), j, args)


def joined_table(one: SizeResult | None, j: JoinedResult, args: argparse.Namespace) -> None:
    a, b = j.heads

    def row(
        name: str, get: Any, fleet: str = "", digits: int = 1, unit: str = ""
    ) -> tuple[str, list[str]]:
        first = "-" if one is None else get(one)
        cells = [first, get(a), get(b), fleet]
        return name, [c if isinstance(c, str) else fmt(c, unit, digits) for c in cells]

    def both(x: float | None, y: float | None, how: Any = sum) -> float | None:
        return None if x is None or y is None else how([x, y])

    def p50max(x: Any) -> str:
        return f"{fmt(x.storm_ready_p50_s)}/{fmt(x.storm_ready_max_s)}"

    def failed(x: Any) -> str:
        if x is a:
            return str(j.storm_failed)
        if x is b:
            return f"{j.storm_failed_other} ({j.storm_retried_other} retried)"
        return str(x.storm_failed)

    def silent(x: Any) -> str:
        return span(x.silent_detect_s, x.silent_missed)

    def crash(x: Any) -> str:
        return span(x.crash_detect_s, x.crash_missed, 3)

    def served(x: Any) -> str:
        return "-" if x.served_replicas is None else str(x.served_replicas)

    rows = [
        row("heads joined (each lists the other UP) s", lambda x: "-", fmt(j.join_s, digits=2)),
        row("fleet processes", lambda x: "-", str(j.workers)),
        row("idle head (no replica): CPU %", lambda x: x.idle_cpu_pct, digits=2),
        row("idle head: RSS MiB", lambda x: x.idle_rss_mib, digits=0),
        row(
            "storm: all UP s (at that head)",
            lambda x: x.storm_all_up_s,
            fmt(j.storm_all_up_s, digits=2),
            digits=2,
        ),
        row("storm: READY sent p50/max s", p50max),
        row("storm: failed registrations", failed),
        row(
            "storm: head CPU-s",
            lambda x: x.storm_head_cpu_s,
            fmt(both(a.storm_head_cpu_s, b.storm_head_cpu_s)),
        ),
        row(
            "storm: head loop/control/zmq CPU-s",
            lambda x: by_thread(x.storm_threads_s, 1),
        ),
        row(
            "storm: fleet CPU-s",
            lambda x: x.storm_fleet_cpu_s if x is one else "-",
            fmt(j.storm_fleet_cpu_s),
        ),
        row("storm: most in ERROR at once", lambda x: str(x.storm_error_seen)),
        row("storm: oldest beat of an UP s", lambda x: x.storm_hb_age_max_s, digits=2),
        row(
            "rest: head CPU % of a core",
            lambda x: x.rest_cpu_pct,
            fmt(both(a.rest_cpu_pct, b.rest_cpu_pct), digits=2),
            digits=2,
        ),
        row("rest: head CPU % per 100 repl.", lambda x: x.rest_cpu_pct_per_100, digits=2),
        row(
            "rest: ... per 100 above idle",
            lambda x: x.rest_cpu_pct_per_100_above_idle,
            fmt(
                both(a.rest_cpu_pct_per_100_above_idle, b.rest_cpu_pct_per_100_above_idle),
                digits=2,
            ),
            digits=2,
        ),
        row("rest: head loop/control/zmq %", lambda x: by_thread(x.rest_threads_pct, 1)),
        row(
            "rest: head RSS MiB",
            lambda x: x.rest_rss_mib,
            fmt(both(a.rest_rss_mib, b.rest_rss_mib), digits=0),
            digits=0,
        ),
        row("rest: RSS MiB per 100 (> idle)", lambda x: x.rest_rss_mib_per_100, digits=2),
        row(
            "rest: fleet CPU % (all procs)",
            lambda x: x.rest_fleet_cpu_pct if x is one else "-",
            fmt(j.rest_fleet_cpu_pct, digits=0),
            digits=0,
        ),
        row("rest: oldest beat of an UP s", lambda x: x.rest_hb_age_max_s, digits=2),
        row(
            "rest: not UP after",
            lambda x: "-" if x.rest_not_up is None else str(x.rest_not_up),
            "-" if j.rest_acks_not_up is None else f"{j.rest_acks_not_up} non-UP acks",
        ),
        row("GET /v1/omni/stages ms", lambda x: x.stages_poll_ms, digits=0),
        row(
            f"req/s (c={args.concurrency} in all)",
            lambda x: x.rps,
            fmt(j.rps, digits=0),
            digits=0,
        ),
        row("p50 / p99 ms", lambda x: f"{fmt(x.p50_ms)} / {fmt(x.p99_ms)}"),
        row(
            "req: head CPU %",
            lambda x: x.req_head_cpu_pct,
            fmt(both(a.req_head_cpu_pct, b.req_head_cpu_pct), digits=0),
            digits=0,
        ),
        row(
            "req: fleet CPU %",
            lambda x: x.req_fleet_cpu_pct if x is one else "-",
            fmt(j.req_fleet_cpu_pct, digits=0),
            digits=0,
        ),
        row(
            "req: replicas served",
            served,
            "-" if j.served_replicas is None else str(j.served_replicas),
        ),
        row("silent: marked after last beat s", silent),
        row(
            "silent: after it went silent s",
            lambda x: span(x.silent_detect_from_stop_s, 0),
        ),
        row("crash: marked after s", crash),
        row("crash: head CPU-s in 3 s after", lambda x: x.crash_head_cpu_s, digits=2),
    ]
    width = max(len(name) for name, _ in rows) + 2
    titles = ["one head", "head A", "head B", "two heads"]
    cols = [max(12, len(t) + 2, *(len(v[i]) + 2 for _, v in rows)) for i, t in enumerate(titles)]
    print(f"\nN={j.n} replicas" + " " * max(0, width - len(f"N={j.n} replicas")), end="")
    print("".join(f"{t:>{c}}" for t, c in zip(titles, cols, strict=True)))
    for name, values in rows:
        print(f"{name:<{width}}" + "".join(f"{v:>{c}}" for v, c in zip(values, cols, strict=True)))
    for note in j.notes:
        print(f"  two heads: {note}")


def joined_goals(
    joined: list[JoinedResult], args: argparse.Namespace
) -> list[tuple[str, Any, bool]]:
    goals: list[tuple[str, Any, bool]] = []
    for j in joined:
        if j.n == TARGET_STORM_N:
            t = j.storm_all_up_s
            goals.append(
                (
                    f"two heads: {TARGET_STORM_N} replicas UP at both < {TARGET_STORM_S:g} s",
                    t,
                    t is not None and t < TARGET_STORM_S,
                )
            )
    for j in joined:
        for fig in j.heads:
            per = fig.rest_cpu_pct_per_100_above_idle
            goals.append(
                (
                    f"two heads: N={j.n}: head {fig.name} CPU per 100 idle replicas "
                    f"< {TARGET_CPU_PER_100:g}%",
                    per,
                    per is not None and per < TARGET_CPU_PER_100,
                )
            )
    limit = args.heartbeat_timeout + DETECT_SLACK_S
    for j in joined:
        for fig in j.heads:
            worst = fig.silent_detect_s[-1] if fig.silent_detect_s else None
            ok = worst is not None and not fig.silent_missed and worst <= limit
            goals.append(
                (f"two heads: N={j.n}: silent marked at {fig.name} <= {limit:g} s", worst, ok)
            )
    return goals


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "--exec-with-pdeathsig":
        die_with_parent()  # survives the exec: the head dies with the benchmark
        os.execv(sys.argv[2], sys.argv[2:])
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="100,1000,5000", help="fleet sizes, comma-separated")
    p.add_argument("--workers", type=int, default=4, help="fleet processes")
    p.add_argument("--pipeline", default="echo-1stage", choices=sorted(PIPELINES))
    p.add_argument("--heartbeat-timeout", type=float, default=5.0, help="--omni-heartbeat-timeout")
    p.add_argument("--idle", type=float, default=5.0, help="seconds of the head alone")
    p.add_argument("--settle", type=float, default=3.0, help="seconds between storm and rest")
    p.add_argument("--rest", type=float, default=20.0, help="seconds measured at rest")
    p.add_argument("--ramp", type=float, default=0.0, help="spread the starts over S s")
    p.add_argument("--storm-timeout", type=float, default=120.0, help="seconds for all to be UP")
    p.add_argument("--poll-interval", type=float, default=0.2, help="/v1/omni/stages polls")
    p.add_argument("--requests", type=int, default=2000, help="measured requests per size")
    p.add_argument("--warmup", type=int, default=200, help="warm-up requests per size")
    p.add_argument("--concurrency", type=int, default=32, help="closed-loop HTTP clients")
    p.add_argument("--victims", type=int, default=5, help="replicas silenced, then crashed")
    p.add_argument("--fleet-nice", type=int, default=5, help="fleet processes' extra niceness")
    p.add_argument("--head-log-level", default="INFO", help="the head's --log-level")
    p.add_argument("--keep-logs", metavar="DIR", help="keep the head's and fleet's logs there")
    p.add_argument(
        "--heads",
        default="1,2",
        help="1: one head; 2: two heads joined with --omni-join (default both, per size)",
    )
    p.add_argument("--quick", action="store_true", help="100,1000; shorter windows")
    common.add_common_args(p, health_timeout=60.0, request_timeout=30.0)
    p.add_argument("--fleet-worker", metavar="SPEC", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.fleet_worker:
        return fleet_worker(args.fleet_worker)
    if args.quick:
        if "--sizes" not in sys.argv:
            args.sizes = "100,1000"
        args.idle, args.settle, args.rest = 2.0, 2.0, 5.0
        args.requests, args.warmup = 500, 100
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    heads = {int(h) for h in args.heads.split(",") if h.strip()}
    if not heads or heads - {1, 2}:
        p.error("--heads takes 1, 2 or 1,2")
    limit = raise_fd_limit()
    print(
        f"{common.machine()}, load {os.getloadavg()[0]:.2f}; open files {limit}; "
        f"sizes {sizes}, {args.workers} fleet processes (nice +{args.fleet_nice}), "
        f"pipeline {args.pipeline}, rest {args.rest:g}s, {args.requests} requests "
        f"at c={args.concurrency}, {args.victims} victims, heads {sorted(heads)}"
    )
    need = 3 * max(sizes) + 200
    if need > limit:
        print(f"! the head may need ~{need} open files for {max(sizes)} replicas (limit {limit})")
    common.exit_on_sigterm()
    results: list[SizeResult] = []
    joined: list[JoinedResult] = []
    for n in sizes:
        print(f"N={n}:", flush=True)
        if 1 in heads:
            results.append(run_size(n, args))
        if 2 in heads:
            joined.append(run_joined(n, args))
    goals = report(results, joined, args)
    if args.json:
        sections = {
            "results": [asdict(r) for r in results],
            "joined": [asdict(j) for j in joined],
            "targets": goals,
        }
        common.write_json(args.json, args, sections, skip=["fleet_worker"])
    # Figures from a fleet that did not form measure something else: say so, and fail.
    failed = sum(r.storm_failed for r in results)
    failed += sum(j.storm_failed + j.storm_failed_other for j in joined)
    if failed:
        print(f"! {failed} registration(s) failed: the figures above are not the fleet's")
        return 1
    # A size that stopped early, or whose requests failed, lacks the figures after that.
    if bad := sum(x.partial for x in [*results, *joined]):
        print(f"! {bad} run(s) stopped early or had failed requests: their figures are partial")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
