"""Real omnistage processes for integration tests: start, wait, inspect, stop."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def dialled_port() -> int:
    """A free port for a server that clients dial before it binds (a head others
    announce to before it starts). Not one the kernel hands out as a client's source
    port (``free_port``'s are): a client dialling such a port on 127.0.0.1 while nothing
    listens can draw it as its own source port and connect to itself, TCP's
    simultaneous open, and then hold it, so the server cannot bind. This took a head's
    master port in a CI run."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    rng = random.Random()
    for _ in range(100):
        port = rng.randrange(10_000, low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port between 10000 and {low}")


def wait_for(
    cond: Callable[[], Any], timeout: float, interval: float = 0.05, what: str = ""
) -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = cond()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what or cond}: last={last!r}")


class Proc:
    """An ``omnistage`` command in its own process group, logging to a file."""

    def __init__(self, args: list[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        self.args = args
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "omnistage", *args],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, **(env or {})},
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            os.kill(self.proc.pid, sig)

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout)

    def stop(self, grace: float = 10.0) -> int | None:
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                pass
        # Whatever is left of the process group (replica children) goes too.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)
        self._log.close()
        return self.proc.returncode


class HeadProc(Proc):
    def __init__(self, tmp: Path, *args: str, name: str = "head", port: int | None = None) -> None:
        self.port = port or free_port()
        self.master_port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        base = ["serve", *args, "--port", str(self.port)]
        if "-omp" not in args:
            base += ["-oma", "127.0.0.1", "-omp", str(self.master_port)]
        else:
            self.master_port = int(args[list(args).index("-omp") + 1])
        super().__init__(base, tmp / f"{name}.log")
        self.client = httpx.Client(base_url=self.url, timeout=30)

    def wait_healthy(self, timeout: float = 30) -> None:
        def healthy() -> bool:
            if not self.alive():
                raise AssertionError(f"head exited early:\n{self.log()[-3000:]}")
            try:
                return self.client.get("/health").status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(healthy, timeout, 0.1, "head /health == 200")

    def wait_http(self, timeout: float = 30) -> None:
        def up() -> bool:
            try:
                self.client.get("/health")
                return True
            except httpx.HTTPError:
                return False

        wait_for(up, timeout, 0.1, "head HTTP up")

    def stages(self) -> dict[str, Any]:
        return self.client.get("/v1/omni/stages").json()

    def replicas(self, stage_id: int) -> list[dict[str, Any]]:
        for stage in self.stages()["stages"]:
            if stage["stage_id"] == stage_id:
                return stage["replicas"]
        raise KeyError(stage_id)

    def up_replicas(self, stage_id: int) -> list[dict[str, Any]]:
        return [r for r in self.replicas(stage_id) if r["state"] == "UP"]

    def wait_up(
        self, stage_id: int, count: int, timeout: float = 20, what: str = ""
    ) -> list[dict[str, Any]]:
        """Until exactly ``count`` (>= 1) replicas of ``stage_id`` are UP; returns them."""

        def up() -> list[dict[str, Any]] | None:
            replicas = self.up_replicas(stage_id)
            return replicas if len(replicas) == count else None

        return wait_for(up, timeout, what=what or f"{count} UP replicas of stage {stage_id}")

    def up_replica_of(self, stage_id: int, proc: Proc) -> dict[str, Any]:
        """The UP replica of ``stage_id`` whose process is ``proc``."""
        return next(r for r in self.up_replicas(stage_id) if r["pid"] == proc.pid)

    def chat(self, text: str, **extra: Any) -> httpx.Response:
        body = {"messages": [{"role": "user", "content": text}], **extra}
        return self.client.post("/v1/chat/completions", json=body)

    def stop(self, grace: float = 10.0) -> int | None:
        self.client.close()
        return super().stop(grace)


def headless(tmp: Path, head: HeadProc, stage_id: int, *extra: str, name: str = "") -> Proc:
    args = [
        "serve",
        "--headless",
        "--stage-id",
        str(stage_id),
        "-oma",
        "127.0.0.1",
        "-omp",
        str(head.master_port),
        *extra,
    ]
    return Proc(args, tmp / f"{name or f'headless-{stage_id}-{time.monotonic_ns()}'}.log")


class SteadyLoad:
    """``workers`` threads posting chat completions back to back, from start() to stop().

    Every request's text is unique; an answer counts in ``ok`` only if it is a 200 whose
    content is exactly ``expect(text)``. Any other answer or failure is kept in ``errors``;
    a request that times out (``timeout`` s) counts in ``hung``, and so does a worker still
    busy ``join_timeout`` s after stop().
    """

    def __init__(
        self,
        url: str,
        expect: Callable[[str], str],
        workers: int = 3,
        timeout: float = 15,
        join_timeout: float = 30,
    ) -> None:
        self.url, self.expect, self.timeout, self.join_timeout = url, expect, timeout, join_timeout
        self.ok = 0
        self.errors: list[str] = []
        self.hung = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._worker, args=(n,), daemon=True) for n in range(workers)
        ]

    def start(self) -> SteadyLoad:
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> SteadyLoad:
        """Stops the workers after their current request; safe to call twice."""
        if not self._stop.is_set():
            self._stop.set()
            for t in self._threads:
                t.join(self.join_timeout)
            with self._lock:
                self.hung += sum(t.is_alive() for t in self._threads)
        return self

    def _one(self, client: httpx.Client, text: str) -> str | None:
        """None if the answer is right, else what was wrong with it."""
        r = client.post(
            "/v1/chat/completions", json={"messages": [{"role": "user", "content": text}]}
        )
        if r.status_code != 200:
            return f"{text}: {r.status_code} {r.text[:200]}"
        try:
            content = r.json()["choices"][0]["message"]["content"]
        except (ValueError, LookupError, TypeError):
            content = None
        if content != self.expect(text):
            return f"{text}: wrong answer {r.text[:200]}"
        return None

    def _worker(self, n: int) -> None:
        with httpx.Client(base_url=self.url, timeout=self.timeout) as client:
            i = 0
            while not self._stop.is_set():
                i += 1
                text = f"w{n} r{i}"
                try:
                    error = self._one(client, text)
                except httpx.TimeoutException:
                    with self._lock:
                        self.hung += 1
                    continue
                except Exception as e:
                    error = f"{text}: {e!r}"
                with self._lock:
                    if error is None:
                        self.ok += 1
                    else:
                        self.errors.append(error)
