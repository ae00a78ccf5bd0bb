"""Soak benchmark (run by hand, not in CI): open-loop load at about half capacity on the
echo pipeline with autoscaling on, and a replica SIGKILLed every minute.

Prints a row per minute (sent, ok, failed, p50/p99, replicas per stage, head and replica
memory) and at the end the totals and memory at start against end. See README.md.
"""

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from typing import Any

import bench_failover
import bench_pipeline
import common
from bench_failover import Sample
from common import HOST, ServerProcess, free_port

PIPELINE = "echo"
PATH = "/v1/chat/completions"
SUFFIX = " [thinker] [talker] [vocoder]"  # what the three echo stages append
# The thinker sleeps 4 x 10 ms per request (a request takes ~45 ms) and scales 2..4 with
# its load; the other stages run 2 replicas each. Every stage keeps at least 2, so a kill
# never takes a stage's last replica: its requests have somewhere to go while the killed
# one restarts (a stage's only replica dying fails what arrives before it is back, after
# --omni-stage-wait-timeout, which is not what this soak measures). Every stage asks Ray
# for no CPU (ignored by multi_process), so that up to 8 replicas fit a 2-CPU cluster.
OVERRIDES = {
    "0": {
        "engine_args": {"num_chunks": 4, "chunk_delay_s": 0.01},
        "replicas": 2,
        "autoscaling": {
            "min_replicas": 2,
            "max_replicas": 4,
            "target_inflight_per_replica": 4,
            "upscale_delay_s": 5,
            "downscale_delay_s": 30,
        },
        "ray": {"num_cpus": 0},
    },
    "1": {"replicas": 2, "ray": {"num_cpus": 0}},
    "2": {"replicas": 2, "ray": {"num_cpus": 0}},
}


@dataclass
class Snapshot:
    """The pipeline as /v1/omni/stages and /proc show it at one moment."""

    replicas: list[int]  # UP replicas per stage
    head_rss_kib: int
    replica_rss_kib: int  # summed over the UP replicas' processes
    replica_count: int
    restarts: int  # summed over the replicas listed
    scale_up: int  # the autoscaler's decisions so far
    scale_down: int


@dataclass
class Minute:
    minute: int
    sent: int
    ok: int
    failed: int
    p50_ms: float | None
    p99_ms: float | None
    lag_ms: float  # worst lateness of the load generator against its schedule
    kills: list[str]
    snapshot: Snapshot
    errors: list[str] = field(default_factory=list)


# -- the head and what it says about its replicas -----------------------------------------


def stages(port: int) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://{HOST}:{port}/v1/omni/stages", timeout=5.0) as resp:
        return json.load(resp)


def snapshot(head: ServerProcess) -> Snapshot:
    status = stages(head.port or 0)
    per_stage, rss, count, restarts, ups, downs = [], 0, 0, 0, 0, 0
    for st in status["stages"]:
        up = [r for r in st["replicas"] if r["state"] == "UP"]
        per_stage.append(len(up))
        restarts += sum(r.get("restarts", 0) for r in st["replicas"])
        for r in up:
            if r["pid"] and (kib := common.rss_kib(r["pid"])) is not None:
                rss, count = rss + kib, count + 1
        if scaling := st.get("autoscaling"):
            ups += scaling.get("decisions", {}).get("up", 0)
            downs += scaling.get("decisions", {}).get("down", 0)
    head_rss = common.rss_kib(head.pid) or 0
    return Snapshot(per_stage, head_rss, rss, count, restarts, ups, downs)


def wait_serving(head: ServerProcess, timeout: float) -> None:
    """Until /health answers and every stage has a replica UP."""
    head.wait_ready(timeout)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(n > 0 for n in snapshot(head).replicas):
            return
        time.sleep(0.2)
    raise RuntimeError(f"not every stage has a replica UP after {timeout:g}s")


