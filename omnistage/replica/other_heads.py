"""A headless replica serving every head of a fleet (--omni-join on the heads).

The head at -oma/-omp is the replica's first head: it assigns the replica's id and its
stage config, and the replica rejoins it as before (``runtime``). Every head tells its
replicas the fleet's heads (``HandshakeInit.heads``, ``HeartbeatAck.heads``); for each
other head the replica keeps an ``OtherHead``: it registers there with the same replica
id, handshakes, and serves it through a session of its own (sockets, heartbeat, and a
``RequestRunner`` over the one shared engine). When that head is lost, only its
requests are dropped (it is gone: nobody would read them) and the link registers again
at once, so a head that comes back is served as soon as it answers.

Several heads each count only their own requests against the replica's capacity, so
the replica admits for all of them (``admission.Admission``): a request beyond its capacity is
refused as BUSY, which a head dispatches again (elsewhere, or here once there is room),
and each heartbeat tells a head how many requests the others hold (``others``).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable

import zmq

from omnistage.engines.base import Engine
from omnistage.net import free_ports, split_tcp_url
from omnistage.protocol.auth import Signer, Verifier
from omnistage.protocol.errors import IdConflict, OmniError
from omnistage.protocol.messages import HandshakeInit, ReplicaState
from omnistage.protocol.registration import RegisterReply
from omnistage.replica.admission import Admission
from omnistage.replica.options import ReplicaOptions
from omnistage.replica.register import (
    MasterLink,
    handshake,
    register,
    registration,
    with_fleet_id,
)
from omnistage.replica.requests import RequestRunner
from omnistage.replica.session import HeadSession

log = logging.getLogger(__name__)

# How long one registration attempt with another head waits for its answer. A request
# queued to a head that is down is delivered the moment it is back (ZMQ reconnects), so
# a long wait costs nothing and catches a returning head at once.
REGISTER_WAIT_S = 10.0
# Pause between attempts after one went unanswered or was refused.
RETRY_S = 0.5


class OtherHead:
    """The replica's link to one more head of its fleet (see the module docstring)."""

    def __init__(
        self,
        ctx: zmq.Context,
        opts: ReplicaOptions,
        master: str,
        *,
        identity: Callable[[], tuple[int, str]],
        engine: Callable[[], Engine],
        admission: Admission,
        status: Callable[[], ReplicaState],
        on_heads: Callable[[str, list[str]], None],
        on_conflict: Callable[[str, IdConflict], None],
        signer: Signer | None = None,
        verifier: Verifier | None = None,
    ) -> None:
        """``master``: that head's master URL; ``identity``: (replica id, advertised
        address) as the first head has them now; ``on_heads``: the heads this head
        names (called on the loop); ``on_conflict``: this head refused our id, another
        replica holds it there (called on the loop; the link keeps trying)."""
        self.master = master
        self._ctx = ctx
        self._opts = opts
        self._identity = identity
        self._engine = engine
        self._admission = admission
        self._status = status
        self._on_heads = on_heads
        self._on_conflict = on_conflict
        self._signer = signer
        self._verifier = verifier
        host, port = split_tcp_url(master)
        self._stop = asyncio.Event()
        # Set to abandon a registration in progress (the replica stops).
        self._cancel = threading.Event()
        self._link = MasterLink(ctx, host, port, signer, self._cancel)
        self.session: HeadSession | None = None
        self._task: asyncio.Task[None] | None = None
        self._last_error = ""

    @property
    def connected(self) -> bool:
        return self.session is not None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"omni-head-{self.master}")

    async def stop(self) -> None:
        """Leave this head for good (saying so), dropping its requests."""
        self._stop.set()
        self._cancel.set()
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        while not self._stop.is_set():
            try:
                reply, init = await asyncio.to_thread(self._join)
            except OmniError as exc:
                if self._stop.is_set():
                    return
                if isinstance(exc, IdConflict):
                    self._on_conflict(self.master, exc)
                # Said once per kind of trouble, not every attempt: a head that is down
                # (no answer) or that refuses us (an id its own replica holds, say).
                if str(exc) != self._last_error:
                    self._last_error = str(exc)
                    log.warning("cannot serve head %s yet: %s", self.master, exc)
                if await self._stopped_within(RETRY_S):
                    return
                continue
            self._last_error = ""
            await self._serve(reply, init)

    async def _serve(self, reply: RegisterReply, init: HandshakeInit) -> None:
        """Serve this head until it is lost or the replica stops."""
        loop = asyncio.get_running_loop()
        lost = asyncio.Event()
        runner = RequestRunner(self._opts.stage_id, self._engine(), lambda _: lost.set())
        runner.admission = self._admission
        self._admission.runners.append(runner)
        session = self.session = HeadSession(
            self._ctx, self._opts, runner, reply, init, self._identity()[1], master=self.master
        )
        session.open(
            loop,
            self._status,
            lambda _why, _failed: loop.call_soon_threadsafe(lost.set),
            signer=self._signer,
            verifier=self._verifier,
            on_heads=lambda heads: loop.call_soon_threadsafe(self._on_heads, self.master, heads),
        )
        log.info("serving head %s too, as replica %d", self.master, reply.replica_id)
        stop = asyncio.ensure_future(self._stop.wait())
        gone = asyncio.ensure_future(lost.wait())
        await asyncio.wait({stop, gone}, return_when=asyncio.FIRST_COMPLETED)
        stop.cancel()
        gone.cancel()
        leaving = self._stop.is_set()
        if not leaving:
            held = len(runner.requests)
            log.warning("lost head %s; dropped its %d request(s)", self.master, held)
        await runner.cancel_all()
        if leaving:
            runner.flush()
        else:
            runner.forget_routes()
        session.close(say_down=leaving)
        self._admission.runners.remove(runner)
        self.session = None

    def _join(self) -> tuple[RegisterReply, HandshakeInit]:
        """Register with this head under the replica's id, then handshake (blocking)."""
        replica_id, address = self._identity()
        o = self._opts
        ports = tuple(free_ports(3, address)) if o.binds_sockets else None
        req = with_fleet_id(o, registration(o, address, ports), replica_id)
        reply = register(self._link, req, REGISTER_WAIT_S)
        deadline = time.monotonic() + REGISTER_WAIT_S
        init = handshake(
            self._link, reply, o.stage_id, max(0.001, deadline - time.monotonic()), o.binds_sockets
        )
        return reply, init

    async def _stopped_within(self, seconds: float) -> bool:
        try:
            await asyncio.wait_for(self._stop.wait(), seconds)
        except TimeoutError:
            return False
        return True
