"""A head and a headless replica on two "hosts": network namespaces joined by a veth pair.

The replica auto-detects the address it advertises; pulling the link marks it ERROR
while the head's own replica carries the traffic, and restoring the link brings it back.
Needs root (``ip netns``); skipped elsewhere.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from omnistage.cli.args import HEARTBEAT_INTERVAL_S
from tests.integration.harness import HeadProc, Proc, SteadyLoad, wait_for

TOKEN = "multihost test token"
HEARTBEAT_TIMEOUT_S = 2.0
HTTP_PORT = 8091  # inside the head namespace, where nothing else listens
MASTER_PORT = 29555

# Relays connections accepted on an inherited listening socket (created by the test in
# its own network namespace) to 127.0.0.1:<port> in the namespace this process runs in.
FORWARDER = r"""
import socket, sys, threading

listener = socket.socket(fileno=int(sys.argv[1]))
port = int(sys.argv[2])

def pump(src, dst):
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

def relay(client):
    try:
        upstream = socket.create_connection(("127.0.0.1", port), timeout=5)
    except OSError:
        client.close()
        return
    upstream.settimeout(None)
    threading.Thread(target=pump, args=(upstream, client), daemon=True).start()
    pump(client, upstream)

while True:
    conn, _ = listener.accept()
    threading.Thread(target=relay, args=(conn,), daemon=True).start()