def is_replica(pid: int) -> bool:
    """Only ever kill a process that runs omnistage's replica runtime."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"omnistage.replica" in f.read()
    except OSError:
        return False


def kill_one(head: ServerProcess, rng: random.Random) -> str:
    """SIGKILL a random UP replica of a random stage (of those with one); what was done."""
    status = stages(head.port or 0)
    choices = [
        (st, [r for r in st["replicas"] if r["state"] == "UP" and r["pid"]])
        for st in status["stages"]
    ]
    choices = [(st, up) for st, up in choices if up]
    if not choices:
        return "no UP replica to kill"
    st, up = rng.choice(choices)
    r = rng.choice(up)
    if not is_replica(r["pid"]):
        return f"stage {st['stage_id']} replica {r['replica_id']}: pid {r['pid']} not a replica"
    with contextlib.suppress(ProcessLookupError):
        os.kill(r["pid"], signal.SIGKILL)
    return (
        f"killed stage {st['stage_id']} ({st['name']}) replica {r['replica_id']} pid {r['pid']} "
        f"({len(up)} UP)"
    )


# -- load ----------------------------------------------------------------------------------


class Connections:
    """Idle keep-alive connections; a request takes the most recently used one, or opens a
    new one. The server closes a connection idle for 5 s (uvicorn's keep-alive timeout),
    and a request written into one it is closing reads EOF: connections idle for
    ``MAX_IDLE_S`` are closed here first."""

    MAX_IDLE_S = 2.0

    def __init__(self, port: int) -> None:
        self.port = port
        self.idle: list[tuple[float, bench_pipeline.Conn]] = []  # oldest first

    async def get(self) -> bench_pipeline.Conn:
        self.prune()
        while self.idle:
            conn = self.idle.pop()[1]
            if not conn[0].at_eof():
                return conn
            conn[1].close()
        return await asyncio.open_connection(HOST, self.port)

    def put(self, conn: bench_pipeline.Conn) -> None:
        self.idle.append((time.monotonic(), conn))

    def prune(self) -> None:
        cutoff, n = time.monotonic() - self.MAX_IDLE_S, 0
        while n < len(self.idle) and self.idle[n][0] < cutoff:
            self.idle[n][1][1].close()
            n += 1
        del self.idle[:n]

    def close(self) -> None:
        for _, (_, writer) in self.idle:
            writer.close()
        self.idle.clear()


async def one(conns: Connections, i: int, at: float, timeout: float) -> Sample:
    prompt = f"soak {i}"
    body = json.dumps({"model": PIPELINE, "messages": [{"role": "user", "content": prompt}]})
    # The content field, quotes included, in the body: the exact content and nothing else.
    expect = b'"content":' + json.dumps(prompt + SUFFIX).encode()
    conn, error = None, None
    try:
        async with asyncio.timeout(timeout):
            conn = await conns.get()
            await bench_pipeline.post(
                conn, common.http_post(conns.port, PATH, body.encode()), expect
            )
        conns.put(conn)
    except Exception as exc:  # a timeout, a reset connection, a wrong answer
        if conn is not None:
            conn[1].close()  # its state is unknown: never reuse it
        error = common.describe(exc, timeout)
    return Sample(at, time.perf_counter() - at, error)


def capacity(port: int, seconds: float, timeout: float) -> float:
    """Closed loop at c=32 (bench_pipeline's load) for about ``seconds``: req/s."""
    target = bench_pipeline.Target(PIPELINE, 3, b"[vocoder]")
    probe = asyncio.run(bench_pipeline.load(target, port, 32, 300, 100, timeout))
    n = max(300, round(probe.rps * seconds))
    return asyncio.run(bench_pipeline.load(target, port, 32, n, 0, timeout)).rps


def minute_row(
    m: int, samples: list[Sample], lag: float, kills: list[str], snap: Snapshot
) -> Minute:
    st = bench_failover.stats(samples)  # percentiles of the successful requests
    ok = st.total - st.failed
    errors = bench_failover.failures(samples)
    return Minute(m, st.total, ok, st.failed, st.p50_ms, st.p99_ms, lag * 1e3, kills, snap, errors)


def print_header() -> None:
    print(
        f"\n{'min':>3} {'sent':>6} {'ok':>6} {'failed':>6} {'p50 ms':>7} {'p99 ms':>7} "
        f"{'lag ms':>6} {'replicas':>8} {'head MiB':>8} {'repl MiB':>8} {'n':>2} "
        f"{'up/dn':>5}  kill",
        flush=True,
    )


def print_row(r: Minute) -> None:
    s = r.snapshot

    def ms(x: float | None) -> str:
        return "-" if x is None else f"{x:.1f}"

    print(
        f"{r.minute + 1:>3} {r.sent:>6} {r.ok:>6} {r.failed:>6} {ms(r.p50_ms):>7} "
        f"{ms(r.p99_ms):>7} {r.lag_ms:>6.0f} {'/'.join(map(str, s.replicas)):>8} "
        f"{s.head_rss_kib / 1024:>8.1f} {s.replica_rss_kib / 1024:>8.1f} {s.replica_count:>2} "
        f"{f'{s.scale_up}/{s.scale_down}':>5}  {'; '.join(r.kills) or '-'}",
        flush=True,
    )
    for e in r.errors:
        print(f"      e.g. {e}", flush=True)


async def soak(
    head: ServerProcess, args: argparse.Namespace, rate: float, rows: list[Minute]
) -> None:
    """The open loop, the kills and the minute rows (appended to ``rows`` as they end)."""
    conns = Connections(head.port or 0)
    rng = random.Random(args.seed)
    minutes = args.minutes
    by_minute: list[list[asyncio.Task[Sample]]] = [[] for _ in range(minutes)]
    lags = [0.0] * minutes
    kills: list[list[str]] = [[] for _ in range(minutes)]
    start = time.perf_counter() + 0.2

    async def killer() -> None:
        k = 0
        while (at := args.kill_every_s * (k + 0.5)) < minutes * 60:
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            try:
                what = await asyncio.to_thread(kill_one, head, rng)
            except Exception as exc:
                what = f"kill failed: {common.describe(exc)}"
            kills[min(minutes - 1, int(at // 60))].append(what)
            k += 1

    async def report(m: int, previous: asyncio.Task[None] | None) -> None:
        samples = list(await asyncio.gather(*by_minute[m]))
        by_minute[m] = []  # keep the samples only
        if previous is not None:
            await previous
        snap = await asyncio.to_thread(snapshot, head)
        rows.append(minute_row(m, samples, lags[m], kills[m], snap))
        print_row(rows[-1])

    kill_task = asyncio.create_task(killer()) if args.kill_every_s > 0 else None
    reporter: asyncio.Task[None] | None = None
    try:
        m = 0
        for i in range(round(rate * minutes * 60)):
            at = start + i / rate
            if (delay := at - time.perf_counter()) > 0:
                await asyncio.sleep(delay)
            if (now_m := int((at - start) // 60)) != m:
                reporter = asyncio.create_task(report(m, reporter))
                m = now_m
            lags[m] = max(lags[m], time.perf_counter() - at)
            by_minute[m].append(asyncio.create_task(one(conns, i, at, args.request_timeout)))
        reporter = asyncio.create_task(report(m, reporter))
        await reporter
    finally:
        if kill_task is not None:
            kill_task.cancel()
        conns.close()


# -- driver --------------------------------------------------------------------------------


def serve(args: argparse.Namespace, ray_address: str | None) -> ServerProcess:
    port = free_port()
    cmd = [sys.executable, "-m", "omnistage", "serve", PIPELINE, "--host", HOST]
    cmd += ["--port", str(port), "--log-level", "INFO", "--stage-overrides", json.dumps(OVERRIDES)]
    if ray_address is not None:
        cmd += ["--worker-backend", "ray", "--ray-address", ray_address]
    return ServerProcess(f"head ({args.worker_backend})", cmd, port)


def memory_change(a: Snapshot, b: Snapshot) -> str:
    per = [s.replica_rss_kib / s.replica_count / 1024 if s.replica_count else 0 for s in (a, b)]
    return (
        f"head {a.head_rss_kib / 1024:.1f} -> {b.head_rss_kib / 1024:.1f} MiB "
        f"({b.head_rss_kib / max(1, a.head_rss_kib):.2f}x); replicas "
        f"{a.replica_rss_kib / 1024:.1f} MiB in {a.replica_count} -> "
        f"{b.replica_rss_kib / 1024:.1f} MiB in {b.replica_count} "
        f"(per replica {per[0]:.1f} -> {per[1]:.1f} MiB)"
    )


def summary(rows: list[Minute], start: Snapshot, head_log: str) -> dict[str, Any]:
    sent, ok = sum(r.sent for r in rows), sum(r.ok for r in rows)
    end = rows[-1].snapshot
    p99s = [r.p99_ms for r in rows if r.p99_ms is not None]
    out = {
        "sent": sent,
        "ok": ok,
        "failed": sent - ok,
        "kills": sum(len(r.kills) for r in rows),
        "worst_minute_p99_ms": max(p99s) if p99s else None,
        "median_minute_p99_ms": sorted(p99s)[len(p99s) // 2] if p99s else None,
        "max_lag_ms": max(r.lag_ms for r in rows),
        "retries_logged": head_log.count("; retry "),
        "start": asdict(start),
        "end": asdict(end),
    }
    print(
        f"\ntotal: sent {sent}, ok {ok}, failed {sent - ok}, kills {out['kills']}, "
        f"retries in the head's log {out['retries_logged']}; scale-ups {end.scale_up}, "
        f"scale-downs {end.scale_down}, restarts {end.restarts}"
    )
    if p99s:
        print(
            f"p99 per minute: median {out['median_minute_p99_ms']:.1f} ms, "
            f"worst {out['worst_minute_p99_ms']:.1f} ms; load generator lag <= "
            f"{out['max_lag_ms']:.0f} ms"
        )
    first = rows[0].snapshot
    out["first_minute"] = asdict(first)
    for label, a in (("before the load", start), ("end of minute 1", first)):
        print(f"memory {label} -> end: {memory_change(a, end)}")
    return out


def run(args: argparse.Namespace, ray_address: str | None) -> dict[str, Any]:
    head = serve(args, ray_address)
    try:
        wait_serving(head, args.health_timeout)
        rate = args.rate
        if not rate:
            cap = capacity(head.port or 0, args.capacity_s, args.request_timeout)
            rate = cap * args.load_fraction
            print(
                f"capacity {cap:.0f} req/s (closed loop, c=32, ~{args.capacity_s:g} s) -> "
                f"open-loop load {rate:.1f} req/s",
                flush=True,
            )
        start = snapshot(head)
        print(
            f"start: replicas {'/'.join(map(str, start.replicas))}, head "
            f"{start.head_rss_kib / 1024:.1f} MiB, replicas {start.replica_rss_kib / 1024:.1f} "
            f"MiB; {args.minutes} min at {rate:.1f} req/s, a replica killed every "
            f"{args.kill_every_s:g} s (first at {args.kill_every_s / 2:g} s)",
            flush=True,
        )
        print_header()
        rows: list[Minute] = []
        try:
            asyncio.run(soak(head, args, rate, rows))
        except (KeyboardInterrupt, SystemExit):  # Ctrl-C, SIGTERM: the minutes so far
            if rows:
                print(f"\nstopped in minute {len(rows) + 1}; the {len(rows)} full minute(s):")
                summary(rows, start, head.log_text())
            raise
        out = summary(rows, start, head.log_text())
        print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
        return {"rate": rate, "minutes": [asdict(r) for r in rows], "totals": out}
    finally:
        if args.log and not head.log.closed:
            with open(args.log, "w") as f:
                f.write(head.log_text())
        head.stop()


def main() -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--minutes", type=int, default=30, help="minutes of load (30)")
    p.add_argument("--rate", type=float, help="open-loop req/s (default: measured capacity x 0.5)")
    p.add_argument("--load-fraction", type=float, default=0.5, help="rate / capacity (0.5)")
    p.add_argument("--capacity-s", type=float, default=10.0, help="capacity run, seconds (10)")
    p.add_argument(
        "--kill-every-s", type=float, default=60.0, help="SIGKILL a replica this often (0: never)"
    )
    p.add_argument("--worker-backend", choices=("multi_process", "ray"), default="multi_process")
    p.add_argument("--seed", type=int, default=1, help="which replicas are killed")
    p.add_argument("--log", metavar="PATH", help="keep the head's log here")
    common.add_common_args(p, health_timeout=120.0, request_timeout=10.0)
    args = p.parse_args()
    if args.minutes < 1:
        p.error("--minutes must be >= 1")
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    scaling = OVERRIDES["0"]["autoscaling"]
    print(
        f"{common.machine()}; load average {load}; {PIPELINE} with autoscaling on stage 0 "
        f"(min {scaling['min_replicas']}, max {scaling['max_replicas']}), 2 replicas of the "
        f"others; backend {args.worker_backend}",
        flush=True,
    )
    common.exit_on_sigterm()
    try:
        if args.worker_backend == "ray":
            with common.loopback_ray_cluster() as address:
                print(f"ray cluster on {address}", flush=True)
                result = run(args, address)
        else:
            result = run(args, None)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        print(f"! soak failed: {common.describe(exc)}", flush=True)
        return 1
    if args.json:
        common.write_json(args.json, args, result)
    # Every stage keeps a replica through each kill: 0 failed is what a soak expects.
    if failed := result["totals"]["failed"]:
        print(f"! {failed} request(s) failed")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
