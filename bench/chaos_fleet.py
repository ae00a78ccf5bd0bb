"""``bench_chaos --kill heads`` / ``--kill api``: the voice pipeline served by two joined
heads (``--omni-join``) on one PostgreSQL store, behind haproxy with the example config
of docs/distributed.md, and once every ``--kill-every`` seconds (default 60) a head (its
whole process group) or, with ``--kill api``, one of a head's two API server processes
(``--api-server-count 2``) SIGKILLed.

The deployment is the one docs/distributed.md gives for a fleet that outlives any head:
the heads run no replica (``--stage-id 0 --omni-dp-size-local 0``) and one headless
replica per stage (listener, thinker, talker), given the first head's master, serves
both heads. A killed head is started again, with its own command line and ports, after
``--restart-after`` s, as an operator's supervisor (systemd ``Restart=always``) would; a
killed API server process is started again by its head. The clients (chaos_clients.py)
run through haproxy.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import statistics
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # for tests.postgres

import bench_chaos
import chaos_clients
import common
import psutil
from chaos_clients import Clients
from common import HOST, ServerProcess, free_port

from tests.postgres import postgres_database

NAMES = ("a", "b")


def haproxy_cfg(port: int, heads: list[int]) -> str:
    """docs/distributed.md's config, with a log line per request for the re-sends."""
    servers = common.haproxy_servers(heads)
    return f"""global
    maxconn 512
    log stdout format raw local0 info
defaults
    mode http
    log global
    log-format "%HM %HP %ST %rc %s %Ta"
    timeout connect 1s
    timeout client 300s
    timeout server 300s
    timeout tunnel 600s
    timeout check 1s
frontend api
    bind {HOST}:{port}
    default_backend heads
backend heads
    balance roundrobin
    option httpchk GET /health
    retries 3
    retry-on conn-failure empty-response
    option http-buffer-request
    option redispatch
{servers}
"""


@dataclass
class Head:
    name: str
    port: int
    master: int
    cmd: list[str]
    logdir: Path
    proc: ServerProcess | None = None
    starts: int = 0

    def start(self) -> None:
        """From the main thread (pdeathsig follows the thread that forked)."""
        self.starts += 1
        log = self.logdir / f"head-{self.name}-{self.starts}.log"
        self.proc = ServerProcess(f"head-{self.name}", self.cmd, self.port, log_path=log,
                                  pdeathsig=True)  # fmt: skip

    def api_servers(self) -> list[int]:
        assert self.proc is not None
        kids = psutil.Process(self.proc.pid).children()
        return [k.pid for k in kids if "omnistage.api.server" in " ".join(k.cmdline())]


@dataclass
class Fleet:
    heads: list[Head]
    others: list[ServerProcess] = field(default_factory=list)  # replicas, haproxy
    proxy_log: Path | None = None

    def stop(self) -> None:
        for head in self.heads:
            if head.proc is not None:
                head.proc.stop()
        for p in reversed(self.others):
            p.stop()


def healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://{HOST}:{port}/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def serving(port: int) -> bool:
    """Every stage of the voice pipeline with an UP replica, as this head sees it."""
    try:
        view = bench_chaos.stages(port)
    except OSError:
        return False
    return len(view) == 3 and all(any(r["state"] == "UP" for r in rs) for rs in view.values())


def wait(cond: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} within {timeout:.0f}s")
        time.sleep(0.3)


