"""Garbage on the control sockets never takes the head down nor disturbs live replicas."""

from __future__ import annotations

import os
import random
import time
from pathlib import Path

import msgspec
import zmq

from omnistage.protocol import codec
from omnistage.protocol.messages import Heartbeat
from tests.integration.harness import HeadProc


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _registration_ok(port: int) -> bool:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(f"tcp://127.0.0.1:{port}")
        sock.send(msgspec.msgpack.encode({"stage_id": 0, "replica_id": -1}))
        if not sock.poll(5000):
            return False
        return "handshake_address" in msgspec.msgpack.decode(sock.recv())
    finally:
        sock.close()


def test_floods_of_garbage_leave_master_coordinator_and_replicas_alone(tmp_path: Path) -> None:
    head = HeadProc(tmp_path, "echo-1stage", "--omni-heartbeat-timeout", "3")
    rng = random.Random(7)
    ctx = zmq.Context.instance()
    try:
        head.wait_healthy()
        (replica,) = head.up_replicas(0)
        coordinator = head.stages()["master_address"]  # same host; find the coordinator:
        assert coordinator.startswith("tcp://127.0.0.1:")
        # The coordinator address is handed out in registration replies.
        probe = ctx.socket(zmq.DEALER)
        probe.setsockopt(zmq.LINGER, 0)
        probe.connect(f"tcp://127.0.0.1:{head.master_port}")
        probe.send(msgspec.msgpack.encode({"stage_id": 0, "replica_id": -1}))
        assert probe.poll(5000)
        coord_url = msgspec.msgpack.decode(probe.recv())["coordinator_router_address"]
        probe.close()
        rss_before = _rss_mb(head.pid)

        socks = []
        for url in (f"tcp://127.0.0.1:{head.master_port}", coord_url):
            for _ in range(3):
                s = ctx.socket(zmq.DEALER)
                s.setsockopt(zmq.LINGER, 0)
                s.setsockopt(zmq.SNDHWM, 100_000)
                s.connect(url)
                socks.append(s)
        deadline = time.monotonic() + 4
        sent = 0
        while time.monotonic() < deadline:
            s = rng.choice(socks)
            kind = rng.randrange(5)
            if kind == 0:
                frames = [os.urandom(rng.randrange(0, 300))]
            elif kind == 1:
                frames = [rng.choice([b"B", b"H", b"Z"]), os.urandom(rng.randrange(0, 200))]
            elif kind == 2:
                frames = [msgspec.msgpack.encode([[[[[]]]]] * 50)]
            elif kind == 3:
                frames = [b"B", b"\x91" * 3000]  # deeply nested arrays
            else:
                frames = [os.urandom(8) for _ in range(rng.randrange(1, 6))]
            try:
                s.send_multipart(frames, zmq.NOBLOCK)
                sent += 1
            except zmq.Again:  # the head's queue for this peer is full: it sheds load
                time.sleep(0.001)
        # A forged DOWN for the live replica, with the wrong epoch, is fenced off.
        forged = Heartbeat(
            0, replica["replica_id"], replica["epoch"] + 1000, "DOWN", 0, 0, 0, 10**6
        )
        socks[-1].send_multipart(codec.encode(forged))
        time.sleep(1.5)
        for s in socks:
            s.close()

        assert sent > 1000
        assert head.alive()
        assert head.log().count("\n") < 200  # throttled: not one log line per bad message
        assert [r["state"] for r in head.up_replicas(0)] == ["UP"]
        assert head.up_replicas(0)[0]["last_heartbeat_age_s"] < 2.5
        assert _registration_ok(head.master_port)
        assert head.chat("still fine").status_code == 200
        assert _rss_mb(head.pid) - rss_before < 100
    finally:
        head.stop()
