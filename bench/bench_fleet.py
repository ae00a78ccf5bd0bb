"""How big a fleet one head serves, and a fleet of heads: N simulated replicas on the real
wire protocol.

``--heads`` real heads (``omnistage serve echo-1stage`` with no replicas of their own:
the stage's ``replicas`` overridden to 0): the first plain, each other started with
``--omni-join`` the first's master; once each lists the others UP, ``--workers`` fleet
processes (``fleet_sim.py``) drive N/W simulated replicas each from one asyncio loop,
every replica given the first head and learning the others from it, as a headless
replica does. The fleet processes run at ``--fleet-nice`` more than the benchmark, so the
heads win the CPU. One head is the fleet of one: every phase runs against the heads of
the run, and reports each head and, with several, the fleet.

Per fleet size (``--sizes``) and number of heads (``--heads``, default 1,2), with fresh
heads each time:

1. idle heads, no replicas: their CPU and RSS (the baseline for "per 100 replicas");
2. registration storm: every replica starts cold at once; at each head, time until its
   ``/v1/omni/stages`` shows all N UP (and 50% / 90% past STARTING), and when the
   replicas sent it READY; its CPU by thread (loop / control plane / libzmq I/O),
   replicas seen in ERROR and the oldest heartbeat of a replica UP in the polls (a
   starved control plane); the fleet's lateness sending beats, and the host's TCP
   listen-queue overflows;
3. at rest (all UP, no requests) for ``--rest`` s: each head's CPU (% of one core, its
   threads and any children; by thread) and RSS, per 100 replicas, also above its idle
   figure; the fleet processes' own CPU;
4. req/s: ``bench_pipeline``'s closed-loop HTTP client (``--concurrency`` keep-alive
   connections and ``--requests`` split over the heads, at once) on
   ``/v1/chat/completions``, and how the requests spread over the replicas;
5. detection: ``--victims`` replicas stop heartbeating (no goodbye, sockets left open: a
   hung or partitioned host); time until each head marks its incarnation of them (state
   change times from ``recent_state_changes``) against ``--omni-heartbeat-timeout``;
6. crash: ``--victims`` other replicas close their sockets (a process that died); time
   until each head marks them, and its CPU in the seconds after.

    nice -n 10 python bench/bench_fleet.py [--sizes 100,1000,5000] [--workers 4] [--quick]
        [--heads 1,2] [--rest 20] [--requests 2000] [--concurrency 32] [--victims 5]
        [--json out.json]

Everything it starts (the heads, the fleet processes) runs in its own process group, is
stopped however the run ends, and is killed with the benchmark (its parent-death signal). It
exits 1 when any registration failed (the figures are then not the fleet's), or when a
run stopped early or its requests failed (its figures are partial). See README.md.
"""

import argparse
import asyncio
import contextlib
import http.client
import itertools
import json
import math
import os
import queue
import re
import signal
import socket
import string
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import asdict
from typing import IO, Any

import common
import psutil
from bench_pipeline import Target, load
from common import HOST, ServerProcess
from fleet_report import FleetResult, HeadFigures, fmt, report
from fleet_sim import raise_fd_limit

from omnistage.net import tcp_url
from omnistage.protocol.messages import ReplicaState

PIPELINES = {
    # name: (stage ids, text every response ends with)
    "echo-1stage": ([0], b"[echo]"),
    "echo": ([0, 1, 2], b"[vocoder]"),
}
IDLE_BUSY_PCT = 20.0  # an idle head above this share of a core is noted
FLEET_SIM = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fleet_sim.py")


# -- the processes: fleet workers and heads -------------------------------------------------


