"""Failover benchmark: SIGKILL one of a stage's two replicas under a steady open-loop load.

A head serving ``echo-1stage`` runs one local replica of stage 0 and one ``--headless``
replica joins it. Per configuration: a baseline window, then a window in which a replica is
killed midway; detection time, failed requests and p50/p99 latency next to the baseline's.
Three configurations (retries on, retries off, the head's local replica as the victim) in
one run, printed side by side. See README.md.
"""

import argparse
import asyncio
import json
import os
import re
import signal
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any

import common
import httpx
from common import HOST, ServerProcess, free_port

from omnistage.config.engine_args import EchoArgs
from omnistage.config.load import load_config

PIPELINE = "echo-1stage"
STAGE_ID = 0
PATH = "/v1/chat/completions"
# ~90 ms per request: 8 chunks, 10 ms of (sleeping) engine work before each.
DEFAULT_OVERRIDES = '{"0": {"engine_args": {"num_chunks": 8, "chunk_delay_s": 0.01}}}'
WINDOW_BEFORE_S, WINDOW_AFTER_S = 1.0, 3.0  # the failover window around the kill
POLL_INTERVAL_S = 0.01  # /v1/omni/stages polling while waiting for the victim's ERROR


@dataclass(frozen=True)
class Variant:
    name: str
    retries: int  # --omni-max-retries of the head
    victim: str  # "headless" or "local"


VARIANTS = (
    Variant("retries=2, kill headless", 2, "headless"),
    Variant("retries=0, kill headless", 0, "headless"),
    Variant("retries=2, kill local", 2, "local"),
)


@dataclass
class Sample:
    at: float  # scheduled issue time (perf_counter seconds)
    latency: float  # from the scheduled time to the whole response, seconds
    error: str | None  # None: 200 with exactly the expected content


@dataclass
class Stats:
    total: int = 0
    failed: int = 0
    p50_ms: float | None = None
    p99_ms: float | None = None
    max_ms: float | None = None


@dataclass
class Result:
    variant: str
    retries: int
    victim: str
    rate: float = 0.0  # open-loop req/s
    capacity: float | None = None  # closed-loop req/s, measured in the first configuration
    baseline: Stats = field(default_factory=Stats)
    failover: Stats = field(default_factory=Stats)  # the whole second load window
    # Requests issued from WINDOW_BEFORE_S before the kill to WINDOW_AFTER_S after it.
    window: Stats = field(default_factory=Stats)
    detection_ms: float | None = None  # see Detection: the upper bound
    detection_lower_ms: float | None = None  # and the lower one
    # From the kill to the head's log line of the victim's -> ERROR transition (1 ms steps).
    detection_log_ms: float | None = None
    detected_as: str = ""  # the victim's state and reason when the poll first saw it
    victim_replica: dict[str, Any] = field(default_factory=dict)
    killed_at: float = 0.0  # wall-clock time of the kill
    held: int | None = None  # requests the victim held at the last poll before the kill
    retried: int = 0  # retry lines in the head's log during this configuration
    schedule_lag_ms: float = 0.0  # worst lateness of the load generator against its schedule
    errors: list[str] = field(default_factory=list)  # distinct failure messages, a few
    error: str | None = None  # the configuration could not be measured


def stats(samples: list[Sample]) -> Stats:
    # Percentiles of the successful requests only: a fast error must not look like a fast
    # answer; failures are counted on their own.
    ok = sorted(s.latency * 1e3 for s in samples if s.error is None)
    st = Stats(len(samples), len(samples) - len(ok))
    if ok:
        st.p50_ms, st.p99_ms, st.max_ms = common.pct(ok, 50), common.pct(ok, 99), ok[-1]
    return st


# -- the servers ---------------------------------------------------------------------------


