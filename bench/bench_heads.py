"""Two heads in one fleet (``--omni-join``): what a second head costs, what a
head killed under load costs the clients, and how soon a restarted head serves again.

The ``echo-1stage`` pipeline; every head runs no replica of its own (``--stage-id 0
--omni-dp-size-local 0``) and one headless process (``--omni-dp-size-local 2``, given the
first head's master) serves two replicas to every head of the fleet. Three parts, in one
run:

1. **One head vs two**: fresh processes per run, ``--rounds`` rounds alternating one head
   and two joined heads. A closed loop of ``--concurrency`` keep-alive connections, split
   evenly over the heads, for ``--warmup`` s then ``--duration`` s measured: req/s, p50 and
   p99, and the CPU time (user + system, from each process's CPU clock: utime + stime of
   /proc/PID/stat in ns) of each head (with its child processes, if any), of the replicas'
   processes and of the load generator, per request, and each head's CPU at rest just
   before. A 2-core machine shows no scaling; the figure to watch is the heads' CPU per
   request, which a second head must not raise. ``1 head c/2`` is the lone head at half
   the concurrency, the load each of two heads gets (a head's CPU per request depends on
   its load). Controls: ``2 separate`` (``x2``), two deployments that
   know nothing of each other sharing the machine; ``2 joined own`` against ``2 separate
   own``, each head with its own two replicas (serving only it), joined or not: the same
   processes and connections, so their ratio is what the fleet itself adds.
2. **A head killed under load**: the two heads behind haproxy with docs/distributed.md's
   settings (round robin, ``option httpchk GET /health``, ``check inter 200ms fall 1 rise
   2``, ``timeout check 1s``, ``retries 3``, ``retry-on conn-failure empty-response``,
   ``option http-buffer-request``, ``option redispatch``; it adds the answering server and
   its response time, ``%s`` and ``%Tr``, as response headers). Four threads of the openai
   SDK (its default 2 retries) post chat completions back to back; after ``--kill-warmup`` s
   the first head (the one the replicas were given) gets SIGKILL. Reported: requests that
   failed at the clients (target 0), attempts the SDK retried, and the surviving head's
   p50/p99 over the ``--window`` s before the kill and after it, both as client latency of
   the requests it answered and as haproxy's ``Tr`` (target: p99 after within 2x of before).
3. **Restart**: the killed head started again on the same master and HTTP ports, without
   ``--omni-join`` (the other head's announcements find it), once the other head lists
   it DOWN (``--down S``: S seconds after the kill instead), ``--restart-rounds`` times
   (killed again ``--settle`` s after each round). From the new process's start: its
   HTTP answering, ``/health`` answering 200 (which needs a live replica), then, counted
   from that 200: (a) both replicas UP in its ``/v1/omni/stages``, (b) the first chat
   answered through it, (c) both replicas having served a chat through it; and when the
   other head lists its new instance UP. Target: served within 1 s of healthy.
   ``--restart-under-load`` keeps part 2's clients running through haproxy meanwhile
   (client failures and requests haproxy sent to the new head, per round).

Every process (heads, headless replicas, haproxy) runs in its own process group, with
its output in a log file, and is stopped (SIGTERM, then SIGKILL to the group) however the
run ends; they also get SIGKILL if this script dies (``setpriv --pdeathsig``). Figures,
not assertions (a MISS exits 0): the script exits 1 when a part could not run, a run of
part 1 failed or had a failed request, or a restart round failed.

    PYTHONPATH=. python bench/bench_heads.py [--concurrency 16] [--duration 10] [--rounds 2]
        [--restart-rounds 3] [--quick] [--keep-logs DIR] [--json out.json]

About 3 minutes with the defaults; ``--quick`` (3 s runs, one round, one restart) about
50 s.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common
from bench_head_cpu import cpu_seconds, descendants
from bench_pipeline import post
from common import HOST, ServerProcess, free_port, pct

PIPELINE = "echo-1stage"
CHAT = "/v1/chat/completions"
REPLICAS = 2  # the headless process's --omni-dp-size-local
KILL_P99_RATIO = 2.0  # the survivor's p99 after the kill within 2x of before
SERVED_WITHIN_S = 1.0  # a restarted head serves within 1 s of /health 200
BUSY_AT_REST = 20.0  # % of a core: a head busier than that at rest is flagged
QUICK = {"duration": 3.0, "warmup": 1.0, "rounds": 1, "kill_warmup": 3.5}
QUICK |= {"restart_rounds": 1, "settle": 1.0}


# -- processes ----------------------------------------------------------------------------


class Proc(ServerProcess):
    """A server of this benchmark: its log in the run's folder (for --keep-logs), SIGKILLed
    by the kernel if this script dies first (``pdeathsig``), and listed in ``started`` so
    main() stops every one however the run ends. Started from the main thread only."""

    started: list[Proc] = []  # every one, in start order

    def __init__(self, name: str, cmd: list[str], logdir: Path) -> None:
        assert threading.current_thread() is threading.main_thread()
        log_path = logdir / f"{name}-{len(Proc.started)}.log"
        super().__init__(name, cmd, log_path=log_path, pdeathsig=True)
        self.started_at = time.monotonic()
        Proc.started.append(self)


def head_cmd(http_port: int, master_port: int, join: int | None, own: int = 0) -> list[str]:
    """``own``: replicas the head runs itself (its children, serving only it)."""
    cmd = [sys.executable, "-m", "omnistage", "serve", PIPELINE, "--stage-id", "0"]
    cmd += ["--omni-dp-size-local", str(own), "--host", HOST, "--port", str(http_port)]
    cmd += ["-oma", HOST, "-omp", str(master_port)]
    if join is not None:
        cmd += ["--omni-join", f"{HOST}:{join}"]
    return cmd


def headless_cmd(master_port: int, replicas: int = REPLICAS) -> list[str]:
    cmd = [sys.executable, "-m", "omnistage", "serve", "--headless", "--stage-id", "0"]
    return [*cmd, "-oma", HOST, "-omp", str(master_port), "--omni-dp-size-local", str(replicas)]


# -- small HTTP helpers (urllib: no client state to share between threads) -----------------


def http_status(port: int, path: str, body: bytes | None = None, timeout: float = 2.0) -> int:
    """The status of one GET (POST of ``body``); 0 when nothing answers."""
    req = urllib.request.Request(f"http://{HOST}:{port}{path}", data=body)
    if body is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            resp.read()
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except (OSError, http.client.HTTPException):
        return 0


def get_json(port: int, path: str, timeout: float = 2.0) -> dict[str, Any] | None:
    try:
        with urllib.request.urlopen(f"http://{HOST}:{port}{path}", timeout=timeout) as resp:
            return json.loads(resp.read())
    except (OSError, http.client.HTTPException, ValueError):
        return None


def chat_ok(port: int, text: str, timeout: float = 5.0) -> bool:
    body = json.dumps({"model": PIPELINE, "messages": [{"role": "user", "content": text}]})
    req = urllib.request.Request(f"http://{HOST}:{port}{CHAT}", data=body.encode())
    req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            out = json.loads(resp.read())
        return out["choices"][0]["message"]["content"] == f"{text} [echo]"
    except (OSError, http.client.HTTPException, ValueError, KeyError, IndexError):
        return False


def up_replicas(stages: dict[str, Any] | None) -> list[dict[str, Any]]:
    if not stages:
        return []
    replicas = next((s["replicas"] for s in stages["stages"] if s["stage_id"] == 0), [])
    return [r for r in replicas if r["state"] == "UP"]


def head_states(stages: dict[str, Any] | None) -> dict[str, str]:
    """master address -> state, as a head sees its fleet."""
    return {h["address"]: h["state"] for h in (stages or {}).get("heads", [])}


def master_url(port: int) -> str:
    return f"tcp://{HOST}:{port}"


def view_of(port: int, master: int) -> tuple[str | None, str | None]:
    """(state, instance) of the head whose master port is ``master``, as the head on
    HTTP ``port`` sees it; (None, None) if it does not list it (or does not answer)."""
    for h in (get_json(port, "/v1/omni/stages") or {}).get("heads", []):
        if h["address"] == master_url(master):
            return h["state"], h["instance"]
    return None, None


def wait_marked_down(fleet: Fleet, killed: float, timeout: float) -> float | None:
    """Seconds from ``killed`` until head b lists head a DOWN (or no longer lists it);
    None if not within ``timeout`` s of ``killed``."""
    while time.monotonic() < killed + timeout:
        state, _ = view_of(fleet.http[1], fleet.master[0])
        if state != "UP":
            return time.monotonic() - killed
        time.sleep(0.05)
    return None


def wait_until(cond: Callable[[], bool], timeout: float, what: str, procs: list[Proc]) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p in procs:
            if not p.alive():
                raise RuntimeError(f"{p.name} exited ({p.proc.returncode}){p.log_tail()}")
        if cond():
            return
        time.sleep(0.05)
    tails = "".join(p.log_tail(800) for p in procs)
    raise RuntimeError(f"not within {timeout:g} s: {what}{tails}")


# -- a fleet ------------------------------------------------------------------------------


@dataclass
class Fleet:
    http: list[int]
    master: list[int]
    heads: list[Proc]
    headless: list[Proc]  # one headless process (one per head when the heads are separate)
    own: bool = False  # no headless process: each head's replicas are its children

    def all(self) -> list[Proc]:
        return [*self.heads, *self.headless]


def start_fleet(
    n_heads: int, logdir: Path, timeout: float, replicas: int = 1, own: bool = False
) -> Fleet:
    """``n_heads`` heads (the second and later joined to the first) and the headless
    process; returns once every head has both replicas UP and sees every head UP.
    ``own``: no headless process; each head runs its own two replicas (serving only it)."""
    if n_heads < 0:  # -n: n separate deployments, one head and one replica each
        return start_separate(-n_heads, logdir, timeout, replicas, own)
    http = [free_port() for _ in range(n_heads)]
    master = [free_port() for _ in range(n_heads)]
    mine = REPLICAS if own else 0
    heads = [Proc("head-a", head_cmd(http[0], master[0], None, mine), logdir)]
    # The others join through the first head's master: it must be listening.
    wait_until(lambda: http_status(http[0], "/health") != 0, timeout, "head a's HTTP", heads)
    for i in range(1, n_heads):
        cmd = head_cmd(http[i], master[i], master[0], mine)
        heads.append(Proc(f"head-{'abcd'[i]}", cmd, logdir))
    headless = [] if own else [Proc("headless", headless_cmd(master[0]), logdir)]
    fleet = Fleet(http, master, heads, headless, own)
    # A head alone lists no heads (/v1/omni/stages has "heads": [] then).
    everyone = {master_url(m): "UP" for m in master} if n_heads > 1 else {}
    for port in http:

        def ready(port: int = port) -> bool:
            stages = get_json(port, "/v1/omni/stages")
            return len(up_replicas(stages)) == REPLICAS and head_states(stages) == everyone

        wait_until(ready, timeout, f"{REPLICAS} replicas and {n_heads} heads UP", fleet.all())
    return fleet


def start_separate(n: int, logdir: Path, timeout: float, replicas: int, own: bool) -> Fleet:
    """The control for two joined heads: ``n`` deployments that know nothing of each
    other, each a head with one headless replica, so the machine runs as many heads and
    replica processes as the joined fleet does, and the heads share its cores the same way.
    ``own``: each head runs its ``replicas`` itself instead."""
    http = [free_port() for _ in range(n)]
    master = [free_port() for _ in range(n)]
    mine = replicas if own else 0
    heads = [
        Proc(f"head-{'abcd'[i]}", head_cmd(http[i], master[i], None, mine), logdir)
        for i in range(n)
    ]
    headless = [
        Proc(f"headless-{'abcd'[i]}", headless_cmd(master[i], replicas), logdir)
        for i in range(n)
        if not own
    ]
    fleet = Fleet(http, master, heads, headless, own)
    for port in http:

        def ready(port: int = port) -> bool:
            stages = get_json(port, "/v1/omni/stages")
            return len(up_replicas(stages)) == replicas and head_states(stages) == {}

        wait_until(ready, timeout, "its replica UP", fleet.all())
    return fleet


def stop_procs(procs: list[Proc]) -> None:
    for p in reversed(procs):
        p.stop()


def cpu_tree(pid: int) -> float:
    """CPU seconds of ``pid`` and its live descendants."""
    return sum(cpu_seconds(p) for p in [pid, *descendants(pid)])


# -- part 1: one head vs two --------------------------------------------------------------


@dataclass(frozen=True)
class Setup:
    name: str
    heads: int
    half: bool = False  # at half the concurrency: what each of two heads gets
    replicas: int = 1  # separate deployments (heads < 0): replicas each
    own: bool = False  # each head runs its replicas itself (they serve only it)


SETUPS = (
    Setup("1 head", 1),
    Setup("1 head c/2", 1, half=True),
    Setup("2 heads", 2),
    # Two deployments unaware of each other (heads=-2): what sharing the cores costs
    # two heads, fleet or not. Joined heads above this pay for the fleet itself.
    Setup("2 separate", -2),
    Setup("2 separate x2", -2, replicas=REPLICAS),
    # Each head with its own two replicas, joined and not: the same processes, the same
    # connections and the same rhythm, so what differs is the fleet alone (gossip, the
    # heartbeats' other-head counts, the pool's candidate filter).
    Setup("2 joined own", 2, replicas=REPLICAS, own=True),
    Setup("2 separate own", -2, replicas=REPLICAS, own=True),
)


@dataclass
class LoadRun:
    setup: str
    heads: int
    round: int
    requests: int = 0
    errors: int = 0
    first_error: str | None = None
    rps: float = 0.0
    p50_ms: float = 0.0
    p99_ms: float = 0.0
    per_head_requests: list[int] = field(default_factory=list)
    head_cpu_ms: list[float] = field(default_factory=list)  # per head, per its own request
    heads_cpu_ms: float = 0.0  # all heads' CPU per request of the fleet
    heads_idle_pct: list[float] = field(default_factory=list)  # % of a core, at rest
    replicas_cpu_ms: float = 0.0
    client_cpu_ms: float = 0.0
    error: str | None = None


async def closed_loop(
    ports: list[int], concurrency: int, warmup: float, duration: float, timeout: float, run: Any
) -> tuple[list[list[float]], float, list[float], float]:
    """``concurrency`` connections split evenly over ``ports``, each sending back to back,
    for ``warmup`` s, then ``duration`` s measured. ``run.snapshot()`` is called just
    before and after the measured part. Returns the latencies per port, the measured
    wall time, the two CPU snapshots' differences, and the client's CPU seconds."""
    body = json.dumps({"model": PIPELINE, "messages": [{"role": "user", "content": "hello"}]})
    requests = [common.http_post(p, CHAT, body.encode()) for p in ports]
    targets = [i % len(ports) for i in range(concurrency)]
    lat: list[list[float]] = [[] for _ in ports]
    measuring = [False]

    async def worker(i: int, until: float) -> None:
        conn = await asyncio.open_connection(HOST, ports[i])
        try:
            while time.perf_counter() < until:
                t0 = time.perf_counter()
                try:
                    async with asyncio.timeout(timeout):
                        await post(conn, requests[i], b"[echo]")
                except (OSError, RuntimeError, TimeoutError, asyncio.IncompleteReadError) as exc:
                    if measuring[0]:
                        run.errors += 1
                        run.first_error = run.first_error or common.describe(exc, timeout)
                    conn[1].close()
                    conn = await asyncio.open_connection(HOST, ports[i])
                    continue
                if measuring[0]:
                    lat[i].append(time.perf_counter() - t0)
        finally:
            conn[1].close()

    async def phase(seconds: float) -> None:
        until = time.perf_counter() + seconds
        async with asyncio.TaskGroup() as tg:
            for t in targets:
                tg.create_task(worker(t, until))

    await phase(warmup)
    before, client = run.snapshot(), time.process_time()
    measuring[0] = True
    start = time.perf_counter()
    await phase(duration)
    wall = time.perf_counter() - start
    measuring[0] = False
    after, client = run.snapshot(), time.process_time() - client
    return lat, wall, [b - a for a, b in zip(before, after, strict=True)], client


class Snapshot:
    """CPU seconds of each head's tree, then of the replicas' tree (the headless process
    and its replica processes); fails if the replica processes change meanwhile."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self.replica_pids = self._replicas()
        # (A headless process with one replica runs it in its own process: no child.)
        if len(fleet.headless) == 1 and len(self.replica_pids) < REPLICAS:
            raise RuntimeError(f"{len(self.replica_pids)} replica processes, not {REPLICAS}")

    def _replicas(self) -> list[int]:
        parents = self.fleet.heads if self.fleet.own else self.fleet.headless
        return [pid for h in parents for pid in descendants(h.pid)]

    def snapshot(self) -> list[float]:
        if self._replicas() != self.replica_pids:
            raise RuntimeError("the replica processes changed during the run")
        # A head's own replicas are its children: they count as replicas here.
        heads = [
            cpu_seconds(h.pid) if self.fleet.own else cpu_tree(h.pid) for h in self.fleet.heads
        ]
        parents = [h.pid for h in self.fleet.headless]
        return [*heads, sum(cpu_seconds(p) for p in [*parents, *self.replica_pids])]


