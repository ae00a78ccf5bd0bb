"""The head's own replicas: launched into the head-local slots, restarted when they exit
(``--omni-restart-policy``; how soon: ``launch.restart``), and a failed start fails the
head at once. Each restart is announced to the stage's pool when it is decided, with the
time it is due, so requests wait for it (``dataplane.comebacks``); and so is a restart
that will not happen after all.

The autoscaler (``head.scaler``) adds replicas into free ids it reserves as head-local,
and retires them: a retiring replica is drained (the head routes nothing new to it, it
finishes what it has and exits), its exit is neither a failure nor restarted, and its
slot is given back so ids stay small.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from omnistage import envs
from omnistage.head.niced_loads import NicedLoads
from omnistage.head.options import HeadOptions
from omnistage.head.state import ControlState
from omnistage.launch import make_launcher
from omnistage.launch.base import Launcher, ReplicaProcess
from omnistage.launch.restart import NO_RESTART, SETTLE_S, RestartPlan, RestartPolicy
from omnistage.logs import Throttled
from omnistage.protocol.messages import Reason, ReplicaState
from omnistage.replica.options import ReplicaOptions

log = logging.getLogger(__name__)
# A replica that cannot be added (its devices, say) is asked for again on every check.
_cannot_add = Throttled(log, burst=2, window_s=60.0)

# Between marking a replica DRAINING (the head routes nothing new to it) and asking it to
# drain: requests already sent reach it first, so its drain waits for them.
DRAIN_SETTLE_S = 0.25
# A retiring replica still running this long after its own drain timeout is killed.
DRAIN_KILL_GRACE_S = 10.0
SCALED_DOWN = "scaled down"
_EARLY = f"before UP or within {SETTLE_S:g}s of it"


@dataclass
class _Owned:
    options: ReplicaOptions
    proc: ReplicaProcess | None = None
    running: bool = False
    retiring: bool = False
    up: bool = False  # reached UP since it was last launched
    failed: RestartPlan | None = None  # seen killed, its process still exiting


def _no_restart_note(stage_id: int, replica_id: int) -> None:
    pass


def _no_due_note(stage_id: int, replica_id: int, at: float | None) -> None:
    pass


@dataclass(frozen=True)
class LocalHooks:
    """What the head's shell lends its local replicas."""

    # Start-up is over (every stage has had a live replica).
    is_serving: Callable[[], bool]
    # A replica could not start during start-up: stop the head (from a launcher thread).
    fail_head: Callable[[], None]
    # A replica is about to be restarted (for the views of the running system).
    on_restart: Callable[[int, int], None] = _no_restart_note
    # On the loop: a replica will be restarted at a time.monotonic() value, or (None)
    # will not be after all; until it is UP again, requests for its stage wait for it.
    on_restart_due: Callable[[int, int, float | None], None] = _no_due_note


def _start_failed(o: ReplicaOptions, stage_name: str, code: int) -> None:
    log.error(
        "stage %d (%s) replica %d exited with code %d while starting; see its log lines "
        "above. Shutting down.",
        o.stage_id,
        stage_name,
        o.replica_id,
        code,
    )


def _restarting(o: ReplicaOptions, failed: RestartPlan, mode: str) -> None:
    log.info(
        "restarting stage %d replica %d %s (--omni-restart-policy %s)",
        o.stage_id,
        o.replica_id,
        "at once (it had served)"
        if failed.settled
        else f"in {failed.delay:g}s (it failed {_EARLY})",
        mode,
    )