class Worker:
    """A fleet process, spoken to by JSON lines on its stdin / stdout."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        self.log: IO[bytes] = tempfile.TemporaryFile()  # noqa: SIM115 (closed in stop)
        cmd = [sys.executable, FLEET_SIM, json.dumps(spec)]
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            start_new_session=True,
        )
        self.ps = psutil.Process(self.proc.pid)
        self._lines: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._early: dict[int, dict[str, Any]] = {}
        self._next_id = 0
        threading.Thread(target=self._read, daemon=True).start()

    def wait_hello(self, timeout: float = 60.0) -> None:
        self._get(None, timeout)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with contextlib.suppress(ValueError):
                self._lines.put(json.loads(line))
        self._lines.put(None)

    def send(self, cmd: str, **kw: Any) -> int:
        self._next_id += 1
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps({"cmd": cmd, "id": self._next_id, **kw}) + "\n").encode())
        self.proc.stdin.flush()
        return self._next_id

    def wait(self, ident: int, timeout: float) -> dict[str, Any]:
        return self._get(ident, timeout)

    def call(self, cmd: str, timeout: float = 60.0, **kw: Any) -> dict[str, Any]:
        return self.wait(self.send(cmd, **kw), timeout)

    def _get(self, ident: int | None, timeout: float) -> dict[str, Any]:
        if ident in self._early:
            return self._early.pop(ident)
        deadline = time.monotonic() + timeout
        while True:
            try:
                msg = self._lines.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"fleet worker {self.spec['index']}: no answer") from None
            if msg is None:
                raise RuntimeError(f"fleet worker {self.spec['index']} exited: {self.log_tail()}")
            if msg.get("id") == ident or (ident is None and msg.get("event") == "hello"):
                if "error" in msg:
                    raise RuntimeError(f"fleet worker {self.spec['index']}: {msg['error']}")
                return msg
            self._early[msg.get("id", -1)] = msg

    def cpu_s(self) -> float:
        try:
            t = self.ps.cpu_times()
            return t.user + t.system
        except psutil.Error:
            return 0.0

    def log_tail(self, n: int = 1500) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")[-n:].strip()

    def stop(self) -> None:
        if self.log.closed:
            return
        with contextlib.suppress(Exception):
            if self.proc.poll() is None:
                self.call("stop", timeout=10.0)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10.0)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5.0)
        self.log.close()


class Head:
    """The head under test, its CPU (all threads, and children if any) and RSS."""

    def __init__(
        self,
        args: argparse.Namespace,
        stage_ids: list[int],
        join: "Head | None" = None,
        name: str = "head",
    ) -> None:
        """``join``: a head whose fleet this one joins (``--omni-join``)."""
        self.name = name
        self.port, self.master_port = distinct_free_ports(2)
        self.master_url = tcp_url(HOST, self.master_port)
        overrides = json.dumps({str(s): {"replicas": 0} for s in stage_ids})
        cmd = [sys.executable, "-m", "omnistage", "serve", args.pipeline]
        cmd += ["--host", HOST, "--port", str(self.port)]
        cmd += ["-oma", HOST, "-omp", str(self.master_port)]
        cmd += ["--stage-overrides", overrides, "--init-timeout", "36000"]
        cmd += ["--omni-heartbeat-timeout", f"{args.heartbeat_timeout:g}"]
        cmd += ["--log-level", args.head_log_level]
        if join is not None:
            cmd += ["--omni-join", f"{HOST}:{join.master_port}"]
        self.server = ServerProcess(name, cmd, self.port, pdeathsig=True)
        self.ps = psutil.Process(self.server.pid)

    def wait_http(self, timeout: float) -> None:
        self.server.wait_ready(timeout, path="/v1/omni/stages")

    def cpu_s(self) -> float:
        total = 0.0
        with contextlib.suppress(psutil.Error):
            for p in [self.ps, *self.ps.children(recursive=True)]:
                with contextlib.suppress(psutil.Error):
                    t = p.cpu_times()
                    total += t.user + t.system
        return total

    def threads_s(self) -> dict[str, float]:
        """The head process's CPU seconds by thread: ``loop`` (the main thread: asyncio,
        HTTP, the orchestrator), ``zmq`` (libzmq's I/O threads), ``control`` (the rest: the
        control-plane thread, which handles registrations, HELLOs and heartbeats)."""
        out = dict.fromkeys(("loop", "control", "zmq"), 0.0)
        tick = os.sysconf("SC_CLK_TCK")
        pid = self.server.pid
        with contextlib.suppress(OSError):
            for tid in os.listdir(f"/proc/{pid}/task"):
                try:
                    with open(f"/proc/{pid}/task/{tid}/stat", "rb") as f:
                        fields = f.read().rsplit(b")", 1)[1].split()
                    with open(f"/proc/{pid}/task/{tid}/comm", "rb") as f:
                        comm = f.read()
                except OSError:
                    continue  # the thread ended
                cpu = (int(fields[11]) + int(fields[12])) / tick  # utime, stime
                group = (
                    "loop" if int(tid) == pid else "zmq" if comm.startswith(b"ZMQ") else "control"
                )
                out[group] += cpu
        return out

    def rss_mib(self) -> float:
        total = 0
        with contextlib.suppress(psutil.Error):
            for p in [self.ps, *self.ps.children(recursive=True)]:
                with contextlib.suppress(psutil.Error):
                    total += p.memory_info().rss
        return total / 2**20

    def stages(self, timeout: float = 60.0) -> tuple[dict[str, Any], float]:
        """``GET /v1/omni/stages`` and the seconds it took."""
        t0 = time.monotonic()
        conn = http.client.HTTPConnection(HOST, self.port, timeout=timeout)
        try:
            conn.request("GET", "/v1/omni/stages")
            resp = conn.getresponse()
            body = resp.read()
        finally:
            conn.close()
        if resp.status != 200:
            raise RuntimeError(f"/v1/omni/stages: HTTP {resp.status}")
        return json.loads(body), time.monotonic() - t0

    def problems(self) -> list[str]:
        """The head log's WARNING / ERROR lines, counted by message (numbers blanked)."""
        seen: Counter[str] = Counter()
        for line in self.server.log_text().splitlines():
            if " WARNING " in line or " ERROR " in line:
                text = line.split(" ", 2)[-1]
                seen[re.sub(r"\d+", "#", text)[:160]] += 1
        return [f"{n}x {text}" for text, n in seen.most_common(5)]

    def stop(self) -> None:
        self.server.stop()