class Cluster:
    """A head with one local replica of stage 0, and one headless replica of stage 0."""

    def __init__(self, retries: int, overrides: str) -> None:
        port, self.master_port = free_port(), free_port()
        while self.master_port == port:
            self.master_port = free_port()
        self.url = f"http://{HOST}:{port}"
        omni = [sys.executable, "-m", "omnistage", "serve"]
        master = ["-oma", HOST, "-omp", str(self.master_port)]
        # INFO: the head logs every retry, which is how the report counts them.
        head = [*omni, PIPELINE, "--stage-id", str(STAGE_ID), "--host", HOST]
        head += ["--port", str(port), *master, "--omni-max-retries", str(retries)]
        head += ["--stage-overrides", overrides, "--log-level", "INFO"]
        self.head = ServerProcess(f"head (retries={retries})", head, port)
        # No overrides: a headless replica gets its stage config from the head.
        headless = [*omni, "--headless", "--stage-id", str(STAGE_ID), *master]
        try:
            self.headless = ServerProcess("headless", [*headless, "--log-level", "WARNING"])
        except BaseException:
            self.head.stop()  # nobody else holds it yet
            raise

    def replicas(self) -> list[dict[str, Any]]:
        with urllib.request.urlopen(f"{self.url}/v1/omni/stages", timeout=2.0) as resp:
            return find_stage(json.load(resp))

    def wait_up(self, count: int, timeout: float) -> list[dict[str, Any]]:
        self.head.wait_ready(timeout, interval=0.1)
        deadline, up = time.monotonic() + timeout, []
        while time.monotonic() < deadline:
            for proc in (self.head, self.headless):
                if not proc.alive():
                    raise RuntimeError(f"{proc.name} exited{proc.log_tail()}")
            up = [r for r in self.replicas() if r["state"] == "UP"]
            if len(up) >= count:
                return up
            time.sleep(0.1)
        raise RuntimeError(f"{len(up)} of {count} replicas UP after {timeout:g}s")

    def stop(self) -> None:
        # The head first: it tells the headless replica to shut down as it stops.
        try:
            self.head.stop()
        finally:
            self.headless.stop()


def find_stage(status: dict[str, Any]) -> list[dict[str, Any]]:
    return next(s["replicas"] for s in status["stages"] if s["stage_id"] == STAGE_ID)


def killer_for(cluster: Cluster, victim: dict[str, Any], which: str) -> Callable[[], None]:
    if which == "headless":
        if victim["pid"] != cluster.headless.pid:
            raise RuntimeError(f"headless pid {cluster.headless.pid}, stages say {victim}")
        # Its whole process group: as if its host went away.
        return lambda: os.killpg(cluster.headless.pid, signal.SIGKILL)
    pid = victim["pid"]
    # Only ever a process this benchmark's head started.
    if not pid or common.parent_pid(pid) != cluster.head.pid:
        raise RuntimeError(f"local replica pid {pid} is not a child of the head")
    return lambda: os.kill(pid, signal.SIGKILL)


# -- load ----------------------------------------------------------------------------------


async def one(client: httpx.AsyncClient, prompt: str, at: float, suffix: str) -> Sample:
    body = {"model": PIPELINE, "messages": [{"role": "user", "content": prompt}]}
    error = None
    try:
        resp = await client.post(PATH, json=body)
        if resp.status_code != 200:
            error = f"HTTP {resp.status_code}: {resp.text[:300]}"
        elif (got := resp.json()["choices"][0]["message"]["content"]) != prompt + suffix:
            error = f"wrong content {got[:200]!r}"
    except Exception as exc:  # a timeout, a reset connection, a body that is not JSON
        error = f"{type(exc).__name__}: {exc}"
    return Sample(at, time.perf_counter() - at, error)


async def open_loop(
    client: httpx.AsyncClient, rate: float, duration: float, start: float, tag: str, suffix: str
) -> tuple[list[Sample], float]:
    """Issue requests at ``rate``/s from ``start`` on, on schedule whatever the answers do.

    Latency counts from the scheduled time, so a late client does not hide a slow server.
    Returns the samples and the worst lateness against the schedule (seconds).
    """
    tasks, lag = [], 0.0
    for i in range(round(rate * duration)):
        at = start + i / rate
        if (delay := at - time.perf_counter()) > 0:
            await asyncio.sleep(delay)
        lag = max(lag, time.perf_counter() - at)
        tasks.append(asyncio.create_task(one(client, f"{tag} {i}", at, suffix)))
    return list(await asyncio.gather(*tasks)), lag


async def closed_loop(
    client: httpx.AsyncClient, clients: int, duration: float, suffix: str
) -> tuple[float, list[Sample]]:
    """``clients`` workers, one request at a time each; returns completed req/s."""
    samples: list[Sample] = []
    stop_at = time.perf_counter() + duration

    async def worker(w: int) -> None:
        i = 0
        while time.perf_counter() < stop_at:
            samples.append(await one(client, f"capacity {w} {i}", time.perf_counter(), suffix))
            i += 1

    start = time.perf_counter()
    await asyncio.gather(*(worker(w) for w in range(clients)))
    wall = time.perf_counter() - start
    return sum(s.error is None for s in samples) / wall, samples