"""


def _ip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10)


def _ip_ok(*args: str) -> None:
    r = _ip(*args)
    assert r.returncode == 0, f"ip {' '.join(args)} failed: {r.stderr.strip()}"


_SEQ = itertools.count()


@dataclass
class Hosts:
    head_ns: str
    replica_ns: str
    head_ip: str
    replica_ip: str
    replica_link: str  # the veth end inside the replica namespace
    procs: list[Proc] = field(default_factory=list)


@pytest.fixture
def hosts() -> Iterator[Hosts]:
    with two_hosts() as h:
        yield h


@contextlib.contextmanager
def two_hosts() -> Iterator[Hosts]:
    """Two namespaces joined by a veth pair (skips the test without root or ``ip``); the
    processes in ``Hosts.procs`` are stopped on the way out."""
    if os.geteuid() != 0:
        pytest.skip("multi-host test needs root for ip netns (CI runs it as root)")
    if shutil.which("ip") is None:
        pytest.skip("multi-host test needs the ip command (iproute2)")
    pid, seq = os.getpid(), next(_SEQ)
    n = pid % 250 + 1
    h = Hosts(
        head_ns=f"omni-head-{pid}-{seq}",
        replica_ns=f"omni-repl-{pid}-{seq}",
        head_ip=f"10.213.{n}.1",
        replica_ip=f"10.213.{n}.2",
        replica_link=f"omr{pid}x{seq}",  # interface names: 15 characters at most
    )
    created: list[str] = []
    try:
        for ns in (h.head_ns, h.replica_ns):
            r = _ip("netns", "add", ns)
            if r.returncode != 0:
                pytest.skip(f"ip netns add failed ({r.stderr.strip()}): no namespace support")
            created.append(ns)
        head_link = f"omh{pid}x{seq}"
        # Both ends are created directly inside the namespaces: nothing in ours changes.
        _ip_ok(
            "-n", h.head_ns, "link", "add", head_link, "type", "veth",
            "peer", "name", h.replica_link, "netns", h.replica_ns,
        )  # fmt: skip
        for ns, link, ip in (
            (h.head_ns, head_link, h.head_ip),
            (h.replica_ns, h.replica_link, h.replica_ip),
        ):
            _ip_ok("-n", ns, "addr", "add", f"{ip}/24", "dev", link)
            _ip_ok("-n", ns, "link", "set", link, "up")
            _ip_ok("-n", ns, "link", "set", "lo", "up")
        yield h
    finally:
        try:
            for p in h.procs:
                p.stop()
        finally:
            for ns in created:
                _ip("netns", "del", ns)


class NsProc(Proc):
    """Like :class:`Proc`, but ``ip netns exec``-ed into a namespace (same pid: it execs)."""

    def __init__(self, ns: str, argv: list[str], log_path: Path, **popen: Any) -> None:
        self.args = argv
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            ["ip", "netns", "exec", ns, *argv],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            **popen,
        )


def omnistage(ns: str, log_path: Path, *args: str) -> NsProc:
    return NsProc(ns, [sys.executable, "-m", "omnistage", *args], log_path)


class NsHead(NsProc):
    """The head in its namespace, reached through a relay on our loopback."""

    stages = HeadProc.stages
    replicas = HeadProc.replicas
    up_replicas = HeadProc.up_replicas
    chat = HeadProc.chat
    wait_healthy = HeadProc.wait_healthy

    def __init__(self, hosts: Hosts, tmp: Path, *args: str) -> None:
        argv = [sys.executable, "-m", "omnistage", "serve", *args, "--port", str(HTTP_PORT)]
        super().__init__(hosts.head_ns, argv, tmp / "head.log")
        hosts.procs.append(self)
        listener = socket.create_server(("127.0.0.1", 0))
        try:
            relay = NsProc(
                hosts.head_ns,
                [sys.executable, "-c", FORWARDER, str(listener.fileno()), str(HTTP_PORT)],
                tmp / "relay.log",
                pass_fds=(listener.fileno(),),
            )
            hosts.procs.append(relay)
            self.url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        finally:
            listener.close()  # the relay holds its own copy
        self.client = httpx.Client(base_url=self.url, timeout=30)

    def stop(self, grace: float = 10.0) -> int | None:
        self.client.close()
        return super().stop(grace)


def _logs(*procs: Proc) -> str:
    return "".join(f"\n--- {p.log_path.name} (tail) ---\n{p.log()[-3000:]}" for p in procs)


@pytest.mark.parametrize("outage", ["short", "long"])
def test_replica_on_another_host_survives_a_link_outage(
    hosts: Hosts, tmp_path: Path, outage: str
) -> None:
    """short: the link is back before the replica gives up on the head (its heartbeats
    resume, or it registers again: both are fine). long: the link stays down until the
    replica gives up on the head, so it must register again, from the right address."""
    master = ["-oma", hosts.head_ip, "-omp", str(MASTER_PORT), "--omni-auth-token", TOKEN]
    head = NsHead(
        hosts,
        tmp_path,
        "echo-1stage",
        "--stage-id",
        "0",
        "--host",
        "0.0.0.0",
        *master,
        "--omni-heartbeat-timeout",
        str(HEARTBEAT_TIMEOUT_S),
        "--omni-lb-policy",
        "round-robin",
    )
    head.wait_healthy()
    # No -ora: the replica must find 10.213.n.2 itself (the route towards the master).
    replica = omnistage(
        hosts.replica_ns, tmp_path / "replica.log", "serve", "--headless", "--stage-id", "0",
        *master,
    )  # fmt: skip
    hosts.procs.append(replica)

    def logs() -> str:
        try:
            stages = head.stages()
        except (httpx.HTTPError, ValueError) as e:
            stages = repr(e)
        return f"\nstages: {stages}{_logs(head, replica)}"

    def wait(cond: Callable[[], Any], timeout: float, what: str) -> Any:
        try:
            return wait_for(cond, timeout, 0.05, what)
        except AssertionError as e:
            raise AssertionError(f"{e}{logs()}") from None

    def remote() -> dict[str, Any] | None:
        """The newest stage-0 entry advertising the replica namespace's address."""
        if not replica.alive():
            raise AssertionError(f"replica exited with {replica.proc.returncode}{logs()}")
        found = [r for r in head.replicas(0) if r["address"] == hosts.replica_ip]
        return max(found, key=lambda r: r["epoch"]) if found else None

    def remote_state() -> str | None:
        entry = remote()
        return entry["state"] if entry else None

    def serve_round(label: str, count: int) -> None:
        for i in range(count):
            r = head.chat(f"{label} {i}")
            assert r.status_code == 200, f"{label} {i}: {r.status_code} {r.text}{logs()}"
            assert r.json()["choices"][0]["message"]["content"] == f"{label} {i} [echo]"

    def serves(label: str) -> bool:
        """A round of requests reaches the UP replica at the remote address."""
        start = remote()
        if start is None or start["state"] != "UP":
            return False
        serve_round(label, 4)  # round-robin over two replicas: two of them are its
        end = remote()
        return (
            end is not None
            and end["state"] == "UP"
            and end["epoch"] == start["epoch"]
            and end["dispatched_total"] >= start["dispatched_total"] + 2
        )

    wait(lambda: remote_state() == "UP", 20, f"replica at {hosts.replica_ip} UP")
    first = remote()
    assert first is not None and not first["local"], logs()
    assert [r["state"] for r in head.replicas(0) if r["local"]] == ["UP"], logs()
    assert len(head.replicas(0)) == 2, logs()
    assert serves("before"), logs()

    # Pull the link, with requests in flight.
    load = SteadyLoad(head.url, lambda text: f"{text} [echo]", timeout=20).start()
    try:
        wait(lambda: load.ok >= 6, 10, "load running before the outage")
        _ip_ok("-n", hosts.replica_ns, "link", "set", hosts.replica_link, "down")
        down_at = time.monotonic()
        wait(lambda: remote_state() == "ERROR", HEARTBEAT_TIMEOUT_S + 1.5, "ERROR")
        detected_after = time.monotonic() - down_at
        ok_at_error = load.ok
        wait(lambda: load.ok >= ok_at_error + 10, 10, "traffic during the outage")
    finally:
        load.stop()
    assert load.hung == 0, f"{load.hung} requests hung{logs()}"
    assert load.errors == [], f"{load.errors[:5]}{logs()}"
    # Found by silence: the last heartbeat got through at most one interval before the cut.
    assert detected_after >= HEARTBEAT_TIMEOUT_S - HEARTBEAT_INTERVAL_S - 0.2, detected_after
    serve_round("during", 6)  # the head's own replica serves alone
    if outage == "long":
        # The replica stops trusting a head that has not answered for 2x the timeout.
        wait(lambda: "lost the head" in replica.log(), 3 * HEARTBEAT_TIMEOUT_S, "lost the head")
        serve_round("still down", 4)
    assert remote_state() == "ERROR", logs()

    # Restore the link: it is UP again at the same address and gets traffic.
    _ip_ok("-n", hosts.replica_ns, "link", "set", hosts.replica_link, "up")
    wait(lambda: serves("after"), 15, f"replica at {hosts.replica_ip} UP and serving again")
    back = remote()
    assert back is not None and not back["local"], logs()
    assert replica.alive(), logs()
    assert [r["state"] for r in head.replicas(0)] == ["UP", "UP"], logs()
    if outage == "long" or back["epoch"] != first["epoch"]:
        assert back["epoch"] != first["epoch"], logs()
        assert "rejoined the head" in replica.log(), logs()
    else:
        assert "heartbeats resumed" in head.log(), logs()
