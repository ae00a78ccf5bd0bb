"""The replica process's shell: signals and drain, joining a head, serving it, and (for
a headless replica) joining again when that head is lost.

The same code runs as a local subprocess of the head and as a --headless replica on
another host. The pieces: ``join.Joiner`` (register, handshake, engine), ``session.
HeadSession`` (sockets and heartbeat for one head), ``requests.RequestRunner`` (the
requests themselves, no I/O).

A headless replica (``rejoin``) outlives its head: when the head leaves (it says so,
or stops answering heartbeats, or no longer knows this replica) the replica drops its
requests (the head re-dispatches them) and its connections, keeps its loaded engine,
and registers again, with backoff, until a head takes it back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time

import zmq

from omnistage import curve
from omnistage.engines.base import Engine
from omnistage.protocol.auth import Signer, Verifier
from omnistage.protocol.errors import IdConflict, OmniError
from omnistage.protocol.messages import HandshakeInit, ReplicaState
from omnistage.replica import load_priority
from omnistage.replica.admission import Admission
from omnistage.replica.join import Joiner
from omnistage.replica.options import ReplicaOptions
from omnistage.replica.other_heads import OtherHead
from omnistage.replica.register import gives_way
from omnistage.replica.requests import RequestRunner
from omnistage.replica.session import HeadSession

log = logging.getLogger(__name__)


class ReplicaRuntime:
    def __init__(
        self, opts: ReplicaOptions, load_niced: load_priority.Lowered = load_priority.NOT_LOWERED
    ) -> None:
        """``load_niced``: the lower priority the process loads at (``load_priority``),
        given back once it is ready to serve."""
        self.opts = opts
        self._load_niced = load_niced
        self._ctx = zmq.Context()
        if opts.curve_keys:
            curve.secure_replica(self._ctx, opts.curve_keys)
        self._signer = Signer(opts.auth_token) if opts.auth_token else None
        self._verifier = Verifier(opts.auth_token) if opts.auth_token else None
        self._joiner = Joiner(self._ctx, opts, self._signer)
        self._stopping = asyncio.Event()
        self._head_lost = asyncio.Event()
        self._draining = False
        self._failed_by_head = False
        self._exit_code = 0
        self._join_task: asyncio.Task[tuple[HandshakeInit, Engine]] | None = None
        self._runner: RequestRunner | None = None
        self._session: HeadSession | None = None
        # The fleet's other heads (a headless replica serves them all): master URL ->
        # link; and the first head's own URL as it names itself in its list of heads.
        self._admission = Admission()
        self._others: dict[str, OtherHead] = {}
        self._first_head = ""
        self._moving = False  # leaving our id for a new one (``_on_conflict``)

    # -- lifecycle -------------------------------------------------------------------

    async def run(self) -> int:
        loop = self._loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal, sig)
        # Joining runs as its own task so a signal can interrupt a slow engine load.
        self._join_task = asyncio.create_task(self._joiner.join())
        try:
            init, engine = await self._join_task
        except (OmniError, TimeoutError) as exc:
            log.error("stage %d replica failed to start: %s", self.opts.stage_id, exc)
            await self._close()
            return 1
        except asyncio.CancelledError:
            await self._close()
            return 0
        self._runner = RequestRunner(self.opts.stage_id, engine, self._on_shutdown_message)
        self._runner.admission = self._admission
        self._admission.runners.append(self._runner)
        try:
            while not self._stopping.is_set():
                await self._serve(init)
                # Draining means the operator wants us gone: do not look for a new head.
                if self._stopping.is_set() or not self.opts.rejoin or self._draining:
                    break
                await self._leave_head()
                self._join_task = asyncio.create_task(
                    self._joiner.rejoin(self._runner.engine, self._failed_by_head)
                )
                self._failed_by_head = False
                try:
                    init, self._runner.engine = await self._join_task
                    self._moving = False
                except asyncio.CancelledError:
                    break
                except (OmniError, TimeoutError) as exc:
                    log.error("stage %d replica failed to rejoin: %s", self.opts.stage_id, exc)
                    self._exit_code = 1
                    break
        finally:
            await self._close()
        return self._exit_code

    async def _serve(self, init: HandshakeInit) -> None:
        """Serve the head until we stop or (``_head_lost``) must rejoin."""
        joiner = self._joiner
        assert self._runner is not None and joiner.reply and joiner.address
        self._load_niced.restore()  # loaded: serve at the process's own priority
        self._load_niced = load_priority.NOT_LOWERED
        session = self._session = HeadSession(
            self._ctx, self.opts, self._runner, joiner.reply, init, joiner.address
        )
        session.open(
            self._loop,
            self._status,
            self._on_head_lost,
            signer=self._signer,
            verifier=self._verifier,
            on_heads=self._heads_from_first,
        )
        log.info("ready (capacity %d)", self._runner.engine.capacity)
        if init.heads:
            self._learn_heads("", init.heads)
        stop = asyncio.ensure_future(self._stopping.wait())
        lost = asyncio.ensure_future(self._head_lost.wait())
        await asyncio.wait({stop, lost}, return_when=asyncio.FIRST_COMPLETED)
        stop.cancel()
        lost.cancel()

    async def _leave_head(self) -> None:
        """Drop what belonged to the lost head: requests, connections, heartbeats."""
        assert self._runner is not None and self._session is not None
        self._draining = False
        self._head_lost.clear()
        await self._runner.cancel_all()
        self._runner.forget_routes()
        self._session.close(say_down=False)
        self._session = None

    async def _close(self) -> None:
        others = list(self._others.values())
        self._others.clear()
        await asyncio.gather(*(link.stop() for link in others), return_exceptions=True)
        if self._runner is not None:
            await self._runner.cancel_all()
            if self._session is not None:
                self._runner.flush()
        if self._session is not None:
            self._session.close(say_down=True)
        if self._runner is not None:
            with contextlib.suppress(Exception):
                await self._runner.engine.shutdown()
        self._ctx.term()
        log.info("stopped")

    # -- signals, drain, a lost head ---------------------------------------------------

    # -- the fleet's other heads -----------------------------------------------------------

    def _heads_from_first(self, heads: list[str]) -> None:
        """Heartbeat thread: the first head's list of the fleet's heads changed."""
        self._loop.call_soon_threadsafe(self._learn_heads, "", heads)

    def _learn_heads(self, source: str, heads: list[str]) -> None:
        """A head (``source``: its master URL; "" for the first head) named the fleet's
        heads, itself first: serve each one not served yet. The first head's list is
        the reference: a head it no longer names (forgotten, down for long) and that we
        are not connected to is let go."""
        if not self.opts.rejoin or self._stopping.is_set():
            return  # a local replica serves only the head that runs it
        if self._moving or (source and source not in self._others):
            # Leaving our id (the new one's session learns the heads again), or a link
            # already let go: a link made now would register under the id being left
            # and hold it at that head for good, refusing its rightful owner.
            return
        if not source:
            self._first_head = heads[0] if heads else self._first_head
            for master in [m for m, link in self._others.items() if m not in heads]:
                if not self._others[master].connected:
                    self._loop.create_task(self._others.pop(master).stop())
        for master in heads:
            if master in self._others or master == self._first_head:
                continue
            link = OtherHead(
                self._ctx,
                self.opts,
                master,
                identity=self._identity,
                engine=self._engine,
                admission=self._admission,
                status=self._status,
                on_heads=self._learn_heads,
                on_conflict=self._on_conflict,
                signer=self._signer,
                verifier=self._verifier,
            )
            self._others[master] = link
            # Its id is the fleet's now: a rejoin of the first head must keep it.
            self._joiner.keep_id = True
            link.start()

    def _on_conflict(self, master: str, conflict: IdConflict) -> None:
        """Head ``master`` holds our id for another replica: two heads gave it out at
        once. The replica that gives way (``gives_way``) leaves every head and registers
        with its first head for a new id; the other keeps trying until it is free."""
        if self._moving or not gives_way(self.opts, conflict) or self._session is None:
            return
        log.warning("head %s: %s; registering for a new id", master, conflict)
        self._moving = True
        self._joiner.new_id()
        others = list(self._others.values())
        self._others.clear()
        for link in others:
            self._loop.create_task(link.stop())
        self._head_lost.set()

    def _identity(self) -> tuple[int, str]:
        assert self._joiner.address is not None
        return self._joiner.replica_id, self._joiner.address

    def _engine(self) -> Engine:
        assert self._runner is not None
        return self._runner.engine

    def _status(self) -> ReplicaState:
        return ReplicaState.DRAINING if self._draining else ReplicaState.UP

    def _on_signal(self, sig: int) -> None:
        joining = self._join_task is not None and not self._join_task.done()
        if self._draining or joining or self._runner is None:
            # Still starting (nothing to finish) or a second signal: stop now.
            log.info("received %s; shutting down", signal.Signals(sig).name)
            self._stopping.set()
            self._joiner.cancel.set()
            if joining and self._join_task is not None:
                self._join_task.cancel()
            return
        self._draining = True
        log.info(
            "received %s; draining %d request(s) for up to %gs (again to stop now)",
            signal.Signals(sig).name,
            self._admission.in_flight(),
            self.opts.drain_timeout_s,
        )
        sessions = [self._session, *(link.session for link in self._others.values())]
        for session in sessions:
            if session is not None and session.heartbeat is not None:
                session.heartbeat.beat_now()  # the heads stop sending new work at once
        self._loop.create_task(self._drain())

    async def _drain(self) -> None:
        assert self._runner is not None
        deadline = time.monotonic() + self.opts.drain_timeout_s
        while self._admission.in_flight() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self._admission.in_flight():
            log.warning("drain timeout: %d request(s) cut short", self._admission.in_flight())
        self._stopping.set()

    def _on_shutdown_message(self, reason: str) -> None:
        if self.opts.rejoin and not self._draining:
            log.info("the head is leaving (%s); registering again", reason)
            self._head_lost.set()
        else:
            log.info("head asked us to shut down (%s)", reason)
            self._stopping.set()

    def _on_head_lost(self, why: str, failed: bool = False) -> None:
        """Heartbeat thread: the head is gone or will not route to us (``failed``: it
        marked us ERROR)."""
        self._failed_by_head = failed
        if self.opts.rejoin:
            log.warning("lost the head: %s; registering again", why)
            self._loop.call_soon_threadsafe(self._head_lost.set)
        else:
            # A failure exit, so the head's --omni-restart-policy on-failure restarts us.
            log.warning("lost the head: %s; exiting", why)
            self._exit_code = 1
            self._loop.call_soon_threadsafe(self._stopping.set)
