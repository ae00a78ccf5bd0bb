"""A head killed with SIGKILL and started again: how soon it serves (issue 24).

The echo pipeline's head runs stage 0 itself (``--stage-id 0``) and two headless
replicas serve stages 1 and 2, as in the issue. Each round: wait until a chat answers,
SIGKILL the head's process group, start a new head on the same master port after
``--down`` seconds, and time (from the kill and from the new head's start) its /health
answering 200, which needs every stage's replica, i.e. the headless replicas back, and
the first chat answered. The headless replicas notice the new head by asking its master
which head is there once their heartbeats go unanswered (``HeadProbe``), rather than
after 2 x ``--omni-heartbeat-timeout`` of silence; ``--heartbeat-timeout`` shows that the
timeout no longer decides it.

    python bench/bench_head_restart.py [--rounds 5] [--down 1.0] [--heartbeat-timeout 5]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import HOST, ServerProcess, free_port

BODY = json.dumps(
    {"model": "echo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
).encode()


def _ok(port: int, path: str, body: bytes | None = None) -> bool:
    req = urllib.request.Request(f"http://{HOST}:{port}{path}", data=body)
    if body:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=2.0) as resp:
            return resp.status == 200
    except OSError:
        return False


def _head(port: int, master: int, timeout: float) -> ServerProcess:
    cmd = [sys.executable, "-m", "omnistage", "serve", "echo", "--stage-id", "0"]
    cmd += ["-oma", HOST, "-omp", str(master), "--port", str(port)]
    cmd += ["--omni-heartbeat-timeout", f"{timeout:g}"]
    return ServerProcess("head", cmd, port)


def _headless(stage: int, master: int) -> ServerProcess:
    cmd = [sys.executable, "-m", "omnistage", "serve", "--headless", "--stage-id", str(stage)]
    return ServerProcess(f"replica{stage}", [*cmd, "-oma", HOST, "-omp", str(master)])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--down", type=float, default=1.0, help="seconds between kill and start")
    p.add_argument("--heartbeat-timeout", type=float, default=5.0)
    args = p.parse_args()
    port, master = free_port(), free_port()
    head = _head(port, master, args.heartbeat_timeout)
    replicas = [_headless(1, master), _headless(2, master)]
    rows = []
    try:
        head.wait_ready(120, "/v1/chat/completions", BODY)
        for n in range(args.rounds):
            time.sleep(2.0)  # steady heartbeats before the kill
            os.killpg(head.pid, signal.SIGKILL)  # the head and its local replica
            head.stop(grace=1.0)
            killed = time.monotonic()
            time.sleep(args.down)
            head = _head(port, master, args.heartbeat_timeout)
            started = time.monotonic()
            healthy = served = None
            while served is None and time.monotonic() - started < 120:
                now = time.monotonic()
                if healthy is None and _ok(port, "/health"):
                    healthy = now
                if healthy is not None and _ok(port, "/v1/chat/completions", BODY):
                    served = time.monotonic()
                time.sleep(0.02)
            if healthy is None or served is None:
                print(f"round {n + 1}: not serving 120 s after the restart{head.log_tail()}")
                return 1
            rows.append((healthy - killed, served - killed, healthy - started))
            print(
                f"round {n + 1}: healthy {healthy - killed:.2f} s after the kill "
                f"({healthy - started:.2f} s after the new head started), first chat "
                f"answered {served - killed:.2f} s after the kill"
            )
    finally:
        for proc in [head, *replicas]:
            proc.stop()
    med = [statistics.median(col) for col in zip(*rows, strict=True)]
    print(
        f"\nmedian of {len(rows)} (head down {args.down:g} s, heartbeat timeout "
        f"{args.heartbeat_timeout:g} s): healthy {med[0]:.2f} s after the kill, "
        f"{med[2]:.2f} s after the new head's start; serving {med[1]:.2f} s after the kill"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