def load_run(setup: Setup, rnd: int, args: argparse.Namespace, logdir: Path) -> LoadRun:
    run = LoadRun(setup.name, setup.heads, rnd)
    fleet = None
    try:
        fleet = start_fleet(setup.heads, logdir, args.health_timeout, setup.replicas, setup.own)
        snap = Snapshot(fleet)
        # The heads at rest (heartbeats, announcements): one second, after a settle.
        time.sleep(0.5)
        idle0, t0 = snap.snapshot(), time.monotonic()
        time.sleep(args.idle)
        idle1, dt = snap.snapshot(), time.monotonic() - t0
        run.heads_idle_pct = [(b - a) / dt * 100 for a, b in zip(idle0, idle1, strict=True)][:-1]
        c = max(1, args.concurrency // 2) if setup.half else args.concurrency
        coro = closed_loop(fleet.http, c, args.warmup, args.duration, args.request_timeout, snap)
        lat, wall, cpu, client = asyncio.run(coro)
        run.per_head_requests = [len(x) for x in lat]
        run.requests = sum(run.per_head_requests)
        if not run.requests:
            raise RuntimeError(f"no request answered: {run.first_error}")
        every = sorted(x for per in lat for x in per)
        run.rps = run.requests / wall
        run.p50_ms, run.p99_ms = pct(every, 50) * 1e3, pct(every, 99) * 1e3
        heads_cpu, replicas_cpu = cpu[:-1], cpu[-1]
        run.head_cpu_ms = [
            c / max(1, n) * 1e3 for c, n in zip(heads_cpu, run.per_head_requests, strict=True)
        ]
        run.heads_cpu_ms = sum(heads_cpu) / run.requests * 1e3
        run.replicas_cpu_ms = replicas_cpu / run.requests * 1e3
        run.client_cpu_ms = client / run.requests * 1e3
    except Exception as exc:
        run.error = common.describe(exc, args.request_timeout)
        print(f"! {setup.name}, round {rnd}: FAILED: {run.error}", flush=True)
    finally:
        if fleet is not None:
            stop_procs(fleet.all())
    return run


def report_load(runs: list[LoadRun], args: argparse.Namespace) -> dict[str, Any]:
    print(
        f"\n1. one head vs two joined heads: {PIPELINE}, {REPLICAS} replicas in one headless "
        f"process;\n   closed loop c={args.concurrency} split evenly over the heads, "
        f"{args.warmup:g} s warm-up + {args.duration:g} s measured; median of {args.rounds} "
        "round(s), the setups alternating"
    )
    ok = [r for r in runs if r.error is None]
    meds: dict[str, LoadRun] = {}
    for setup in SETUPS:
        mine = [r for r in ok if r.setup == setup.name]
        if not mine:
            continue
        med = LoadRun(setup.name, setup.heads, 0)
        for name in ("rps", "p50_ms", "p99_ms", "heads_cpu_ms", "replicas_cpu_ms"):
            setattr(med, name, statistics.median(getattr(r, name) for r in mine))
        med.client_cpu_ms = statistics.median(r.client_cpu_ms for r in mine)
        med.requests = round(statistics.median(r.requests for r in mine))
        med.errors = sum(r.errors for r in mine)
        for name in ("head_cpu_ms", "heads_idle_pct", "per_head_requests"):
            columns = zip(*(getattr(r, name) for r in mine), strict=True)
            setattr(med, name, [statistics.median(x) for x in columns])
        meds[setup.name] = med
    shown = list(meds.values())
    width = max([12, *(len(r.setup) + 2 for r in shown)])

    def row(label: str, cells: list[str]) -> None:
        print(f"   {label:<36}" + "".join(f"{c:>{width}}" for c in cells))

    def per_head(values: list[float], i: int, fmt: str) -> str:
        return format(values[i], fmt) if i < len(values) else "-"

    row("", [r.setup for r in shown])
    row("requests measured", [str(r.requests) for r in shown])
    row(
        "  of them via head a / head b",
        ["/".join(f"{x:.0f}" for x in r.per_head_requests) for r in shown],
    )
    row("errors (all rounds)", [str(r.errors) for r in shown])
    row("req/s", [f"{r.rps:.0f}" for r in shown])
    row("p50 ms", [f"{r.p50_ms:.2f}" for r in shown])
    row("p99 ms", [f"{r.p99_ms:.2f}" for r in shown])
    row("heads' CPU ms / request (all heads)", [f"{r.heads_cpu_ms:.3f}" for r in shown])
    for i, name in enumerate("ab"):
        row(
            f"  head {name} CPU ms / its request",
            [per_head(r.head_cpu_ms, i, ".3f") for r in shown],
        )
    for i, name in enumerate("ab"):
        row(
            f"  head {name} CPU at rest, % of a core",
            [per_head(r.heads_idle_pct, i, ".1f") for r in shown],
        )
    row("replicas' CPU ms / request", [f"{r.replicas_cpu_ms:.3f}" for r in shown])
    row("load generator CPU ms / request", [f"{r.client_cpu_ms:.3f}" for r in shown])
    print("   per round, req/s and heads' CPU ms / request:")
    for setup in SETUPS:
        mine = [r for r in ok if r.setup == setup.name]
        cells = ", ".join(f"{r.rps:.0f} / {r.heads_cpu_ms:.3f}" for r in mine)
        if cells:
            print(f"     {setup.name:<12} {cells}")
    print(
        f"   c/2: at c={max(1, args.concurrency // 2)}, the load each of two heads gets (a "
        "head's CPU per request\n   depends on its load: a busier loop handles more per "
        "wake-up);\n   2 separate: two deployments unaware of each other, a head and a "
        "headless replica each,\n   sharing the machine as the two joined heads do"
    )
    for r in runs:
        if r.error is not None:
            print(f"   {r.setup} #{r.round}: FAILED: {r.error.splitlines()[0][:200]}")
    for r in ok:
        for i, busy in enumerate(r.heads_idle_pct):
            if busy > BUSY_AT_REST:
                print(
                    f"   ! {r.setup} #{r.round}: head {'ab'[i]} used {busy:.0f}% of a core at "
                    "rest, with no request (its CPU per request counts that too)"
                )
    out: dict[str, Any] = {"runs": [asdict(r) for r in runs]}
    two = meds.get("2 heads")
    for one in ("1 head", "1 head c/2", "2 separate"):
        if two is None or one not in meds:
            continue
        ratio = two.heads_cpu_ms / meds[one].heads_cpu_ms
        rps = two.rps / meds[one].rps
        print(
            f"   two heads / {one + ':':<12} heads' CPU per request {ratio:.2f} (target: not "
            f"above 1), replicas' {two.replicas_cpu_ms / meds[one].replicas_cpu_ms:.2f}, "
            f"req/s {rps:.2f}"
        )
        out[f"two_over_{one.replace(' ', '_')}"] = {"heads_cpu": ratio, "rps": rps}
    joined, apart = meds.get("2 joined own"), meds.get("2 separate own")
    if joined is not None and apart is not None:
        ratio = joined.heads_cpu_ms / apart.heads_cpu_ms
        print(
            f"   2 joined own / 2 separate own: heads' CPU per request {ratio:.2f} (what the "
            "fleet itself adds, with each head's replicas its own), req/s "
            f"{joined.rps / apart.rps:.2f}"
        )
        out["joined_own_over_separate_own"] = {"heads_cpu": ratio}
    spread = [
        (max(x) - min(x)) / statistics.median(x)
        for setup in SETUPS
        if len(x := [r.heads_cpu_ms for r in ok if r.setup == setup.name]) > 1
    ]
    if spread:
        print(f"   round-to-round spread of heads' CPU per request: up to {max(spread):.0%}")
    return out


# -- part 2: a head killed under load behind haproxy ---------------------------------------


def haproxy_cfg(port: int, heads: list[int]) -> str:
    servers = common.haproxy_servers(heads)
    return f"""global
    maxconn 512
defaults
    mode http
    timeout connect 1s
    timeout client 30s
    timeout server 30s
    timeout check 1s
    retries 3
    retry-on conn-failure empty-response
    option http-buffer-request
    option redispatch
frontend api
    bind {HOST}:{port}
    default_backend heads
backend heads
    balance roundrobin
    option httpchk GET /health
    http-response set-header X-Backend %s
    http-response set-header X-Tr %Tr
{servers}
"""


@dataclass
class Answer:
    start: float
    end: float
    backend: str | None  # the server haproxy says answered; None for a failure
    tr_ms: float | None  # haproxy's Tr: the server's time to its response headers
    retries: int = 0
    error: str | None = None


class Clients:
    """``n`` threads of the openai SDK posting chat completions through ``url``."""

    def __init__(self, url: str, n: int, timeout: float) -> None:
        self.url, self.timeout = url, timeout
        self.answers: list[Answer] = []
        self.failed_attempts: list[tuple[float, str, str]] = []  # (time, what, backend)
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.threads = [
            threading.Thread(target=self.loop, args=(i,), daemon=True) for i in range(n)
        ]

    def start(self) -> Clients:
        for t in self.threads:
            t.start()
        return self

    def stop(self) -> None:
        self.done.set()
        for t in self.threads:
            t.join(self.timeout * 3 + 5)

    def record(self, what: str, backend: str) -> None:
        with self.lock:
            self.failed_attempts.append((time.monotonic(), what, backend))

    def loop(self, n: int) -> None:
        import httpx
        import openai

        clients = self

        class Recording(httpx.HTTPTransport):
            """Every attempt that fails: an error status, or no answer at all."""

            def handle_request(self, request: httpx.Request) -> httpx.Response:
                try:
                    resp = super().handle_request(request)
                except httpx.HTTPError as exc:
                    clients.record(repr(exc)[:120], "-")
                    raise
                if resp.status_code >= 400:
                    clients.record(f"HTTP {resp.status_code}", resp.headers.get("x-backend", "-"))
                return resp

        http_client = httpx.Client(transport=Recording())
        sdk = openai.OpenAI(
            base_url=self.url, api_key="none", timeout=self.timeout, http_client=http_client
        )
        i = 0
        while not self.done.is_set():
            i += 1
            text = f"c{n} r{i}"
            start = time.monotonic()
            try:
                raw = sdk.chat.completions.with_raw_response.create(
                    model=PIPELINE, messages=[{"role": "user", "content": text}]
                )
                content = raw.parse().choices[0].message.content
                end = time.monotonic()
                tr = raw.headers.get("x-tr")
                answer = Answer(
                    start,
                    end,
                    raw.headers.get("x-backend"),
                    float(tr) if tr and tr.lstrip("-").isdigit() else None,
                    raw.retries_taken,
                )
                if content != f"{text} [echo]":
                    answer.error = f"{text}: wrong content {content!r}"
            except openai.OpenAIError as exc:
                answer = Answer(start, time.monotonic(), None, None, error=f"{text}: {exc!r}")
            with self.lock:
                self.answers.append(answer)
        http_client.close()


def lat_stats(xs: list[float]) -> tuple[int, float, float]:
    """Count, p50 and p99 of a list (NaN for an empty one)."""
    if not xs:
        return 0, float("nan"), float("nan")
    xs = sorted(xs)
    return len(xs), pct(xs, 50), pct(xs, 99)


def kill_part(
    fleet: Fleet, proxy_port: int, args: argparse.Namespace
) -> tuple[dict[str, Any], Clients, float, str | None]:
    """Part 2; returns its results, the clients (still running when the restarts are to
    run under load), the kill's time and the killed head's instance."""
    url = f"http://{HOST}:{proxy_port}/v1"
    clients = Clients(url, args.clients, args.request_timeout).start()
    time.sleep(args.kill_warmup)
    _, instance = view_of(fleet.http[1], fleet.master[0])
    killed = time.monotonic()
    fleet.heads[0].kill()  # SIGKILL to its group: the head (it has no local replica)
    # Meanwhile, and past the window if need be: the survivor marking the dead head DOWN.
    down_at = wait_marked_down(fleet, killed, args.down_timeout)
    end = killed + args.window
    time.sleep(max(0.0, end + 0.5 - time.monotonic()))
    if not args.restart_under_load:
        clients.stop()
    with clients.lock:
        answers = [a for a in clients.answers if a.start < end]
        attempts = [a for a in clients.failed_attempts if a[0] < end]
    failed = [a for a in answers if a.error is not None]
    ok = [a for a in answers if a.error is None]
    name = {"a": "head a (killed)", "b": "head b (survivor)"}

    def window(lo: float, hi: float) -> list[Answer]:
        return [a for a in ok if a.backend == "b" and lo <= a.end < hi]

    before = window(killed - args.window, killed)
    after = window(killed, killed + args.window)
    res: dict[str, Any] = {
        "answered": len(ok),
        "failed": len(failed),
        "failures": [a.error for a in failed][:10],
        "by_backend": {b: sum(1 for a in ok if a.backend == b) for b in ("a", "b")},
        "retried_requests": sum(1 for a in ok if a.retries),
        "failed_attempts": [(round(t - killed, 3), s, b) for t, s, b in attempts],
        "survivor_marks_dead_down_s": down_at,
        "failed_attempts_total": len(attempts),
        "a_answers_after_kill": sum(1 for a in ok if a.backend == "a" and a.end > killed + 0.1),
    }
    by_backend = ", ".join(f"{name[b]} {n}" for b, n in res["by_backend"].items())
    print(
        f"\n2. head a SIGKILLed under load: heads a and b behind haproxy (round robin, httpchk "
        f"/health every 200 ms, fall 1 rise 2, retries 3, redispatch);\n   {args.clients} openai "
        f"SDK threads (2 retries) back to back, kill after {args.kill_warmup:g} s, "
        f"windows of {args.window:g} s"
    )
    print(
        f"   requests answered: {len(ok)} ({by_backend})"
        f"; failed at the clients: {len(failed)} (target 0)"
    )
    for text in res["failures"]:
        print(f"     failure: {text[:200]}")
    attempts_text = "; ".join(f"{t:+.2f} s: {s} ({b})" for t, s, b in res["failed_attempts"])
    print(
        f"   failed attempts, the SDK retried them (time from the kill: error (backend)): "
        f"{len(attempts)}"
        + (f" ({attempts_text})" if attempts else "")
        + f"; requests that took retries: {res['retried_requests']}"
    )
    print(
        "   survivor's fleet view: head a DOWN "
        + (
            f"{down_at:.2f} s after the kill"
            if down_at is not None
            else f"not within {args.down_timeout:g} s"
        )
        + f"; answers from head a ending > 0.1 s after the kill: {res['a_answers_after_kill']}"
    )
    print(
        f"   head b (survivor)                 {'n':>6} {'p50 ms':>9} {'p99 ms':>9} {'max ms':>9}"
    )
    for label, rows in (("before the kill", before), ("after the kill", after)):
        for kind, xs in (
            ("client latency", [(a.end - a.start) * 1e3 for a in rows]),
            ("haproxy Tr", [a.tr_ms for a in rows if a.tr_ms is not None]),
        ):
            n, p50, p99 = lat_stats(xs)
            mx = max(xs) if xs else float("nan")
            print(f"     {label + ', ' + kind:<32}{n:>6} {p50:>9.1f} {p99:>9.1f} {mx:>9.1f}")
            res[f"{label.split()[0]}_{kind.split()[0]}"] = {"n": n, "p50": p50, "p99": p99}
    for kind in ("client", "haproxy"):
        b, a = res[f"before_{kind}"]["p99"], res[f"after_{kind}"]["p99"]
        if b == b and a == a and b > 0:
            res[f"p99_ratio_{kind}"] = a / b
    rc, rh = res.get("p99_ratio_client"), res.get("p99_ratio_haproxy")
    if rc is None:
        print("   survivor p99 after / before: n/a (no answers in a window)")
    else:
        shown = f"{rh:.2f}" if rh is not None else "n/a"
        verdict = "PASS" if rc <= KILL_P99_RATIO else "MISS"
        print(
            f"   survivor p99 after / before: client {rc:.2f}, haproxy Tr {shown} "
            f"(target: within {KILL_P99_RATIO:g}x, client: {verdict})"
        )
    return res, clients, killed, instance


# -- part 3: the killed head started again ------------------------------------------------


@dataclass
class Restart:
    round: int
    down_s: float  # from the kill to the new process's start
    marked_down_s: float | None  # from the kill: head b lists head a DOWN
    http_s: float | None = None  # from the start: first HTTP answer (any status)
    first_status: int | None = None
    healthy_s: float | None = None  # from the start: /health 200
    up_s: float | None = None  # from healthy: both replicas UP in its stages
    served_s: float | None = None  # from healthy: the first chat answered through it
    both_served_s: float | None = None  # from healthy: both replicas have served through it
    seen_by_b_s: float | None = None  # from the start: b lists its new instance UP
    client_failures: int | None = None
    routed_to_it: int | None = None
    error: str | None = None


def restart_round(
    rnd: int,
    fleet: Fleet,
    kill: tuple[float, float | None, str | None],
    logdir: Path,
    args: argparse.Namespace,
) -> tuple[Restart, Proc]:
    """``kill``: when head a was killed, when b marked it DOWN, its instance then."""
    port, master = fleet.http[0], fleet.master[0]
    killed, marked, old_instance = kill
    head = Proc("head-a-again", head_cmd(port, master, None), logdir)
    start = head.started_at
    r = Restart(rnd, start - killed, marked)
    healthy = None
    n = 0
    deadline = start + args.restart_timeout
    while time.monotonic() < deadline:
        if not head.alive():
            r.error = f"the restarted head exited ({head.proc.returncode}){head.log_tail()}"
            break
        if r.seen_by_b_s is None:
            state, instance = view_of(fleet.http[1], master)
            if state == "UP" and instance != old_instance:
                r.seen_by_b_s = time.monotonic() - start
        if healthy is None:
            status = http_status(port, "/health", timeout=1.0)
            now = time.monotonic()
            if status and r.http_s is None:
                r.http_s, r.first_status = now - start, status
            if status == 200:
                healthy = now
                r.healthy_s = now - start
        if healthy is not None:
            if r.up_s is None or r.both_served_s is None:
                up = up_replicas(get_json(port, "/v1/omni/stages"))
                now = time.monotonic()
                if r.up_s is None and len(up) == REPLICAS:
                    r.up_s = now - healthy
                served = [x for x in up if x["dispatched_total"] > 0]
                if r.both_served_s is None and len(served) == REPLICAS:
                    r.both_served_s = now - healthy
            if r.served_s is None or r.both_served_s is None:
                n += 1
                if chat_ok(port, f"restart {rnd} chat {n}") and r.served_s is None:
                    r.served_s = time.monotonic() - healthy
        done = [r.up_s, r.served_s, r.both_served_s, r.seen_by_b_s]
        if all(x is not None for x in done):
            break
        time.sleep(0.01)
    else:
        r.error = f"not all seen within {args.restart_timeout:g} s{head.log_tail()}"
    return r, head


def fmt_s(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def restart_part(
    fleet: Fleet,
    clients: Clients,
    kill: tuple[float, float | None, str | None],
    logdir: Path,
    args: argparse.Namespace,
) -> dict[str, Any]:
    """Part 3. ``kill``: part 2's kill (time, b marking a DOWN, a's instance)."""
    rounds: list[Restart] = []
    head: Proc | None = None
    for rnd in range(1, args.restart_rounds + 1):
        if rnd > 1:
            assert head is not None
            time.sleep(args.settle)
            _, instance = view_of(fleet.http[1], fleet.master[0])
            killed = time.monotonic()
            head.kill()
            if args.down is None:
                marked = wait_marked_down(fleet, killed, args.down_timeout)
            else:
                marked = None
                time.sleep(args.down)
            kill = (killed, marked, instance)
        killed = kill[0]
        r, head = restart_round(rnd, fleet, kill, logdir, args)
        fleet.heads[0] = head
        if args.restart_under_load:
            time.sleep(0.5)  # answers of requests sent before the round's end
            end = time.monotonic()
            with clients.lock:
                mine = [a for a in clients.answers if killed <= a.end < end]
            r.client_failures = sum(1 for a in mine if a.error is not None)
            r.routed_to_it = sum(1 for a in mine if a.backend == "a" and a.error is None)
        rounds.append(r)
        if r.error is not None:
            print(f"! restart round {rnd}: {r.error}", flush=True)
            break
    if args.restart_under_load:
        clients.stop()
    when = (
        "once head b lists it DOWN"
        if args.down is None
        else f"{args.down:g} s after the kill (part 2's: once head b lists it DOWN)"
    )
    print(
        "\n3. head a started again on its master and HTTP ports (no --omni-join), "
        f"{when};\n   {len(rounds)} round(s), killed again {args.settle:g} s after each"
    )
    print(
        "   seconds: from the kill, 'b DOWN' head b listing a DOWN and 'down' the new "
        "process's start;\n   from that start, 'http' the first answer of /health (its "
        "'status') and 'healthy' its first 200;\n   from that 200, 'UP' both replicas UP "
        "in its /v1/omni/stages, 'chat' the first chat answered through it,\n   'both' both "
        "replicas having served a chat through it; from the start, 'b sees' head b listing "
        "its new instance UP"
    )
    hdr = f"   {'round':>5} {'b DOWN':>7} {'down':>6} {'http':>6} {'status':>6} {'healthy':>8}"
    hdr += f" {'UP':>6}"
    hdr += f" {'chat':>6} {'both':>6} {'b sees':>7}"
    if args.restart_under_load:
        hdr += f" {'failed':>7} {'via a':>6}"
    print(hdr)
    for r in rounds:
        line = (
            f"   {r.round:>5} {fmt_s(r.marked_down_s):>7} {r.down_s:>6.2f} {fmt_s(r.http_s):>6} "
            f"{r.first_status if r.first_status is not None else '-':>6} "
            f"{fmt_s(r.healthy_s):>8} {fmt_s(r.up_s):>6} {fmt_s(r.served_s):>6} "
            f"{fmt_s(r.both_served_s):>6} {fmt_s(r.seen_by_b_s):>7}"
        )
        if args.restart_under_load:
            line += f" {r.client_failures!s:>7} {r.routed_to_it!s:>6}"
        print(line)
    served = [r.served_s for r in rounds if r.served_s is not None]
    both = [r.both_served_s for r in rounds if r.both_served_s is not None]
    if served:
        worst = max(served)
        verdict = "PASS" if worst <= SERVED_WITHIN_S and len(served) == len(rounds) else "MISS"
        print(
            f"   first chat after /health 200: median {statistics.median(served):.2f} s, worst "
            f"{worst:.2f} s; both replicas serving: median "
            + (f"{statistics.median(both):.2f} s" if both else "-")
            + f" (target: served within {SERVED_WITHIN_S:g} s of healthy: {verdict})"
        )
    return {"rounds": [asdict(r) for r in rounds]}


def fleet_part(args: argparse.Namespace, logdir: Path) -> dict[str, Any]:
    """Parts 2 and 3, on one fleet."""
    out: dict[str, Any] = {}
    fleet = start_fleet(2, logdir, args.health_timeout)
    heads = list(fleet.heads)  # and every restarted head a, below
    proxy = None
    try:
        proxy_port = free_port()
        cfg = logdir / "haproxy.cfg"
        cfg.write_text(haproxy_cfg(proxy_port, fleet.http))
        proxy = Proc("haproxy", ["haproxy", "-db", "-f", str(cfg)], logdir)
        wait_until(
            lambda: http_status(proxy_port, "/v1/models") == 200, 10, "haproxy serving", [proxy]
        )
        out["kill"], clients, killed, instance = kill_part(fleet, proxy_port, args)
        down = out["kill"]["survivor_marks_dead_down_s"]
        try:
            out["restart"] = restart_part(fleet, clients, (killed, down, instance), logdir, args)
        finally:
            clients.done.set()
    finally:
        # In reverse: haproxy, the replicas, then the heads (the restarted one first).
        heads += [p for p in Proc.started if p.name == "head-a-again"]
        stop_procs([*heads, *fleet.headless, *([proxy] if proxy else [])])
    return out


# -- driver -------------------------------------------------------------------------------


def load_line() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f} {five:.2f} {fifteen:.2f}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", type=int, default=16, help="part 1's closed-loop clients")
    p.add_argument("--duration", type=float, default=10.0, help="part 1's measured seconds")
    p.add_argument("--warmup", type=float, default=2.0, help="part 1's warm-up seconds")
    p.add_argument("--idle", type=float, default=1.0, help="part 1's seconds at rest")
    p.add_argument("--rounds", type=int, default=2, help="part 1: runs of each setup")
    p.add_argument("--clients", type=int, default=4, help="part 2's SDK threads")
    p.add_argument("--kill-warmup", type=float, default=5.0, help="part 2: load before the kill")
    p.add_argument("--window", type=float, default=3.0, help="part 2: seconds before/after")
    p.add_argument("--restart-rounds", type=int, default=3)
    p.add_argument(
        "--down",
        type=float,
        help="part 3: seconds from a kill to the restart (default: once b lists a DOWN)",
    )
    p.add_argument("--down-timeout", type=float, default=15.0, help="most seconds to wait for that")
    p.add_argument("--settle", type=float, default=2.0, help="part 3: served to next kill, s")
    p.add_argument("--restart-timeout", type=float, default=60.0)
    p.add_argument(
        "--restart-under-load",
        action="store_true",
        help="keep part 2's clients running through haproxy during the restarts",
    )
    p.add_argument("--setups", help="part 1: only these setups (comma-separated names)")
    p.add_argument("--parts", default="1,2", help="1 (one head vs two), 2 (kill + restart)")
    p.add_argument("--quick", action="store_true", help="short runs: about a minute")
    p.add_argument("--keep-logs", metavar="DIR", help="copy the processes' logs there")
    common.add_common_args(p, health_timeout=60.0, request_timeout=10.0)
    if p.parse_known_args()[0].quick:  # new defaults: what is given still counts
        p.set_defaults(**QUICK)
    args = p.parse_args()
    if shutil.which("haproxy") is None and "2" in args.parts:
        p.error("part 2 needs haproxy (Debian's package)")
    common.exit_on_sigterm()
    logdir = Path(tempfile.mkdtemp(prefix="bench-heads-"))
    cores = len(os.sched_getaffinity(0))
    print(f"{common.machine()}, {cores} usable; {load_line()} (at the start)", flush=True)
    results: dict[str, Any] = {}
    failed = False
    t0 = time.monotonic()
    try:
        if "1" in args.parts:
            runs = [
                load_run(setup, rnd, args, logdir)
                for rnd in range(1, args.rounds + 1)
                for setup in SETUPS  # alternating: drift hits all alike
                if not args.setups or setup.name in args.setups.split(",")
            ]
            results["heads"] = report_load(runs, args)
            # Nothing is killed in part 1: a failed run or request is a failure.
            bad = sum(r.error is not None or r.errors > 0 for r in runs)
            if bad or not runs:
                failed = True
                print(f"! part 1: {bad} of {len(runs)} run(s) FAILED or had errors", flush=True)
        if "2" in args.parts:
            try:
                results.update(fleet_part(args, logdir))
                restarts = results.get("restart", {}).get("rounds", [])
                if bad := sum(r["error"] is not None for r in restarts):
                    failed = True
                    print(f"! part 3: {bad} restart round(s) FAILED", flush=True)
            except Exception as exc:
                failed = True
                print(f"! parts 2-3 FAILED: {common.describe(exc)}", flush=True)
    finally:
        stop_procs(Proc.started)
        print(f"\n{load_line()} (at the end); {time.monotonic() - t0:.0f} s", flush=True)
        if args.keep_logs:
            shutil.copytree(logdir, args.keep_logs, dirs_exist_ok=True)
            print(f"logs in {args.keep_logs}")
        shutil.rmtree(logdir, ignore_errors=True)
    if args.json:
        common.write_json(args.json, args, results)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