@dataclass
class Detection:
    killed: float  # perf_counter time of the kill
    killed_wall: float  # and its wall-clock time, to compare with the head's log
    held: int | None  # the victim's requests in flight (the head's count) just before
    # Seconds from the kill to the answer of the first poll that showed the victim in
    # ERROR (an upper bound), and to the sending of the last poll that still showed it
    # UP (a lower bound: that answer was taken after it was sent).
    upper: float | None = None
    lower: float = 0.0
    seen: str = ""  # the victim's state and reason as that poll showed them


async def kill_and_watch(
    poll: httpx.AsyncClient, victim: dict[str, Any], kill: Callable[[], None], at: float
) -> Detection:
    """At ``at``, kill the victim; then poll the stages until it is ERROR."""
    await asyncio.sleep(max(0.0, at - time.perf_counter()))
    # What the victim holds just before it dies: with retries off, about what fails.
    before = find_stage((await poll.get("/v1/omni/stages")).json())
    held = [r["in_flight"] for r in before if r["replica_id"] == victim["replica_id"]]
    det = Detection(time.perf_counter(), time.time(), held[0] if held else None)
    kill()
    while (sent := time.perf_counter()) - det.killed < 15.0:
        try:
            replicas = find_stage((await poll.get("/v1/omni/stages")).json())
        except (httpx.HTTPError, ValueError, KeyError, StopIteration):
            replicas = []
        mine = [r for r in replicas if r["replica_id"] == victim["replica_id"]]
        if mine and mine[0]["epoch"] != victim["epoch"]:  # restarted before a poll saw ERROR
            det.seen = "replaced by a new epoch"
        elif mine and mine[0]["state"] == "ERROR":
            det.seen = f"ERROR ({mine[0]['reason']})"
        elif mine:
            det.lower = sent - det.killed
        if det.seen:
            det.upper = time.perf_counter() - det.killed
            return det
        await asyncio.sleep(POLL_INTERVAL_S)
    det.seen = "still not ERROR 15 s after the kill"
    return det


def failures(samples: list[Sample], few: int = 3) -> list[str]:
    seen: dict[str, None] = {}
    for s in samples:
        if s.error is not None and len(seen) < few:
            seen.setdefault(s.error.replace("\n", " ")[:300])
    return list(seen)


async def measure(
    cluster: Cluster, variant: Variant, args: argparse.Namespace, res: Result
) -> None:
    """The windows of one configuration; on the first one also the capacity. Fills res."""
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=1000)
    timeout = httpx.Timeout(args.request_timeout)
    async with (
        httpx.AsyncClient(
            base_url=cluster.url, timeout=timeout, limits=limits, trust_env=False
        ) as client,
        httpx.AsyncClient(base_url=cluster.url, timeout=2.0, trust_env=False) as poll,
    ):
        if not res.rate:
            await closed_loop(client, args.capacity_clients, 0.5, args.suffix)  # warm-up
            capacity, samples = await closed_loop(
                client, args.capacity_clients, args.capacity_s, args.suffix
            )
            if bad := failures(samples):
                raise RuntimeError(f"failed while measuring capacity: {bad[0]}")
            res.capacity, res.rate = capacity, capacity * args.load_fraction
            print(
                f"capacity: {capacity:.1f} req/s (closed loop, c={args.capacity_clients}, "
                f"{args.capacity_s:g} s) -> open-loop load {res.rate:.1f} req/s",
                flush=True,
            )
        # Warm-up at the load's rate: connections open, both replicas have served.
        await open_loop(client, res.rate, args.warmup_s, time.perf_counter(), "warmup", args.suffix)
        base, lag1 = await open_loop(
            client, res.rate, args.baseline_s, time.perf_counter(), "baseline", args.suffix
        )
        res.baseline = stats(base)
        replicas = find_stage((await poll.get("/v1/omni/stages")).json())
        up = [r for r in replicas if r["state"] == "UP"]
        victims = [r for r in up if r["local"] == (variant.victim == "local")]
        if len(up) != 2 or not victims:
            raise RuntimeError(f"no {variant.victim} replica among the UP ones: {replicas}")
        victim = victims[0]
        res.victim_replica = {k: victim[k] for k in ("replica_id", "epoch", "pid", "local")}
        kill = killer_for(cluster, victim, variant.victim)
        start = time.perf_counter()
        watch = asyncio.create_task(kill_and_watch(poll, victim, kill, start + args.failover_s / 2))
        fo, lag2 = await open_loop(
            client, res.rate, args.failover_s, start, "failover", args.suffix
        )
        det = await watch
    res.detected_as, res.detection_lower_ms = det.seen, det.lower * 1e3
    res.killed_at, res.held = det.killed_wall, det.held
    res.detection_ms = None if det.upper is None else det.upper * 1e3
    res.failover = stats(fo)
    lo, hi = det.killed - WINDOW_BEFORE_S, det.killed + WINDOW_AFTER_S
    res.window = stats([s for s in fo if lo <= s.at <= hi])
    res.schedule_lag_ms = max(lag1, lag2) * 1e3
    res.errors = failures([*base, *fo])


