"""bench_fleet's fleet process: many simulated replicas on one asyncio loop.

Each simulated replica does on the wire what a headless ``omnistage serve --headless``
replica does, with the replica's own message code (``replica.register``,
``replica.heartbeat``, ``replica.session``): registration on the master, HELLO and the
head's init, READY on its input DEALER and outputs on its own PUSH (``data_sockets``),
heartbeats with the load report a replica sends (``beat``, ``load_report``), the acks
judged as the heartbeat thread judges them (``ack_verdict``), and requests answered by a
``RequestRunner`` per head over an echo engine shared by the replicas of the process.
Only the waiting differs: 5,000 replicas cannot each hold a heartbeat thread and block on
registration, so answers are awaited on the loop (``ask``), sockets are read with
``zmqio.Pump`` and heartbeats are loop timers.

A replica serves every head of the fleet it learns of (``HandshakeInit.heads``, then each
``HeartbeatAck.heads``) as ``replica.other_heads`` does: registration at each other head
under the id the first gave (``with_fleet_id``; an unanswered or refused one tried again
after ``RETRY_S``), its own handshake, data sockets, READY and heartbeats (``others``
from a shared ``Admission``). Left out, as not what a fleet at rest or in a storm does:
STARTING heartbeats (echo loads at once), the peer socket (READY offers none, so inputs
come through the head), rejoining a lost head, and DRAINING / DOWN goodbyes.

Spoken to by JSON lines on stdin / stdout (``bench_fleet.Worker``).
"""

import asyncio
import contextlib
import ctypes
import json
import logging
import os
import resource
import secrets
import signal
import sys
import time
from collections import Counter
from typing import Any

import common
import msgspec
import zmq

from omnistage.config.schema import StageConfig
from omnistage.engines import build_engine
from omnistage.engines.base import Engine
from omnistage.net import split_tcp_url, tcp_url
from omnistage.protocol import codec
from omnistage.protocol.errors import ProtocolError
from omnistage.protocol.messages import (
    AddRequest,
    HandshakeInit,
    HeartbeatAck,
    OutputChunk,
    PeerConnector,
)
from omnistage.protocol.messages import ReplicaState as State
from omnistage.replica.heartbeat import HeartbeatSpec, ack_verdict, beat
from omnistage.replica.options import ReplicaOptions
from omnistage.replica.other_heads import REGISTER_WAIT_S, RETRY_S, Admission
from omnistage.replica.register import (
    hello,
    read_init,
    read_register_reply,
    registration,
    wire_map,
    with_fleet_id,
)
from omnistage.replica.requests import RequestRunner
from omnistage.replica.session import data_sockets, load_report, ready
from omnistage.zmqio import NOBLOCK, Pump

PR_SET_PDEATHSIG = 1
log = logging.getLogger("fleet_sim")


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


async def ask(ctx: zmq.Context, url: str, frames: list[bytes], timeout: float) -> list[bytes]:
    """One request and its answer on a fresh DEALER, without blocking the loop (what
    ``replica.register.register`` / ``handshake`` do on a thread, for many at once)."""
    loop = asyncio.get_running_loop()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    fd = sock.getsockopt(zmq.FD)
    answered = loop.create_future()

    def check() -> None:
        if not answered.done() and sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            answered.set_result(None)

    try:
        sock.connect(url)
        sock.send_multipart(frames)
        loop.add_reader(fd, check)
        try:
            check()
            async with asyncio.timeout(timeout):
                await answered
        finally:
            loop.remove_reader(fd)
        return sock.recv_multipart(NOBLOCK)
    finally:
        sock.close(linger=0)