def start_fleet(args: argparse.Namespace, pg: str, logdir: Path) -> tuple[Fleet, int]:
    base = [sys.executable, "-m", "omnistage", "serve", "voice", "--stage-id", "0"]
    base += ["--omni-dp-size-local", "0", "--host", HOST, "--store-url", pg]
    base += ["--media-url", str(logdir / "media"), "--log-level", "INFO"]
    if args.kill == "api":
        base += ["--api-server-count", "2"]
    ports, masters = [free_port(), free_port()], [free_port(), free_port()]
    heads = []
    for i, name in enumerate(NAMES):
        cmd = [*base, "--port", str(ports[i]), "-oma", HOST, "-omp", str(masters[i])]
        if i:
            cmd += ["--omni-join", f"{HOST}:{masters[0]}"]
        heads.append(Head(name, ports[i], masters[i], cmd, logdir))
    fleet = Fleet(heads)
    heads[0].start()
    wait(lambda: _answers(ports[0]), 120, "head a's HTTP")
    heads[1].start()
    for sid in bench_chaos.STAGES:
        cmd = [sys.executable, "-m", "omnistage", "serve", "--headless", "--stage-id", str(sid)]
        cmd += ["-oma", HOST, "-omp", str(masters[0]), "--log-level", "INFO"]
        log = logdir / f"replica-{sid}.log"
        fleet.others.append(ServerProcess(f"replica-{sid}", cmd, log_path=log, pdeathsig=True))
    for head in heads:
        wait(lambda h=head: serving(h.port), 600, f"head {head.name} serving every stage")
    proxy_port = free_port()
    fleet.proxy_log = logdir / "haproxy.log"
    cfg = logdir / "haproxy.cfg"
    cfg.write_text(haproxy_cfg(proxy_port, ports))
    fleet.others.append(
        ServerProcess(
            "haproxy", ["haproxy", "-f", str(cfg)], log_path=fleet.proxy_log, pdeathsig=True
        )
    )
    wait(lambda: healthy(proxy_port), 10, "haproxy serving")
    return fleet, proxy_port


def _answers(port: int) -> bool:
    try:
        urllib.request.urlopen(f"http://{HOST}:{port}/health", timeout=2)
    except urllib.error.HTTPError:
        return True
    except OSError:
        return False
    return True


@dataclass
class Kill:
    what: str  # "head a", "head b api server"
    at: float
    back_s: float | None = None  # to the head's /health 200 (api: the new process up)


async def killer(fleet: Fleet, args: argparse.Namespace, stop: asyncio.Event, kills: list[Kill]):
    rng = random.Random(args.seed)
    while not stop.is_set():
        await asyncio.sleep(args.kill_every)
        if stop.is_set():
            return
        up = [h for h in fleet.heads if await asyncio.to_thread(healthy, h.port)]
        if len(up) < 2:  # the last one's restart is late: kill none rather than both
            print("  skipped a kill: a head is not healthy yet", flush=True)
            continue
        head = rng.choice(fleet.heads)
        assert head.proc is not None
        if args.kill == "heads":
            kill = Kill(f"head {head.name}", time.monotonic())
            os.killpg(head.proc.pid, signal.SIGKILL)
            head.proc.proc.wait()
            await asyncio.sleep(args.restart_after)
            head.proc.stop()
            head.start()
        else:
            before = head.api_servers()
            victim = rng.choice(before)
            kill = Kill(f"head {head.name} API server", time.monotonic())
            os.kill(victim, signal.SIGKILL)
        kills.append(kill)
        print(f"  {time.strftime('%H:%M:%S')} killed {kill.what}", end="", flush=True)
        while not stop.is_set():
            await asyncio.sleep(0.2)
            back = await asyncio.to_thread(healthy, head.port)
            if args.kill == "api":
                back = back and len(head.api_servers()) == 2 and victim not in head.api_servers()
            if back:
                kill.back_s = time.monotonic() - kill.at
                break
        print(f"; back after {kill.back_s or float('nan'):.1f} s", flush=True)


async def run(url: str, fleet: Fleet, args: argparse.Namespace, wavs: list[str]):
    c, stop, kills = Clients(), asyncio.Event(), []
    clients = [chaos_clients.chat_client(url, wavs, stop, c) for _ in range(args.chat_clients)]
    clients += [chaos_clients.realtime_client(url, stop, c) for _ in range(args.sessions)]
    tasks = [asyncio.create_task(x) for x in clients]
    await asyncio.sleep(args.baseline_s)
    c.phase = "chaos"
    print(f"baseline done: {len(c.requests)} answers; killing now", flush=True)
    load0 = os.getloadavg()
    task = asyncio.create_task(killer(fleet, args, stop, kills))
    await asyncio.sleep(args.minutes * 60)
    stop.set()
    await task
    await asyncio.gather(*tasks)  # every answer under way finishes
    return c, kills, (load0, os.getloadavg())