def logged_detection(log: str, victim: dict[str, Any], killed_wall: float) -> float | None:
    """Milliseconds from the kill to the head's log line saying the victim went ERROR."""
    who = f"stage {STAGE_ID} replica {victim['replica_id']} (epoch {victim['epoch']}): "
    line = re.compile(
        rf"^(\S+ \S+) \w+ omnistage\.control\.coordinator: {re.escape(who)}\S+ -> ERROR",
        re.MULTILINE,
    )
    for m in line.finditer(log):
        # The head logs local time with milliseconds (omnistage.logs).
        at = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
        if at >= killed_wall - 0.002:  # the line's time is truncated to the millisecond
            return max(0.0, (at - killed_wall) * 1e3)
    return None


def save_logs(cluster: Cluster, variant: Variant, folder: str) -> None:
    os.makedirs(folder, exist_ok=True)
    slug = variant.name.replace(", ", "_").replace("=", "").replace(" ", "-")
    for proc, role in ((cluster.head, "head"), (cluster.headless, "headless")):
        with open(os.path.join(folder, f"{slug}.{role}.log"), "w") as f:
            f.write(proc.log_text())


def run_variant(variant: Variant, args: argparse.Namespace, rate: float) -> tuple[Result, float]:
    res = Result(variant.name, variant.retries, variant.victim, rate)
    print(f"{variant.name} ...", flush=True)
    cluster = None
    try:
        cluster = Cluster(variant.retries, args.stage_overrides)
        cluster.wait_up(2, args.health_timeout)
        asyncio.run(measure(cluster, variant, args, res))
    except Exception as exc:
        res.error = common.describe(exc)
        print(f"! {variant.name}: {res.error}", flush=True)
    finally:
        if cluster is not None:
            if not cluster.head.log.closed:
                log = cluster.head.log_text()
                res.retried = log.count("; retry ")
                if res.detection_ms is not None:
                    res.detection_log_ms = logged_detection(log, res.victim_replica, res.killed_at)
                if args.logs:
                    save_logs(cluster, variant, args.logs)
            cluster.stop()
    return res, res.rate


# -- report --------------------------------------------------------------------------------