def distinct_free_ports(count: int) -> list[int]:
    """``count`` free ports, all different: ``free_port`` twice may hand out the same one,
    and a master on the HTTP port answers HTTP clients with silence."""
    socks = [socket.socket() for _ in range(count)]
    try:
        for s in socks:
            s.bind((HOST, 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def replica_states(status: dict[str, Any]) -> dict[tuple[int, int, int], str]:
    return {
        (s["stage_id"], r["replica_id"], r["epoch"]): r["state"]
        for s in status["stages"]
        for r in s["replicas"]
    }


def heartbeat_age_max(status: dict[str, Any]) -> float:
    """The longest the head has gone without a heartbeat from a replica it has UP."""
    ages = [
        r["last_heartbeat_age_s"]
        for s in status["stages"]
        for r in s["replicas"]
        if r["state"] == ReplicaState.UP
    ]
    return max(ages, default=0.0)


def listen_overflows() -> int | None:
    """TcpExt ListenOverflows (this host, all sockets): connections the kernel dropped
    because a listening socket's accept queue was full; None where unreadable."""
    try:
        with open("/proc/net/netstat") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for names, values in zip(lines[::2], lines[1::2], strict=False):
        if names.startswith("TcpExt:"):
            row = dict(zip(names.split(), values.split(), strict=True))
            return int(row.get("ListenOverflows", 0))
    return None


def split(x: int, parts: int) -> list[int]:
    return [x // parts + (i < x % parts) for i in range(parts)]


# -- a run: N replicas, H heads -------------------------------------------------------------


def start_heads(count: int, args: argparse.Namespace, res: FleetResult) -> list[Head]:
    """The first head, then the others joined to it; until each lists the others UP."""
    stage_ids = PIPELINES[args.pipeline][0]
    names = ["head"] if count == 1 else list(string.ascii_uppercase[:count])
    heads: list[Head] = []
    try:
        for name in names:
            for attempt in (1, 2):
                head = Head(args, stage_ids, join=heads[0] if heads else None, name=name)
                try:
                    head.wait_http(args.health_timeout)
                    break
                except RuntimeError as exc:
                    # Seen once in many runs on a shared host: a head that never answered
                    # HTTP on its (free) port. A fresh head on fresh ports, once.
                    res.notes.append(f"{name} not ready ({str(exc).splitlines()[0]}); another")
                    print(f"! N={res.n}: {res.notes[-1]}", flush=True)
                    head.stop()
                    if attempt == 2:
                        raise
            heads.append(head)
        if count > 1:
            res.join_s = wait_joined(heads, args.health_timeout)
            print(f"  N={res.n}, {count} heads: joined after {res.join_s:.2f}s", flush=True)
    except BaseException:
        for h in heads:
            h.stop()
        raise
    return heads


def wait_joined(heads: list[Head], timeout: float) -> float:
    """Seconds until every head lists every other one UP (``heads`` in its status)."""
    t0 = time.monotonic()
    want = {h.master_url for h in heads}
    while True:
        ok = True
        for h in heads:
            rows = h.stages()[0].get("heads") or []
            ok = ok and {r["address"] for r in rows if r["state"] == "UP"} >= want
        if ok:
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(f"the heads did not see each other UP within {timeout:g}s")
        time.sleep(0.1)


def run(n: int, count: int, args: argparse.Namespace) -> FleetResult:
    stage_ids, expect = PIPELINES[args.pipeline]
    w = max(1, min(args.workers, n))
    res = FleetResult(n, w)
    heads: list[Head] = []
    workers: list[Worker] = []
    try:
        heads = start_heads(count, args, res)
        res.heads = [HeadFigures(h.name) for h in heads]
        idle(heads, res, args)
        first = 0
        for i, share in enumerate(split(n, w)):
            spec = {
                "index": i,
                "count": share,
                "first": first,
                "stage_ids": stage_ids,
                "master_host": HOST,
                "master_port": heads[0].master_port,
                "heads": count,
                "register_timeout_s": args.storm_timeout,
                "nice": args.fleet_nice,
            }
            workers.append(Worker(spec))
            first += share
        for wk in workers:
            wk.wait_hello()
        res.phases["storm"] = time.time()
        storm(heads, workers, res, args)
        res.phases["rest"] = time.time()
        rest(heads, workers, res, args)
        res.phases["requests"] = time.time()
        requests(heads, workers, res, args, Target(args.pipeline, len(stage_ids), expect))
        res.phases["silence"] = time.time()
        detect(heads, workers, res, args, "silence")
        res.phases["crash"] = time.time()
        detect(heads, workers, res, args, "crash")
    except Exception as exc:
        why = common.describe(exc)
        res.notes.append(f"stopped early: {why.splitlines()[0]}")
        res.partial = True
        print(f"! N={n}, {count} head(s): stopped early: {why}", flush=True)
    finally:
        for h in heads:
            if not h.server.log.closed:
                res.notes += [f"{h.name} log: {p}" for p in h.problems()]
        if args.keep_logs:
            keep_logs(args.keep_logs, f"{n}-{count}", heads, workers, res)
        # The heads first: a fleet that leaves first is N disconnects to each.
        for h in heads:
            h.stop()
        for wk in workers:
            wk.stop()
    return res


def keep_logs(
    folder: str, tag: str, heads: list[Head], workers: list[Worker], res: FleetResult
) -> None:
    os.makedirs(folder, exist_ok=True)
    for h in heads:
        if not h.server.log.closed:
            with open(os.path.join(folder, f"head-{h.name}-{tag}.log"), "w") as f:
                f.write(h.server.log_text())
    for wk in workers:
        if not wk.log.closed:
            with open(os.path.join(folder, f"fleet-{tag}-{wk.spec['index']}.log"), "w") as f:
                f.write(wk.log_tail(1 << 30))
    with open(os.path.join(folder, f"phases-{tag}.json"), "w") as f:
        json.dump(res.phases, f)


# -- the phases -----------------------------------------------------------------------------


def idle(heads: list[Head], res: FleetResult, args: argparse.Namespace) -> None:
    """The heads alone (joined: their gossip runs)."""
    time.sleep(1.0)
    c0, t0 = [h.cpu_s() for h in heads], time.monotonic()
    time.sleep(args.idle)
    for h, fig, c in zip(heads, res.heads, c0, strict=True):
        fig.idle_cpu_pct = (h.cpu_s() - c) / (time.monotonic() - t0) * 100
        fig.idle_rss_mib = h.rss_mib()
        # A head with no replica and no request should sleep: say so when it does not
        # (its other figures are then measured against a busy baseline).
        if fig.idle_cpu_pct > IDLE_BUSY_PCT:
            res.notes.append(f"{h.name} idle, no replica: {fig.idle_cpu_pct:.0f}% of a core")
            print(f"! {res.notes[-1]}", flush=True)


class StormPoll:
    """One head's polls during the storm: when each count of replicas past STARTING
    (READY reached the head: UP, or ERROR since) was first seen; "all UP" needs every
    one of them UP in the same poll."""

    def __init__(self, head: Head, fig: HeadFigures, n: int) -> None:
        self.head, self.fig, self.n = head, fig, n
        self.ready_at: list[float] = []
        self.poll_ms: list[float] = []
        self.polled: list[float] = []
        self.past = 0
        self.cpu0, self.threads0 = head.cpu_s(), head.threads_s()

    def poll(self, at: float) -> float:
        """Poll once (unless all are UP); the seconds it took."""
        fig = self.fig
        if fig.storm_all_up_s is not None:
            return 0.0
        status, took = self.head.stages()
        seen = time.monotonic() - at
        self.poll_ms.append(took * 1e3)
        self.polled.append(seen)
        states = Counter(replica_states(status).values())
        fig.storm_up_at_end = states[ReplicaState.UP]
        past = sum(states.values()) - states[ReplicaState.STARTING]
        self.ready_at += [seen] * max(0, past - self.past)
        self.past = max(self.past, past)
        fig.storm_error_seen = max(fig.storm_error_seen, states[ReplicaState.ERROR])
        fig.storm_hb_age_max_s = max(fig.storm_hb_age_max_s, heartbeat_age_max(status))
        if fig.storm_up_at_end >= self.n:
            fig.storm_all_up_s = seen
        return took

    def finish(self, ready: list[float]) -> None:
        """The CPU it took and the shares past STARTING; ``ready``: the replicas' READY
        times to this head."""
        fig, head = self.fig, self.head
        fig.storm_head_cpu_s = head.cpu_s() - self.cpu0
        fig.storm_threads_s = {k: v - self.threads0[k] for k, v in head.threads_s().items()}
        fig.storm_poll_max_ms = max(self.poll_ms) if self.poll_ms else None
        gaps = sorted(b - a for a, b in itertools.pairwise(self.polled))
        fig.storm_poll_every_s = common.pct(gaps, 50) if gaps else None

        def when(share: float) -> float | None:
            k = math.ceil(self.n * share)
            return self.ready_at[k - 1] if len(self.ready_at) >= k else None

        fig.storm_t50_s, fig.storm_t90_s, fig.storm_all_ready_s = when(0.5), when(0.9), when(1)
        ready.sort()
        if ready:
            fig.storm_ready_p50_s = common.pct(ready, 50)
            fig.storm_ready_p90_s = common.pct(ready, 90)
            fig.storm_ready_max_s = ready[-1]


def storm(heads: list[Head], workers: list[Worker], res: FleetResult, args: argparse.Namespace):
    """Every replica starts cold at once, given the first head: until all N are UP at
    every head."""
    n, at = res.n, time.monotonic() + 0.5
    polls = [StormPoll(h, fig, n) for h, fig in zip(heads, res.heads, strict=True)]
    f0 = sum(wk.cpu_s() for wk in workers)
    overflows = listen_overflows()
    ids = [wk.send("start", at=at, ramp_s=args.ramp) for wk in workers]
    deadline = at + args.storm_timeout
    time.sleep(max(0.0, at - time.monotonic()))
    while time.monotonic() < deadline:
        took = sum(p.poll(at) for p in polls)
        if all(fig.storm_all_up_s is not None for fig in res.heads):
            res.storm_all_up_s = max(fig.storm_all_up_s or 0.0 for fig in res.heads)
            break
        # A poll of 5000 replicas costs the head ~0.1 s: at most ~10% of its time.
        time.sleep(max(args.poll_interval, 9 * took))
    res.storm_fleet_cpu_s = sum(wk.cpu_s() for wk in workers) - f0
    after = listen_overflows()
    if overflows is not None and after is not None:
        res.storm_listen_overflows = after - overflows
    ready: dict[str, list[float]] = {}
    for wk, ident in zip(workers, ids, strict=True):
        answer = wk.wait(ident, args.storm_timeout + 30)
        for port, times in answer["ready"].items():
            ready.setdefault(port, []).extend(times)
        res.storm_failed += answer["failed"]
        res.storm_failed_other += answer["failed_other"]
        res.storm_retried_other += answer["retried_other"]
        for text, k in answer["errors"]:
            res.notes.append(f"registration: {k}x {text}")
    for h, p in zip(heads, polls, strict=True):
        p.finish(ready.get(str(h.master_port), []))
    res.storm_beat_lag_max_ms = max(wk.call("stats")["beat_lag_max_s"] for wk in workers) * 1e3
    for fig in res.heads:
        if fig.storm_all_up_s is None:
            res.notes.append(f"storm: {fig.storm_up_at_end} of {n} UP at {fig.name}")
        print(
            f"  N={n}: storm all UP at {fig.name} {fmt(fig.storm_all_up_s, 's')} (READY p50 "
            f"{fmt(fig.storm_ready_p50_s, 's')}, max {fmt(fig.storm_ready_max_s, 's')}), "
            f"{fmt(fig.storm_head_cpu_s)} CPU-s",
            flush=True,
        )
    failed = f"{res.storm_failed} + {res.storm_failed_other} at the others"
    print(f"  N={n}: failed registrations {failed if len(heads) > 1 else res.storm_failed}")


def rest(heads: list[Head], workers: list[Worker], res: FleetResult, args: argparse.Namespace):
    n = res.n
    time.sleep(args.settle)
    for wk in workers:
        wk.call("stats")  # resets the beat lag and ack counts
    c0, th0 = [h.cpu_s() for h in heads], [h.threads_s() for h in heads]
    f0, t0 = sum(wk.cpu_s() for wk in workers), time.monotonic()
    time.sleep(args.rest)
    wall = res.rest_s = time.monotonic() - t0
    for h, fig, c, th in zip(heads, res.heads, c0, th0, strict=True):
        fig.rest_threads_pct = {k: (v - th[k]) / wall * 100 for k, v in h.threads_s().items()}
        fig.rest_cpu_pct = (h.cpu_s() - c) / wall * 100
        fig.rest_cpu_pct_per_100 = fig.rest_cpu_pct / (n / 100)
        if fig.idle_cpu_pct is not None:
            above = fig.rest_cpu_pct - fig.idle_cpu_pct
            fig.rest_cpu_pct_per_100_above_idle = above / (n / 100)
        fig.rest_rss_mib = h.rss_mib()
        if fig.idle_rss_mib is not None:
            fig.rest_rss_mib_per_100 = (fig.rest_rss_mib - fig.idle_rss_mib) / (n / 100)
    res.rest_fleet_cpu_pct = (sum(wk.cpu_s() for wk in workers) - f0) / wall * 100
    stats = [wk.call("stats") for wk in workers]
    res.rest_beat_lag_max_ms = max(s["beat_lag_max_s"] for s in stats) * 1e3
    res.rest_acks_not_up = sum(v for s in stats for k, v in s["acks"].items() if k != "UP")
    for h, fig in zip(heads, res.heads, strict=True):
        status, took = h.stages()
        fig.stages_poll_ms = took * 1e3
        fig.rest_hb_age_max_s = heartbeat_age_max(status)
        fig.rest_not_up = sum(1 for s in replica_states(status).values() if s != "UP")
        print(
            f"  N={n}: at rest {fig.name} {fig.rest_cpu_pct:.1f}% of a core "
            f"({fmt(fig.rest_cpu_pct_per_100, digits=2)}% per 100), RSS "
            f"{fig.rest_rss_mib:.0f} MiB, not UP {fig.rest_not_up}",
            flush=True,
        )
    print(f"  N={n}: fleet {res.rest_fleet_cpu_pct:.0f}% at rest", flush=True)


def served(workers: list[Worker]) -> dict[str, list[int]]:
    """Requests each replica has taken so far, per head (its master port)."""
    out: dict[str, list[int]] = {}
    for stats in [wk.call("stats") for wk in workers]:
        for port, counts in stats["requests"].items():
            out.setdefault(port, []).extend(counts)
    return out


def requests(
    heads: list[Head],
    workers: list[Worker],
    res: FleetResult,
    args: argparse.Namespace,
    target: Target,
) -> None:
    """The client's connections and requests split over the heads, all at once."""
    if args.requests <= 0:
        return
    k = len(heads)
    conc, reqs, warm = (split(x, k) for x in (args.concurrency, args.requests, args.warmup))
    before = served(workers)
    c0, th0 = [h.cpu_s() for h in heads], [h.threads_s() for h in heads]
    f0, t0 = sum(wk.cpu_s() for wk in workers), time.monotonic()

    async def every() -> list[Any]:
        return await asyncio.gather(
            *(
                load(target, h.port, max(1, c), r, wu, args.request_timeout)
                for h, c, r, wu in zip(heads, conc, reqs, warm, strict=True)
            )
        )

    try:
        loads = asyncio.run(every())
    except Exception as exc:
        res.notes.append(f"requests: {common.describe(exc, args.request_timeout)}")
        res.partial = True
        return
    wall = time.monotonic() - t0
    res.req_fleet_cpu_pct = (sum(wk.cpu_s() for wk in workers) - f0) / wall * 100
    after = served(workers)
    per_replica = [0] * res.n
    for h, fig, c, th, r in zip(heads, res.heads, c0, th0, loads, strict=True):
        fig.req_head_cpu_pct = (h.cpu_s() - c) / wall * 100
        fig.req_threads_pct = {k: (v - th[k]) / wall * 100 for k, v in h.threads_s().items()}
        fig.rps, fig.p50_ms, fig.p99_ms = r.rps, r.p50_ms, r.p99_ms
        port = str(h.master_port)
        counts = [a - b for a, b in zip(after.get(port, []), before.get(port, []), strict=True)]
        fig.served_replicas = sum(1 for x in counts if x)
        per_replica = [a + b for a, b in zip(per_replica, counts + [0] * res.n, strict=False)]
    res.rps = sum(fig.rps or 0.0 for fig in res.heads)
    res.req_total = args.requests + args.warmup
    res.served_replicas = sum(1 for x in per_replica if x)
    res.served_max = max(per_replica, default=0)
    # Uniform random choice: each stage's N/stages replicas share every request.
    per_stage = res.n / len(PIPELINES[args.pipeline][0])
    res.served_expected = res.n * (1 - (1 - 1 / per_stage) ** res.req_total)
    print(
        f"  N={res.n}: {res.rps:.0f} req/s, served by {res.served_replicas} replicas "
        f"(uniform random: {res.served_expected:.0f})",
        flush=True,
    )


def detect(
    heads: list[Head], workers: list[Worker], res: FleetResult, args: argparse.Namespace, how: str
) -> None:
    """Silence (or crash) ``--victims`` replicas; when does each head mark its
    incarnation of each one?"""
    if args.victims <= 0:
        return
    c0 = [h.cpu_s() for h in heads]
    victims: list[dict[str, Any]] = []
    for wk, share in zip(workers, split(args.victims, len(workers)), strict=True):
        if share:
            victims += wk.call(how, count=share)["victims"]
    # Per head: (stage, replica, that head's epoch) -> (last beat to it, when it stopped).
    keys: list[dict[tuple[int, int, int], tuple[float, float]]] = []
    for h in heads:
        mine = {}
        for v in victims:
            link = v["links"].get(str(h.master_port))
            if link is not None:
                key = (v["stage_id"], v["replica_id"], link["epoch"])
                mine[key] = (link["last_beat_wall"], v["at_wall"])
        keys.append(mine)
    marked: list[dict[tuple[int, int, int], float]] = [{} for _ in heads]
    deadline = time.monotonic() + 3 * args.heartbeat_timeout + 10
    cpu: list[float] | None = None
    started, took = time.monotonic(), 0.0
    while time.monotonic() < deadline and any(
        len(m) < len(ks) for m, ks in zip(marked, keys, strict=True)
    ):
        # The times come from the heads' own record of each change (a ring of the last
        # 20), so the polls need not be frequent; a poll of 5,000 replicas costs a busy
        # head's loop up to ~0.9 s, and polls back to back would delay the very work
        # they time: at most a fifth of the heads' time.
        time.sleep(max(0.25 if how == "silence" else 0.05, 4 * took))
        if how == "crash" and cpu is None and time.monotonic() - started >= 3.0:
            cpu = [h.cpu_s() - c for h, c in zip(heads, c0, strict=True)]
        took = sum(marks(h, ks, m) for h, ks, m in zip(heads, keys, marked, strict=True))
    if how == "crash" and cpu is None:
        time.sleep(max(0.0, 3.0 - (time.monotonic() - started)))
        cpu = [h.cpu_s() - c for h, c in zip(heads, c0, strict=True)]
    for i, (fig, ks, m) in enumerate(zip(res.heads, keys, marked, strict=True)):
        # A victim with no session at this head (never READY there) counts as missed.
        missed = len(victims) - len(m)
        if how == "crash":
            fig.crash_head_cpu_s = cpu[i] if cpu else None
            fig.crash_detect_s = sorted(m[x] - ks[x][1] for x in m)
            fig.crash_missed = missed
        else:
            fig.silent_detect_s = sorted(m[x] - ks[x][0] for x in m)
            fig.silent_detect_from_stop_s = sorted(m[x] - ks[x][1] for x in m)
            fig.silent_missed = missed
        shown = fig.crash_detect_s if how == "crash" else fig.silent_detect_s
        print(
            f"  N={res.n}: {how} of {len(victims)}: {fig.name} marked {len(m)}, after "
            f"{', '.join(f'{x:.2f}' for x in shown)} s",
            flush=True,
        )


def marks(
    head: Head, keys: dict[tuple[int, int, int], Any], marked: dict[tuple[int, int, int], float]
) -> float:
    """Into ``marked``: when ``head`` moved each of ``keys`` off UP (wall time). The
    seconds the poll took (0 when it had no need to)."""
    if len(marked) >= len(keys):
        return 0.0
    status, took = head.stages()
    polled = time.time()
    for change in status["recent_state_changes"]:
        key = (change["stage_id"], change["replica_id"], change["epoch"])
        if key in keys and change["old"] == "UP" and key not in marked:
            marked[key] = change["time"]
    for key, state in replica_states(status).items():
        if key in keys and state != ReplicaState.UP and key not in marked:
            marked[key] = polled  # the change left the ring: the poll's time bounds it
    return took


# -- driver ---------------------------------------------------------------------------------


def main() -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--sizes", default="100,1000,5000", help="fleet sizes, comma-separated")
    p.add_argument("--heads", default="1,2", help="heads per run, comma-separated (1: one head)")
    p.add_argument("--workers", type=int, default=4, help="fleet processes")
    p.add_argument("--pipeline", default="echo-1stage", choices=sorted(PIPELINES))
    p.add_argument("--heartbeat-timeout", type=float, default=5.0, help="--omni-heartbeat-timeout")
    p.add_argument("--idle", type=float, default=5.0, help="seconds of the heads alone")
    p.add_argument("--settle", type=float, default=3.0, help="seconds between storm and rest")
    p.add_argument("--rest", type=float, default=20.0, help="seconds measured at rest")
    p.add_argument("--ramp", type=float, default=0.0, help="spread the starts over S s")
    p.add_argument("--storm-timeout", type=float, default=120.0, help="seconds for all to be UP")
    p.add_argument("--poll-interval", type=float, default=0.2, help="/v1/omni/stages polls")
    p.add_argument("--requests", type=int, default=2000, help="measured requests per run")
    p.add_argument("--warmup", type=int, default=200, help="warm-up requests per run")
    p.add_argument("--concurrency", type=int, default=32, help="closed-loop HTTP clients")
    p.add_argument("--victims", type=int, default=5, help="replicas silenced, then crashed")
    p.add_argument("--fleet-nice", type=int, default=5, help="fleet processes' extra niceness")
    p.add_argument("--head-log-level", default="INFO", help="the heads' --log-level")
    p.add_argument("--keep-logs", metavar="DIR", help="keep the heads' and fleet's logs there")
    p.add_argument("--quick", action="store_true", help="100,1000; shorter windows")
    common.add_common_args(p, health_timeout=60.0, request_timeout=30.0)
    args = p.parse_args()
    if args.quick:
        if "--sizes" not in sys.argv:
            args.sizes = "100,1000"
        args.idle, args.settle, args.rest = 2.0, 2.0, 5.0
        args.requests, args.warmup = 500, 100
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    counts = sorted({int(h) for h in args.heads.split(",") if h.strip()})
    if not counts or min(counts) < 1 or max(counts) > 26:
        p.error("--heads takes counts of heads from 1 to 26, e.g. 1,2")
    limit = raise_fd_limit()
    print(
        f"{common.machine()}, load {os.getloadavg()[0]:.2f}; open files {limit}; "
        f"sizes {sizes}, heads {counts}, {args.workers} fleet processes (nice "
        f"+{args.fleet_nice}), pipeline {args.pipeline}, rest {args.rest:g}s, "
        f"{args.requests} requests at c={args.concurrency}, {args.victims} victims"
    )
    need = 3 * max(sizes) + 200
    if need > limit:
        print(f"! a head may need ~{need} open files for {max(sizes)} replicas (limit {limit})")
    common.exit_on_sigterm()
    results: list[FleetResult] = []
    for n in sizes:
        for count in counts:
            print(f"N={n}, {count} head(s):", flush=True)
            results.append(run(n, count, args))
    goals = report(results, args)
    if args.json:
        sections = {"runs": [asdict(r) for r in results], "targets": goals}
        common.write_json(args.json, args, sections)
    # Figures from a fleet that did not form measure something else: say so, and fail.
    if failed := sum(r.storm_failed + r.storm_failed_other for r in results):
        print(f"! {failed} registration(s) failed: the figures above are not the fleet's")
        return 1
    # A run that stopped early, or whose requests failed, lacks the figures after that.
    if bad := sum(r.partial for r in results):
        print(f"! {bad} run(s) stopped early or had failed requests: their figures are partial")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