class HeadLink:
    """A simulated replica's session with one head: registration, handshake, READY,
    heartbeats, requests. The first head's link registers without an id (the head
    assigns it); a link to another head registers under that id."""

    def __init__(self, rep: "SimReplica", master: str, first: bool) -> None:
        self.rep = rep
        self.master = master  # tcp://HOST:PORT
        self.port = split_tcp_url(master)[1]
        self.first = first
        self.replica_id, self.epoch = -1, 0
        self.runner: RequestRunner | None = None
        self.spec: HeartbeatSpec | None = None
        self.requests = 0  # AddRequests received
        self.ready_at: float | None = None  # monotonic, READY sent
        self.error = ""  # the last failed attempt's (other heads: tried again)
        self.attempts = 0
        self.beating = self.closed = False
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
        req = msgspec.structs.replace(
            registration(opts, common.HOST), replica_instance=rep.instance
        )
        if not self.first:  # the id the first head gave: the fleet's id for this replica
            req = with_fleet_id(opts, req, rep.replica_id)
        frames = [codec.encode_register_request(wire_map(req))]
        reply = read_register_reply((await ask(f.ctx, self.master, frames, timeout))[-1], host)
        if not self.first and reply.replica_id != rep.replica_id:
            raise ProtocolError(f"{self.master} gave id {reply.replica_id}, not {rep.replica_id}")
        self.replica_id, self.epoch = reply.replica_id, reply.epoch
        hs = codec.encode(hello(rep.stage_id, reply))
        init = read_init(await ask(f.ctx, reply.handshake_address, hs, timeout), host)
        engine = await f.engine(init.stage_config)
        if self.closed:
            raise ProtocolError("closed while joining")
        self.runner = RequestRunner(rep.stage_id, engine, self._on_shutdown)
        self.runner.admission = rep.admission
        rep.admission.runners.append(self.runner)
        inp, out = data_sockets(f.ctx, rep.stage_id, reply, init, bind=False)
        beats = f.ctx.socket(zmq.DEALER)
        beats.setsockopt(zmq.LINGER, 0)
        beats.setsockopt(zmq.SNDHWM, 16)
        beats.connect(init.coordinator_address)
        self._socks = [inp, out, beats]
        self.inp, self.out, self.beats = inp, out, beats
        self.runner.bind(self.replica_id, self.epoch, self)
        inp.send(codec.pack(ready(self.runner, reply, common.HOST, "")))
        self.ready_at = time.monotonic()
        self._pump = Pump(f.loop, inp, self._on_frames)
        self.spec = HeartbeatSpec.of(rep.stage_id, reply, init)
        self.beating = True
        self._due = f.loop.time()
        self._beat()
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

    def _beat(self) -> None:
        if not self.beating:
            return
        f, spec, runner = self.rep.fleet, self.spec, self.runner
        assert spec is not None and runner is not None
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
            if ack_verdict(ack) is not None:
                f.lost += 1  # a real replica would register again; the benchmark counts it
            if ack.heads != self.heads:  # as HeartbeatThread._read_ack calls on_heads
                self.heads = list(ack.heads)
                self.rep.learn("" if self.first else self.master, self.heads)
        self.seq += 1
        msg = beat(spec, self.seq, State.UP, load_report(runner))
        try:
            self.beats.send_multipart(codec.encode(msg), NOBLOCK)
            f.beats_sent += 1
        except zmq.Again:
            f.beats_dropped += 1
        self.last_beat_wall = time.time()
        self._due = max(self._due + spec.interval_s, now)
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

    def to_peer(self, address: str, chunks: list[OutputChunk], connector: PeerConnector) -> None:
        self.rep.fleet.peer_drops += len(chunks)  # never named: READY offers no peer address

    def _on_shutdown(self, reason: str) -> None:
        self.beating = False  # the head is leaving; the benchmark is ending


class SimReplica:
    """One simulated replica: a link to its first head and one to each other head it
    learned of, over one shared engine."""

    def __init__(self, fleet: "Fleet", stage_id: int) -> None:
        self.fleet = fleet
        self.stage_id = stage_id
        self.error = ""
        self.admission = Admission()
        # A replica process's own instance (``register.INSTANCE`` is one per process, and
        # this process plays many): a head sees a registration with the instance of a
        # replica it holds as that replica moving to a new id, and lets its old one go.
        self.instance = secrets.token_hex(8)
        self.links = [HeadLink(self, tcp_url(fleet.host, fleet.port), first=True)]
        self.first_head = ""  # the first head's own URL in its list of heads

    @property
    def replica_id(self) -> int:
        return self.links[0].replica_id

    @property
    def beating(self) -> bool:
        return self.links[0].beating

    async def join(self, delay: float) -> None:
        if delay > 0:
            await asyncio.sleep(delay)
        f = self.fleet
        try:
            init = await self.links[0].join(f.timeout)
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

    def silence(self) -> dict[str, Any]:
        """Stop heartbeating (to every head), say nothing, keep the sockets: a hung or
        cut-off replica."""
        for link in self.links:
            link.silence()
        return {
            "stage_id": self.stage_id,
            "replica_id": self.replica_id,
            "at_wall": time.time(),
            # Per head (by its master port): that head's incarnation and last beat.
            "links": {
                str(link.port): {"epoch": link.epoch, "last_beat_wall": link.last_beat_wall}
                for link in self.links
                if link.ready_at is not None
            },
        }

    def crash(self) -> dict[str, Any]:
        """Close every socket at once, as the kernel does for a process that died."""
        victim = self.silence()
        victim["at_wall"] = time.time()
        self.close()
        return victim

    def close(self) -> None:
        for link in self.links:
            link.close()