def report(results: list[Result]) -> list[dict[str, Any]]:
    def ms(x: float | None) -> str:
        return "-" if x is None else f"{x:.1f}"

    print(
        f"\n{'config':<25} {'detect ms':>9} {'log ms':>6} {'held':>4} {'failed/total':>12} "
        f"{'retried':>7} "
        f"{'p50 base':>8} {'p50 fo':>8} {'p99 base':>8} {'p99 fo':>8} {'p99 x':>6}"
    )
    for r in results:
        if r.error is not None:
            print(f"{r.variant:<25} FAILED: {r.error.splitlines()[0][:150]}")
            continue
        b, w = r.baseline, r.window
        ratio = f"{w.p99_ms / b.p99_ms:.2f}" if w.p99_ms and b.p99_ms else "-"
        print(
            f"{r.variant:<25} {ms(r.detection_ms):>9} {ms(r.detection_log_ms):>6} "
            f"{'-' if r.held is None else r.held:>4} "
            f"{f'{r.failover.failed}/{r.failover.total}':>12} {r.retried:>7} "
            f"{ms(b.p50_ms):>8} {ms(w.p50_ms):>8} {ms(b.p99_ms):>8} {ms(w.p99_ms):>8} {ratio:>6}"
        )
    print(
        "\ndetect ms: the first /v1/omni/stages poll showing the victim ERROR (polled every "
        f"{POLL_INTERVAL_S * 1e3:g} ms); log ms: the head's log line of that transition; "
        "held: requests the victim had in flight just before the kill.\n"
        f"failed/total: the whole failover load window (non-200 or wrong content); "
        f"p50/p99 fo: requests issued {WINDOW_BEFORE_S:g} s before to {WINDOW_AFTER_S:g} s "
        "after the kill (successful ones); retried: retries in the head's log."
    )
    for r in results:
        if r.error is None:
            print(
                f"  {r.variant}: {r.detected_as} {r.detection_lower_ms:.1f}-"
                f"{ms(r.detection_ms)} ms after the kill; max fo {ms(r.window.max_ms)} ms; "
                f"baseline failed {r.baseline.failed}/{r.baseline.total}; "
                f"load lag <= {r.schedule_lag_ms:.0f} ms"
            )
            for e in r.errors:
                print(f"    e.g. {e[:160]}")
    on = [r for r in results if r.retries > 0]
    met = bool(on) and all(r.error is None and r.failover.failed == 0 for r in on)
    failed = sum(r.failover.failed + r.baseline.failed for r in on if r.error is None)
    print("\ntarget:")
    goal = "0 failed requests with retries on"
    print(f"  {goal:<40} {failed:>4}  {'PASS' if met else 'MISS'}")
    return [{"goal": goal, "value": failed, "met": met}]


def main() -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--capacity-clients", type=int, default=8, help="closed-loop clients")
    p.add_argument("--capacity-s", type=float, default=3.0, help="seconds of capacity run")
    p.add_argument(
        "--load-fraction", type=float, default=0.5, help="open-loop rate / capacity (0.5)"
    )
    p.add_argument("--rate", type=float, help="open-loop req/s (default: measured)")
    p.add_argument("--warmup-s", type=float, default=1.0, help="warm-up at the load's rate")
    p.add_argument("--baseline-s", type=float, default=8.0, help="baseline window, seconds")
    p.add_argument(
        "--failover-s", type=float, default=8.0, help="failover window; the kill is midway"
    )
    over = "JSON for the head's --stage-overrides (default: 8 chunks, 10 ms apart)"
    p.add_argument("--stage-overrides", default=DEFAULT_OVERRIDES, metavar="JSON", help=over)
    p.add_argument("--logs", metavar="DIR", help="keep the head's and replica's logs here")
    common.add_common_args(p, health_timeout=60.0, request_timeout=10.0)
    args = p.parse_args()
    if args.failover_s / 2 < max(WINDOW_BEFORE_S, WINDOW_AFTER_S):
        p.error(f"--failover-s must be >= {2 * max(WINDOW_BEFORE_S, WINDOW_AFTER_S):g}")
    stage = load_config(PIPELINE, args.stage_overrides).stage(STAGE_ID)
    # What the echo engine appends: its suffix argument, else " [<stage name>]".
    suffix = EchoArgs.model_validate(stage.engine_args).suffix
    args.suffix = suffix if suffix is not None else f" [{stage.name}]"
    print(
        f"{common.machine()}; {PIPELINE} stage {STAGE_ID} engine_args "
        f"{json.dumps(stage.engine_args)}; 2 replicas (head-local + headless); "
        f"baseline {args.baseline_s:g} s, failover {args.failover_s:g} s",
        flush=True,
    )
    common.exit_on_sigterm()
    results: list[Result] = []
    rate = args.rate or 0.0
    started = time.monotonic()
    try:
        for variant in VARIANTS:
            res, measured = run_variant(variant, args, rate)
            rate = rate or measured  # the first configuration's capacity sets the load for all
            results.append(res)
    except KeyboardInterrupt:  # the servers are stopped already (run_variant's finally)
        print("interrupted", file=sys.stderr)
        return 130
    goals = report(results)
    print(f"\ntotal {time.monotonic() - started:.0f} s")
    if args.json:
        capacity = next((r.capacity for r in results if r.capacity), None)
        sections = {"capacity": capacity, "rate": rate, "results": [asdict(r) for r in results]}
        common.write_json(args.json, args, sections | {"targets": goals})
    # Failed requests are the target's figure (a MISS exits 0); a configuration that
    # did not run to the end has no figures.
    if failed := sum(r.error is not None for r in results):
        print(f"! {failed} configuration(s) FAILED")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
