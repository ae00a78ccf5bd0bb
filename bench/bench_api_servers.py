"""--api-server-count: the echo pipeline with 1 and with N API server processes.

Fresh servers, rounds interleaved, the same closed-loop load as bench_pipeline.py at
concurrency 32 (and 1 for latency). Besides req/s it prints CPU time per request of the
head process, of the API server processes and of the replicas: the head is one Python
thread, so 1 / (head CPU per request) is the ceiling on a machine with cores to spare,
which is what more API servers raise. See README.md.
"""

import argparse
import asyncio
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass

import common
from bench_head_cpu import cpu_seconds, descendants
from bench_pipeline import Target, load
from common import HOST, ServerProcess, free_port

ECHO = Target("echo", 3, b"[vocoder]")


@dataclass
class Round:
    servers: int
    rps_c32: float = 0.0
    p50_c1_ms: float = 0.0
    head_ms: float = 0.0  # CPU per measured request, c=32
    api_ms: float = 0.0
    replicas_ms: float = 0.0
    error: str | None = None


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def one_round(servers: int, args: argparse.Namespace) -> Round:
    r = Round(servers)
    port = free_port()
    cmd = [sys.executable, "-m", "omnistage", "serve", "echo", "--host", HOST]
    cmd += ["--port", str(port), "--log-level", "WARNING", "--api-server-count", str(servers)]
    server = ServerProcess(f"echo x{servers}", cmd, port)
    try:
        server.wait_ready(args.health_timeout)
        asyncio.run(load(ECHO, port, 32, args.warmup, 0, args.request_timeout))
        kids = descendants(server.pid)
        api = [p for p in kids if b"omnistage.api.server" in _cmdline(p)]
        replicas = [p for p in kids if p not in api]
        pids = [server.pid, *api, *replicas]
        before = {p: cpu_seconds(p) for p in pids}
        res = asyncio.run(load(ECHO, port, 32, args.requests, 0, args.request_timeout))
        used = {p: cpu_seconds(p) - before[p] for p in pids}
        per = 1e3 / args.requests
        r.rps_c32 = res.rps
        r.head_ms = used[server.pid] * per
        r.api_ms = sum(used[p] for p in api) * per
        r.replicas_ms = sum(used[p] for p in replicas) * per
        r.p50_c1_ms = asyncio.run(load(ECHO, port, 1, 300, 50, args.request_timeout)).p50_ms
    except Exception as exc:
        r.error = common.describe(exc, args.request_timeout)
        print(f"! echo x{servers}: {r.error}", flush=True)
    finally:
        server.stop()
    return r


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--servers", type=int, default=2, help="API server processes to compare")
    p.add_argument("--requests", type=int, default=3000, help="measured requests at c=32")
    p.add_argument("--warmup", type=int, default=300)
    p.add_argument("--rounds", type=int, default=3)
    common.add_common_args(p, health_timeout=120.0, request_timeout=10.0)
    args = p.parse_args()
    print(f"{common.machine()}; c=32 requests {args.requests}, rounds {args.rounds}")
    common.exit_on_sigterm()
    rounds: list[Round] = []
    for i in range(args.rounds):
        for n in (1, args.servers):
            r = one_round(n, args)
            rounds.append(r)
            if r.error is None:
                print(
                    f"  round {i} servers={n}: {r.rps_c32:6.0f} req/s, head {r.head_ms:.3f} "
                    f"ms/req, API servers {r.api_ms:.3f}, replicas {r.replicas_ms:.3f}, "
                    f"c=1 p50 {r.p50_c1_ms:.3f} ms",
                    flush=True,
                )
            time.sleep(0.5)
    print(
        f"\n{'servers':>7} {'req/s c=32':>10} {'head ms/req':>11} {'api ms/req':>10} "
        f"{'replicas':>9} {'c=1 p50 ms':>10} {'head ceiling req/s':>18}"
    )
    for n in (1, args.servers):
        ok = [r for r in rounds if r.servers == n and r.error is None]
        if not ok:
            print(f"{n:>7}  FAILED")
            continue

        def med(attr: str, ok: list[Round] = ok) -> float:
            return statistics.median(getattr(r, attr) for r in ok)

        print(
            f"{n:>7} {med('rps_c32'):>10.0f} {med('head_ms'):>11.3f} {med('api_ms'):>10.3f} "
            f"{med('replicas_ms'):>9.3f} {med('p50_c1_ms'):>10.3f} {1e3 / med('head_ms'):>18.0f}"
        )
    if args.json:
        common.write_json(args.json, args, {"rounds": [asdict(r) for r in rounds]})
    # The medians leave a failed round out: say so in the exit status too.
    if failed := sum(r.error is not None for r in rounds):
        print(f"! {failed} round(s) FAILED")
        return 1
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
