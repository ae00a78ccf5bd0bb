"""The head's own replicas: launched into the head-local slots, restarted with backoff
when they exit (``--omni-restart-policy``), and a failed start fails the head at once."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from omnistage.control.coordinator import Coordinator
from omnistage.head.options import HeadOptions
from omnistage.launch.base import Launcher, ReplicaProcess
from omnistage.launch.local import LocalLauncher
from omnistage.launch.restart import RestartPolicy
from omnistage.protocol.messages import Reason, ReplicaState
from omnistage.replica.options import ReplicaOptions

log = logging.getLogger(__name__)


class LocalReplicas:
    def __init__(
        self,
        opts: HeadOptions,
        coordinator: Coordinator,
        master_port: int,
        local_key: str,
        is_serving: Callable[[], bool],
        fail_head: Callable[[], None],
        on_restart: Callable[[int, int], None] = lambda stage_id, replica_id: None,
    ) -> None:
        self._on_restart = on_restart
        self._opts = opts
        self._coordinator = coordinator
        self._master_port = master_port
        self._local_key = local_key
        self._is_serving = is_serving
        self._fail_head = fail_head
        self.restarts = RestartPolicy(opts.restart_policy, time.monotonic)
        self.launcher: Launcher = LocalLauncher(on_exit=self._on_exit)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = False

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Launch every replica this head runs itself."""
        self._loop = loop
        for sid, count in self._opts.local_replicas().items():
            for rid in range(count):
                self._launch(self._opts.local_replica(sid, rid, self._master_port, self._local_key))

    async def stop(self) -> None:
        self._stopping = True
        await asyncio.to_thread(self.launcher.stop_all, self._opts.shutdown_grace_s)

    def _launch(self, options: ReplicaOptions) -> None:
        if self._stopping:
            return
        self.restarts.started((options.stage_id, options.replica_id))
        self.launcher.launch(options)

    def _relaunch(self, options: ReplicaOptions) -> None:
        if not self._stopping:
            self._on_restart(options.stage_id, options.replica_id)
        self._launch(options)

    def _on_exit(self, proc: ReplicaProcess, code: int) -> None:
        """Launcher thread: a local replica process ended."""
        o = proc.options
        key = (o.stage_id, o.replica_id)
        if code != 0 and not self._is_serving() and not self._stopping:
            # A replica that cannot even start has a configuration or install problem
            # that neither waiting out --init-timeout nor a restart fixes: fail now,
            # pointing at the replica's own error above.
            log.error(
                "stage %d (%s) replica %d exited with code %d while starting; see its "
                "log lines above. Shutting down.",
                o.stage_id,
                self._opts.config.stage(o.stage_id).name,
                o.replica_id,
                code,
            )
            self._fail_head()
            return
        self._coordinator.mark(
            key, None, ReplicaState.ERROR, Reason.PROCESS_EXITED, f"exit code {code}"
        )
        if self._stopping:
            return
        delay = self.restarts.delay_after_exit(key, code)
        if delay is not None and self._loop is not None:
            log.info(
                "restarting stage %d replica %d in %.0fs (--omni-restart-policy %s)",
                o.stage_id,
                o.replica_id,
                delay,
                self.restarts.mode,
            )
            loop = self._loop
            loop.call_soon_threadsafe(lambda: loop.call_later(delay, self._relaunch, o))