class Fleet:
    """One fleet process: its replicas, one ZMQ context and one asyncio loop."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.host, self.port = spec["master_host"], spec["master_port"]
        self.timeout = float(spec["register_timeout_s"])
        self.heads = int(spec["heads"])  # heads of the fleet each replica serves
        self.ctx = zmq.Context(io_threads=1)
        # 3 sockets per head and replica, 2 more while it registers; libzmq's default is 1023.
        self.ctx.set(zmq.MAX_SOCKETS, (3 * self.heads + 2) * spec["count"] + 64)
        stages, first = spec["stage_ids"], spec["first"]
        self.replicas = [
            SimReplica(self, stages[(first + i) % len(stages)]) for i in range(spec["count"])
        ]
        self._engines: dict[int, asyncio.Future[Engine]] = {}
        self.lags: list[float] = []
        self.acks: Counter[str] = Counter()
        self.bad_acks = self.beats_sent = self.beats_dropped = self.peer_drops = self.lost = 0
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
        try:
            while line := await reader.readline():
                cmd = json.loads(line)
                if cmd["cmd"] == "stop":
                    emit({"id": cmd["id"]})
                    break
                self.spawn(self._command(cmd))
        finally:
            for task in list(self._tasks):
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
        the same clock in every process), spread over ``ramp_s``; then waits (up to the
        registration timeout from ``at``) until each is READY at every head."""
        await asyncio.sleep(max(0.0, at - time.monotonic()))
        n = len(self.replicas)
        await asyncio.gather(*(r.join(ramp_s * i / n) for i, r in enumerate(self.replicas)))
        joined = [r for r in self.replicas if not r.error]

        def done(r: SimReplica) -> bool:
            return len(r.links) >= self.heads and all(x.ready_at for x in r.links)

        while any(not done(r) for r in joined) and time.monotonic() < at + self.timeout:
            await asyncio.sleep(0.05)
        others = [x for r in joined for x in r.links[1:]]
        ready_by_head: dict[str, list[float]] = {}
        for r in joined:
            for x in r.links:
                if x.ready_at is not None:
                    ready_by_head.setdefault(str(x.port), []).append(x.ready_at - at)
        errors = Counter(r.error for r in self.replicas if r.error)
        errors.update(x.error for x in others if x.error)
        return {
            "ready": ready_by_head,  # master port -> READY times
            "failed": n - len(joined),  # registrations at the first head that failed
            # Replicas not READY at every head in time (learned of too few, or not taken).
            "failed_other": sum(1 for r in joined if not done(r)),
            "retried_other": sum(max(0, x.attempts - 1) for x in others),
            "errors": errors.most_common(3),
        }

    def _stats(self) -> dict[str, Any]:
        lags, self.lags = sorted(self.lags), []
        requests: dict[str, list[int]] = {}  # master port -> requests, per replica
        for i, r in enumerate(self.replicas):
            for x in r.links:
                requests.setdefault(str(x.port), [0] * len(self.replicas))[i] = x.requests
        out = {
            "requests": requests,
            "beats_sent": self.beats_sent,
            "beats_dropped": self.beats_dropped,
            "acks": dict(self.acks),
            "bad_acks": self.bad_acks,
            "lost": self.lost,
            "peer_drops": self.peer_drops,
            "beat_lag_max_s": lags[-1] if lags else 0.0,
            "beat_lag_p99_s": common.pct(lags, 99) if lags else 0.0,
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


def main(spec_json: str) -> int:
    die_with_parent()
    spec = json.loads(spec_json)
    with contextlib.suppress(OSError):
        os.nice(spec["nice"])
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(message)s")
    asyncio.run(Fleet(spec).run())
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] in ("-h", "--help"):
        print(f"usage: fleet_sim.py SPEC_JSON (started by bench_fleet.py)\n\n{__doc__}")
        sys.exit(0 if sys.argv[1:] in (["-h"], ["--help"]) else 2)
    sys.exit(main(sys.argv[1]))
