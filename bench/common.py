"""What the benchmarks share: free ports and server processes that are always cleaned up."""

import contextlib
import http.client
import os
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from typing import IO

HOST = "127.0.0.1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


class ServerProcess:
    """A command in its own process group, its output in a temporary file.

    The own group lets ``stop`` reap whatever the command started (a head's local
    replicas) even when the command itself is gone, and keeps a Ctrl-C in the terminal
    from reaching the servers before the benchmark has stopped them in order.
    """

    def __init__(self, name: str, cmd: list[str], port: int | None = None) -> None:
        self.name, self.cmd, self.port = name, cmd, port
        self.log: IO[bytes] = tempfile.TemporaryFile()  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(
            cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_text(self) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")

    def log_tail(self, n: int = 2000) -> str:
        tail = self.log_text()[-n:].rstrip()
        return f"\n{tail}" if tail else ""

    def wait_ready(
        self,
        timeout: float,
        path: str = "/health",
        body: bytes | None = None,
        interval: float = 0.2,
    ) -> None:
        """Until ``path`` answers 200 (a POST of ``body`` if given, else a GET)."""
        url = f"http://{HOST}:{self.port}{path}"
        deadline, last = time.monotonic() + timeout, "no answer"
        while time.monotonic() < deadline:
            if not self.alive():
                raise RuntimeError(f"exited with {self.proc.returncode}{self.log_tail()}")
            req = urllib.request.Request(url, data=body, method="POST" if body else "GET")
            if body:
                req.add_header("Content-Type", "application/json")
            try:
                with urllib.request.urlopen(req, timeout=2.0) as resp:
                    if resp.status == 200:
                        return
                    last = f"HTTP {resp.status}"
            except (OSError, http.client.HTTPException) as exc:
                last = str(exc)
            time.sleep(interval)
        raise RuntimeError(f"not ready after {timeout:.0f}s ({last}){self.log_tail()}")

    def stop(self, grace: float = 15.0) -> None:
        """SIGTERM, then SIGKILL to the whole group after ``grace`` s; safe to call twice."""
        if self.log.closed:
            return
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                print(f"! {self.name}: no exit {grace:.0f}s after SIGTERM, killing")
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5.0)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, 0)  # raises if no process of the group is left
            print(f"! {self.name}: processes left after it exited, killing")
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.log.close()