def haproxy_resends(log: Path) -> tuple[int, int, int]:
    """From haproxy's log: requests, requests it sent again (``%rc``: retries, with a
    ``+`` when redispatched to another server), and heads it took out of rotation on a
    check that timed out (a live but slow head: a dead one refuses the connection)."""
    total = resent = slow = 0
    for line in log.read_text(errors="replace").splitlines():
        m = re.match(r"(GET|POST) \S+ (\d+) \+?(\d+) ", line)
        if m:
            total += 1
            resent += int(m.group(3)) > 0
        slow += line.startswith("Server ") and "DOWN, reason: Layer7 timeout" in line
    return total, resent, slow


def report(c: Clients, kills: list[Kill], proxy: tuple[int, int, int], loads: Any) -> None:
    print(
        f"\n{'phase':<9} {'answers':<12} {'n':>4} {'ok':>4} {'lost pre-stream':>15} "
        f"{'SDK retried':>11} {'broke+asked again':>17} {'wait p50':>8} {'max':>6} "
        f"{'stall>1s':>8}"
    )
    for phase, kind, rows in bench_chaos.by_phase_kind(c.requests):
        waits = [r.wait_s for r in rows if r.wait_s is not None]
        broke = [r for r in rows if r.broken]
        print(
            f"{phase:<9} {kind:<12} {len(rows):>4} {sum(r.ok for r in rows):>4} "
            f"{sum(r.lost_before_stream for r in rows):>15} "
            f"{sum(r.sdk_retries > 0 for r in rows):>11} "
            f"{f'{len(broke)} ({sum(r.ok for r in broke)} ok)':>17} "
            f"{statistics.median(waits) if waits else float('nan'):>8.2f} "
            f"{max(waits, default=float('nan')):>6.2f} "
            f"{sum(r.stall_s > bench_chaos.GAP_S for r in rows):>8}"
        )
    s = c.sessions
    waits = [w for x in s for w in x.resume_waits]
    print(
        f"\nrealtime sessions: {len(s)}; drops {sum(x.drops for x in s)}, resumed "
        f"{sum(x.resumed for x in s)}, not resumed {sum(x.not_resumed for x in s)}; "
        f"drop -> resumed max {max(waits, default=float('nan')):.2f} s"
    )
    total, resent, slow = proxy
    print(
        f"haproxy: {total} requests, {resent} sent again to a head (retry-on); "
        f"a live head out on a /health check that timed out: {slow}"
    )
    backs = [k.back_s for k in kills if k.back_s is not None]
    print(
        f"kills: {len(kills)} ({', '.join(k.what for k in kills)}); back (healthy) after "
        f"median {statistics.median(backs) if backs else float('nan'):.1f} s, "
        f"max {max(backs, default=float('nan')):.1f} s"
    )
    print(f"load average (1, 5, 15 min) at the first kill {loads[0]}, at the end {loads[1]}")
    for e in c.errors[:20]:
        print(f"  {e}")


def main(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory() as tmp, postgres_database(durable=True) as pg:
        logdir = Path(args.log or tmp)
        logdir.mkdir(parents=True, exist_ok=True)
        fleet = None
        try:
            fleet, proxy_port = start_fleet(args, pg, logdir)
            wavs = [bench_chaos.spoken(fleet.heads[0].port, q) for q in bench_chaos.QUESTIONS]
            url = f"http://{HOST}:{proxy_port}"
            c, kills, loads = asyncio.run(run(url, fleet, args, wavs))
            assert fleet.proxy_log is not None
            proxy = haproxy_resends(fleet.proxy_log)  # before the stop, which slows checks
        except Exception as exc:
            print(f"FAILED: {common.describe(exc)}")
            return 1
        finally:
            if fleet is not None:
                fleet.stop()
        report(c, kills, proxy, loads)
        if args.json:
            raw = {
                "requests": [r.__dict__ for r in c.requests],
                "kills": [k.__dict__ for k in kills],
            }
            raw |= {"sessions": [x.__dict__ for x in c.sessions], "load": loads}
            Path(args.json).write_text(json.dumps(raw))
    return 0
