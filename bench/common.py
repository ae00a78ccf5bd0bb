"""What the benchmarks share: free ports, server processes that are always cleaned up, and
the small pieces of their command lines and reports that are the same in each."""

import argparse
import contextlib
import http.client
import json
import math
import multiprocessing
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO, Any

HOST = "127.0.0.1"


def haproxy_servers(ports: list[int]) -> str:
    """haproxy ``server`` lines for heads on these ports, named a, b, ...: health-checked
    every 200 ms, out at the first failed check, back after two good ones."""
    return "\n".join(
        f"    server {'abcdefgh'[i]} {HOST}:{p} check inter 200ms fall 1 rise 2"
        for i, p in enumerate(ports)
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


class ServerProcess:
    """A command in its own process group, its output in a temporary file (or a given one).

    The own group lets ``stop`` reap whatever the command started (a head's local
    replicas) even when the command itself is gone, and keeps a Ctrl-C in the terminal
    from reaching the servers before the benchmark has stopped them in order.
    """

    def __init__(
        self,
        name: str,
        cmd: list[str],
        port: int | None = None,
        *,
        log_path: Path | None = None,
        pdeathsig: bool = False,
    ) -> None:
        """``log_path``: the output there (kept), not in a temporary file. ``pdeathsig``:
        SIGKILLed by the kernel if the benchmark dies first (``setpriv --pdeathsig``,
        where setpriv exists); then start it from the main thread: the signal follows
        the thread that forked, not the process."""
        self.name, self.cmd, self.port = name, cmd, port
        log = open(log_path, "w+b") if log_path else tempfile.TemporaryFile()  # noqa: SIM115
        self.log: IO[bytes] = log  # closed in stop
        prefix = (
            ["setpriv", "--pdeathsig", "KILL", "--"]
            if pdeathsig and shutil.which("setpriv")
            else []
        )
        self.proc = subprocess.Popen(
            [*prefix, *cmd],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
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

    def kill(self) -> None:
        """SIGKILL to the whole group, now (a crash, not a stop: the log stays open)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(5.0)

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


def http_post(port: int, path: str, body: bytes) -> bytes:
    """The bytes of one HTTP/1.1 keep-alive POST of a JSON ``body`` to 127.0.0.1:port."""
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {HOST}:{port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


def rss_kib(pid: int) -> int | None:
    """VmRSS of a process in KiB (from /proc/<pid>/status); None once it is gone."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"VmRSS:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None


@contextlib.contextmanager
def loopback_ray_cluster(num_cpus: int = 2) -> Iterator[str]:
    """A one-node Ray cluster on 127.0.0.1 (no dashboard, workers at nice 0) for a head's
    ``--ray-address``; yields its address and shuts it down however the block ends."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True,
        connect=False,
        head_node_args={
            "node_ip_address": HOST,
            "num_cpus": num_cpus,
            "include_dashboard": False,
            "object_store_memory": 80 * 1024 * 1024,
            "_system_config": {"worker_niceness": 0},
        },
    )
    try:
        yield cluster.address
    finally:
        cluster.shutdown()


def parent_pid(pid: int) -> int:
    """From /proc/<pid>/stat (the name in parentheses may hold spaces and parentheses)."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        return int(f.read().rsplit(b")", 1)[1].split()[1])


# -- command line, figures and reports ----------------------------------------------------


def add_common_args(
    p: argparse.ArgumentParser, health_timeout: float, request_timeout: float
) -> None:
    """--health-timeout, --request-timeout and --json, with the given defaults."""
    p.add_argument(
        "--health-timeout", type=float, default=health_timeout, help="seconds to get ready"
    )
    p.add_argument(
        "--request-timeout", type=float, default=request_timeout, help="seconds per request"
    )
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")


def exit_on_sigterm() -> None:
    """SIGTERM unwinds like Ctrl-C, so that the finally blocks stop the servers."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


def machine() -> str:
    return f"python {platform.python_version()}, {os.cpu_count()} CPUs"


def pct(sorted_xs: list[float], p: float) -> float:
    """Nearest-rank percentile of an ascending, non-empty list."""
    return sorted_xs[min(len(sorted_xs), max(1, math.ceil(p / 100 * len(sorted_xs)))) - 1]


def describe(exc: BaseException, timeout: float | None = None) -> str:
    """One failure as a line of text: the first of a group's, and for a TimeoutError the
    ``timeout`` it ran out of, if given."""
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    text = f"{type(exc).__name__}: {exc}" if str(exc) else repr(exc)
    if timeout is not None and isinstance(exc, TimeoutError):
        text += f" (no answer within {timeout:g}s)"
    return text


def write_json(
    path: str, args: argparse.Namespace, sections: dict[str, Any], skip: Iterable[str] = ()
) -> None:
    """The machine, the settings (``args`` but --json and ``skip``), then ``sections``."""
    skipped = {"json", *skip}
    doc = {
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "settings": {k: v for k, v in vars(args).items() if k not in skipped},
        **sections,
    }
    with open(path, "w") as f:
        json.dump(doc, f, indent=2, default=str)  # paths among the settings


def _spin() -> None:
    while True:
        pass


@contextlib.contextmanager
def spinning(count: int) -> Iterator[None]:
    """``count`` processes spinning at nice 0 meanwhile: a busy machine."""
    spinners = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(count)]
    for s in spinners:
        s.start()
    try:
        yield
    finally:
        for s in spinners:
            s.kill()