class LocalReplicas:
    def __init__(
        self,
        opts: HeadOptions,
        state: ControlState,
        hooks: LocalHooks,
        *,
        master_port: int,
        local_key: str,
    ) -> None:
        """Replicas register at ``master_port`` with ``local_key``, which lets them fill
        the head-local slots (and only them)."""
        self._opts = opts
        self._coordinator = state.coordinator
        self._slots = state.slots
        self._slots_lock = state.lock
        self._hooks = hooks
        self._master_port = master_port
        self._local_key = local_key
        self.restarts = RestartPolicy(opts.restart_policy, time.monotonic)
        self.launcher: Launcher = make_launcher(
            opts.worker_backend, self._on_exit, opts.config, opts.ray_address, self._on_dying
        )
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = False
        # Every replica this head runs (or will restart), by (stage, replica) id; written
        # from the loop and from launcher threads. The lock guards the restart policy too.
        self._owned: dict[tuple[int, int], _Owned] = {}
        self._owned_lock = threading.Lock()
        self.niced = NicedLoads()

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Launch every replica this head runs itself."""
        self._loop = loop
        for sid, count in self._opts.local_replicas().items():
            for rid in range(count):
                self._launch(self._opts.local_replica(sid, rid, self._master_port, self._local_key))

    async def stop(self) -> None:
        self._stopping = True
        await asyncio.to_thread(self.launcher.stop_all, self._opts.shutdown_grace_s)

    # -- scaling (the head's loop) ---------------------------------------------------

    def owned(self, stage_id: int) -> list[int]:
        """Replica ids of the stage this head runs and is not retiring: running,
        starting, or waiting for a restart."""
        return self._ids(stage_id, retiring=False)

    def retiring(self, stage_id: int) -> list[int]:
        """Replica ids of the stage being drained away, until their process exits."""
        return self._ids(stage_id, retiring=True)

    def _ids(self, stage_id: int, retiring: bool) -> list[int]:
        with self._owned_lock:
            return sorted(
                r for (s, r), o in self._owned.items() if s == stage_id and o.retiring == retiring
            )

    def add(self, stage_id: int) -> int | None:
        """Launch one more replica of the stage, in the lowest replica id free for it;
        returns that id, or None if it could not be launched (logged)."""
        if self._stopping:
            return None
        with self._owned_lock:
            taken = {rid for sid, rid in self._owned if sid == stage_id}
        with self._slots_lock:
            rid = self._slots.reserve_local(stage_id, taken)
        try:
            options = self._opts.local_replica(stage_id, rid, self._master_port, self._local_key)
            self._launch(options)
        except Exception as exc:
            _cannot_add.warning("stage %d: cannot add replica %d: %s", stage_id, rid, exc)
            self._forget((stage_id, rid))
            return None
        return rid

    def retire(self, stage_id: int, replica_id: int, epoch: int | None) -> bool:
        """Drain replica ``replica_id`` and let it exit for good. ``epoch``: its UP
        registration, which the head stops routing to at once; None when it is not
        serving yet (then it just stops). False if the head does not run it."""
        key = (stage_id, replica_id)
        with self._owned_lock:
            owned = self._owned.get(key)
            if owned is None or owned.retiring:
                return False
            owned.retiring = True
            proc, running = owned.proc, owned.running
        if not running or proc is None:
            self._forget(key)  # waiting for a restart: it just does not come back
            return True
        if epoch is not None:
            self._coordinator.mark(key, epoch, ReplicaState.DRAINING, Reason.DRAINING, SCALED_DOWN)
        loop = self._loop
        settle = DRAIN_SETTLE_S if epoch is not None else 0.0
        if loop is None:
            proc.terminate()
            return True
        loop.call_later(settle, proc.terminate)
        kill_after = settle + proc.options.drain_timeout_s + DRAIN_KILL_GRACE_S
        loop.call_later(kill_after, self._kill_if_running, key, proc)
        return True

    def _kill_if_running(self, key: tuple[int, int], proc: ReplicaProcess) -> None:
        with self._owned_lock:
            owned = self._owned.get(key)
            still = owned is not None and owned.proc is proc and owned.running
        if still:
            log.warning("stage %d replica %d did not drain in time; killing it", *key)
            proc.kill()

    def _forget(self, key: tuple[int, int]) -> None:
        """Drop a replica the head no longer runs, and give its slot back."""
        with self._owned_lock:
            self._owned.pop(key, None)
        self._due(key, None)
        with self._slots_lock:
            self._slots.unreserve(*key)

    def came_up(self, key: tuple[int, int]) -> None:
        """Any thread: a replica of this head's reached UP (the restart policy's clock
        for telling a crash loop from bad luck starts)."""
        with self._owned_lock:
            if key in self._owned:
                self.restarts.up(key)
                self._owned[key].up = True
        self.niced.done(key)

    def _due(self, key: tuple[int, int], delay: float | None) -> None:
        """Tell the stage's pool (on the loop): ``key`` restarts in ``delay`` s (None: not)."""
        if self._loop is not None:
            at = None if delay is None else time.monotonic() + delay
            self._loop.call_soon_threadsafe(self._hooks.on_restart_due, *key, at)

    # -- launching and exits -----------------------------------------------------------

    def _launch(self, options: ReplicaOptions) -> None:
        if self._stopping:
            return
        key = (options.stage_id, options.replica_id)
        with self._owned_lock:
            owned = self._owned.setdefault(key, _Owned(options))
            if owned.retiring:
                return
            owned.options, owned.up, owned.failed = options, False, None
            self.restarts.started(key)
        proc = self.launcher.launch(options)
        with self._owned_lock:
            owned.proc, owned.running = proc, True
        self.niced.launched(key, proc, options.load_nice, self._loop)

    def _relaunch(self, options: ReplicaOptions) -> None:
        with self._owned_lock:
            owned = self._owned.get((options.stage_id, options.replica_id))
        if owned is None or owned.retiring:
            return
        if not self._stopping:
            self._hooks.on_restart(options.stage_id, options.replica_id)
        # With another replica of the stage serving here, the restart loads niced, not to
        # take the cores that replica answers on, for a while (head.niced_loads); with
        # none, the stage waits on it, and it loads at full priority.
        nice = envs.load_nice() if self._serving_here(options.stage_id) else 0
        options = msgspec.structs.replace(options, load_nice=nice)
        try:
            self._launch(options)
        except Exception as exc:  # Ray refused the actor, say: nothing is coming now
            key = (options.stage_id, options.replica_id)
            log.error("stage %d replica %d: restart failed: %s", *key, exc)
            with self._owned_lock:
                self._owned.pop(key, None)  # gone for good; its slot stays the head's
            self._due(key, None)

    def _serving_here(self, stage_id: int) -> bool:
        """Whether another of this head's replicas of ``stage_id`` is UP."""
        with self._owned_lock:
            return any(o.up and o.running for (s, _), o in self._owned.items() if s == stage_id)

    def _on_dying(self, proc: ReplicaProcess) -> None:
        """Launcher thread: a local replica was killed; its process is still exiting
        (``launch.death_watch``). It fails now (ERROR: its requests fail over at once);
        its restart waits for the exit, the process still holding memory and devices."""
        key = (proc.options.stage_id, proc.options.replica_id)
        with self._owned_lock:
            owned = self._owned.get(key)
            if owned is None or owned.proc is not proc or owned.retiring:
                return
        if not self._stopping and self._hooks.is_serving():  # start-up failures: at exit
            owned.failed = self._fail(key, "killed, still exiting")  # read by this thread only

    def _on_exit(self, proc: ReplicaProcess, code: int) -> None:
        """Launcher thread: a local replica process ended."""
        o = proc.options
        key = (o.stage_id, o.replica_id)
        with self._owned_lock:
            owned = self._owned.get(key)
            failed = None
            if owned is not None and owned.proc is proc:
                owned.running = False
                failed, owned.failed = owned.failed, None
            retiring = owned is not None and owned.retiring
        if retiring:
            self._retired(key, code)
            return
        if failed is None and code != 0 and not self._hooks.is_serving() and not self._stopping:
            # A replica that cannot even start has a configuration or install problem
            # that neither waiting out --init-timeout nor a restart fixes: fail now.
            _start_failed(o, self._opts.config.stage(o.stage_id).name, code)
            self._hooks.fail_head()
            return
        if failed is None:
            failed = self._fail(key, f"exit code {code}", code)
        if self._stopping:
            return
        if failed.delay is None:
            with self._owned_lock:
                self._owned.pop(key, None)  # gone for good; its slot stays the head's
            self._due(key, None)
            return
        if self._loop is not None:
            _restarting(o, failed, self.restarts.mode)
            loop, delay = self._loop, self.restarts.left(failed)
            loop.call_soon_threadsafe(lambda: loop.call_later(delay, self._relaunch, o))

    def _fail(self, key: tuple[int, int], detail: str, code: int = -9) -> RestartPlan:
        """``key`` failed (its process exited with ``code``, or was killed): when it
        restarts, announced, and ERROR, once per process."""
        plan = NO_RESTART
        if not self._stopping:
            with self._owned_lock:
                plan = self.restarts.after_exit(key, code)
            if plan.delay is not None:
                # Before the ERROR below, through the same loop queue: a request never
                # sees the stage with nothing live and nothing coming in between.
                self._due(key, plan.delay)
        self._coordinator.mark(key, None, ReplicaState.ERROR, Reason.PROCESS_EXITED, detail)
        if not self._stopping:
            self.niced.exited(key, stage_serving=self._serving_here(key[0]))
        return plan

    def _retired(self, key: tuple[int, int], code: int) -> None:
        """A replica the head retired has exited: it is gone for good (DOWN), whatever
        its exit code, and is not restarted under any --omni-restart-policy."""
        level = logging.INFO if code == 0 else logging.WARNING
        log.log(level, "stage %d replica %d retired (exit code %d)", *key, code)
        # Its own DOWN heartbeat usually came first; this covers one that did not.
        self._coordinator.mark(key, None, ReplicaState.DOWN, Reason.SHUT_DOWN, SCALED_DOWN)
        self._forget(key)
