"""``--api-server-count N``: N API server processes share the head's HTTP socket.

Each runs the HTTP API (parsing, validation, streaming, the response) and hands the
request to the head's orchestrator through ``FrontendServer``; the head itself then
serves no HTTP. One that exits while the head is up is started again, with the
replicas' rule (``launch/restart.py``): at once after a run of ``SETTLE_S``, else with
backoff.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import subprocess
import sys
import threading
import time

from omnistage.api.server_options import ApiServerOptions, encode_options
from omnistage.head.options import HeadOptions
from omnistage.launch.local import die_with_parent
from omnistage.launch.restart import RestartPolicy

log = logging.getLogger(__name__)


class ApiServers:
    def __init__(
        self, opts: HeadOptions, http_socket: socket.socket, head_address: str, started_at: int
    ) -> None:
        self._opts = opts
        self._socket = http_socket
        self._head_address = head_address
        self._started_at = started_at
        self._procs: dict[int, subprocess.Popen[bytes]] = {}
        self._lock = threading.Lock()
        self._stopping = False
        self.restarts = RestartPolicy("always", time.monotonic)

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        for index in range(self._opts.api_server_count):
            self._launch(index)
        log.info(
            "%d API server processes serve http://%s:%d",
            self._opts.api_server_count,
            self._opts.host,
            self._opts.port,
        )

    def _launch(self, index: int) -> None:
        if self._stopping:
            return
        options = ApiServerOptions(
            index=index,
            listen_fd=self._socket.fileno(),
            head_address=self._head_address,
            config=self._opts.config.model_dump(mode="json"),
            started_at=self._started_at,
            api_key=self._opts.api_key,
            max_request_bytes=self._opts.max_request_bytes,
            realtime_max_sessions=self._opts.realtime_max_sessions,
            realtime_idle_timeout_s=self._opts.realtime_idle_timeout_s,
            realtime_resume_ttl_s=self._opts.realtime_resume_ttl_s,
            allowed_media_domains=self._opts.allowed_media_domains,
            media_fetch_timeout_s=self._opts.media_fetch_timeout_s,
            media_fetch_max_bytes=self._opts.media_fetch_max_bytes,
            log_level=self._opts.log_level,
            served_model_names=self._opts.served_model_names,
            store_url=self._opts.store_url,
            media_url=self._opts.media_url,
            media_ttl_s=self._opts.media_ttl_s,
        )
        env = dict(os.environ, OMNISTAGE_API_SERVER_OPTIONS=encode_options(options))
        proc = subprocess.Popen(
            [sys.executable, "-m", "omnistage.api.server"],
            env=env,
            pass_fds=[self._socket.fileno()],
            preexec_fn=die_with_parent,
        )
        # An API server has no UP of its own to report: it serves once its process runs.
        # So its run counts from the launch, and one that lived SETTLE_S before it died
        # (a kill, an out-of-memory kill) is started again at once; one that dies sooner
        # (a bad option, a broken install) backs off as a crash loop.
        self.restarts.started(("api", index))
        self.restarts.up(("api", index))
        with self._lock:
            self._procs[index] = proc
        threading.Thread(
            target=self._watch, args=(index, proc), name=f"omni-api-{index}", daemon=True
        ).start()

    def _watch(self, index: int, proc: subprocess.Popen[bytes]) -> None:
        code = proc.wait()
        if self._stopping:
            return
        delay = self.restarts.delay_after_exit(("api", index), code) or 0.0
        log.warning(
            "API server %d (pid %d) exited with code %d; starting it again in %.0fs",
            index,
            proc.pid,
            code,
            delay,
        )
        loop = self._loop
        loop.call_soon_threadsafe(lambda: loop.call_later(delay, self._launch, index))

    async def stop(self, grace_s: float) -> None:
        """SIGTERM: each finishes its HTTP requests in flight; SIGKILL after ``grace_s``."""
        self._stopping = True
        with self._lock:
            procs = list(self._procs.values())
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
        await asyncio.to_thread(_wait_all, procs, grace_s)


def _wait_all(procs: list[subprocess.Popen[bytes]], grace_s: float) -> None:
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("API server pid %d did not stop in %.0fs; killing it", proc.pid, grace_s)
            proc.kill()
            proc.wait(5)
