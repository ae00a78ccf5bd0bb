"""Server CPU time per request: an omnistage head's and its replicas', against the HTTP floor.

Fresh servers (floor, ``echo-1stage``, ``echo``), interleaved over rounds, the same fixed
closed-loop request script for each; the CPU time the server processes spend per request is
steadier than req/s on a small shared machine. See README.md.
"""

import argparse
import asyncio
import contextlib
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from typing import Any

import common
from bench_pipeline import TARGETS, Target, load, start_server, wait_ready
from common import ServerProcess, free_port

CLK_TCK = os.sysconf("SC_CLK_TCK")
PERF_EVENT = "instructions"
try:  # the process CPU clocks of cpu_seconds, else the ticks of /proc/<pid>/stat
    time.clock_gettime((~os.getpid() << 3) | 2)
    CPU_SOURCE = "process CPU clocks (ns)"
except OSError:
    CPU_SOURCE = f"/proc/<pid>/stat ({CLK_TCK} Hz ticks)"
SETTLE_S = 0.3  # after the warm-up: the server closes its connections, perf attaches


@dataclass
class Run:
    target: str
    round: int
    requests: int
    head_ms: float = 0.0  # head CPU (user + system, all threads) per measured request
    replicas_ms: float = 0.0  # the same, summed over the head's descendant processes
    replicas: int = 0  # how many descendant processes were summed
    rps: float = 0.0
    p50_ms: float = 0.0
    head_ratio_to_floor: float | None = None  # against the floor of the same round
    head_instr: float | None = None  # perf instructions per request, if perf can count them
    replicas_instr: float | None = None
    error: str | None = None


# -- /proc and perf -----------------------------------------------------------------------


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of the whole process (all threads, exited ones too).

    Read from its POSIX CPU clock, which Linux lets any process read (the clock id
    clock_getcpuclockid(3) gives): the same figure as utime + stime in /proc/<pid>/stat,
    but in ns where stat rounds down to clock ticks (10 ms, several % of a round)."""
    with contextlib.suppress(OSError):  # not Linux, or the process is gone: try stat
        return time.clock_gettime((~pid << 3) | 2)  # MAKE_PROCESS_CPUCLOCK(pid, SCHED)
    with open(f"/proc/{pid}/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()  # the name may hold spaces
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # fields 14 and 15 of stat(5)


def descendants(pid: int) -> list[int]:
    """Every process below ``pid``, from the ppid in each /proc/N/stat (the
    /proc/N/task/*/children files exist only with CONFIG_PROC_CHILDREN)."""
    kids: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):  # gone since listdir
                kids.setdefault(common.parent_pid(int(entry)), []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        below = kids.get(todo.pop(), [])
        found += below
        todo += below
    return sorted(found)


def parse_perf(text: str) -> float | None:
    """The count from ``perf stat -x,`` output; None for "<not supported>" and the like."""
    for line in text.splitlines():
        fields = line.split(",")
        if len(fields) > 2 and fields[2].startswith(PERF_EVENT):
            with contextlib.suppress(ValueError):
                return float(fields[0])
    return None


def perf_unavailable() -> str | None:
    """None if perf counts instructions here, else why not. Checked by counting them for
    ``true``: perf may be installed where the (virtual) CPU exposes no counters."""
    if shutil.which("perf") is None:
        return "not installed"
    cmd = ["perf", "stat", "-x,", "-e", PERF_EVENT, "--", "true"]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return common.describe(exc)
    if parse_perf(out.stderr) is None:
        return f"{PERF_EVENT} not counted: {out.stderr.strip()[:160]}"
    return None


def perf_start(pids: list[int]) -> subprocess.Popen[str]:
    cmd = ["perf", "stat", "-x,", "-e", PERF_EVENT, "-p", ",".join(map(str, pids))]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def perf_stop(proc: subprocess.Popen[str]) -> float | None:
    """perf prints its counts when interrupted; None if it had none (or died)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
    try:
        return parse_perf(proc.communicate(timeout=10)[1])
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return None


# -- one round of one target --------------------------------------------------------------


def measure(server: ServerProcess, target: Target, args: argparse.Namespace, run: Run) -> None:
    # Warm-up and measured requests are two load() calls (fresh connections each) so that
    # the CPU readings bracket only the measured ones; the 32 connects are noise-level.
    c, timeout = args.concurrency, args.request_timeout
    if args.warmup > 0:  # load() cannot take 0 requests (no latencies to rank)
        asyncio.run(load(target, server.port, c, args.warmup, 0, timeout))
    kids = descendants(server.pid)
    if len(kids) < target.stages:  # replicas elsewhere would silently read as free
        raise RuntimeError(f"{len(kids)} child processes, expected >= {target.stages}")
    perfs: list[subprocess.Popen[str]] = []
    if args.perf:
        perfs = [perf_start([server.pid])] + ([perf_start(kids)] if kids else [])
    try:
        time.sleep(SETTLE_S)
        head0, kids0 = cpu_seconds(server.pid), [cpu_seconds(k) for k in kids]
        result = asyncio.run(load(target, server.port, c, args.requests, 0, timeout))
        head1, kids1 = cpu_seconds(server.pid), [cpu_seconds(k) for k in kids]
    finally:
        counts = [perf_stop(p) for p in perfs]
    if descendants(server.pid) != kids:  # a replica died or was restarted: CPU unaccounted
        raise RuntimeError(f"child processes changed during the run (were {kids})")
    n = args.requests
    run.head_ms, run.replicas_ms = (head1 - head0) * 1e3 / n, (sum(kids1) - sum(kids0)) * 1e3 / n
    run.replicas, run.rps, run.p50_ms = len(kids), result.rps, result.p50_ms
    if counts and counts[0] is not None:
        run.head_instr = counts[0] / n
    if len(counts) > 1 and counts[1] is not None:
        run.replicas_instr = counts[1] / n


def bench_round(target: Target, rnd: int, args: argparse.Namespace) -> Run:
    run = Run(target.name, rnd, args.requests)
    server = None
    try:
        server = start_server(target, free_port())
        wait_ready(server, target, args.health_timeout)
        measure(server, target, args, run)
        print(
            f"  round {rnd} {target.name:<18} head {run.head_ms:.3f} ms/req, replicas "
            f"{run.replicas_ms:.3f} ms/req ({run.replicas} procs), {run.rps:.0f} req/s",
            flush=True,
        )
    except Exception as exc:  # an ExceptionGroup from the load's TaskGroup, too
        run.error = common.describe(exc, args.request_timeout)
        print(f"! round {rnd} {target.name}: FAILED: {run.error}", flush=True)
    finally:
        if server is not None:
            server.stop()
    return run


# -- report -------------------------------------------------------------------------------

FIGURES = (  # (label, Run attribute, format)
    ("head cpu ms/req", "head_ms", ".3f"),
    ("replicas cpu ms/req", "replicas_ms", ".3f"),
    ("head cpu x floor", "head_ratio_to_floor", ".2f"),
    ("req/s", "rps", ".0f"),
    ("p50 ms", "p50_ms", ".2f"),
    ("head instr/req", "head_instr", ",.0f"),
    ("replicas instr/req", "replicas_instr", ",.0f"),
)


def report(targets: list[Target], runs: list[Run]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    print(f"\n{'target':<18} {'figure':<20} {'median':>9} {'min..max':>19} {'spread':>7}")
    for t in targets:
        ok = [r for r in runs if r.target == t.name and r.error is None]
        if not ok:
            why = next(r.error for r in runs if r.target == t.name) or ""
            print(f"{t.name:<18} FAILED: {why.splitlines()[0][:200]}")
            continue
        note = "" if len(ok) == len(runs) // len(targets) else f" ({len(ok)} rounds ok)"
        summary[t.name] = {}
        for label, attr, fmt in FIGURES:
            xs = [v for r in ok if (v := getattr(r, attr)) is not None]
            if not xs or (t.stages == 0 and attr.startswith("replicas")):
                continue  # floor: no replicas, ratio 1 by definition; perf: not counted
            med, lo, hi = statistics.median(xs), min(xs), max(xs)
            spread = f"{(hi - lo) / med:.0%}" if med else "-"  # what a change must beat
            rng = f"{lo:{fmt}}..{hi:{fmt}}"
            print(f"{t.name:<18} {label:<20} {med:>9{fmt}} {rng:>19} {spread:>7}{note}")
            summary[t.name][attr] = {"median": med, "min": lo, "max": hi, "n": len(xs)}
            note = ""
    return summary


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=3000, help="measured requests per round")
    p.add_argument("--warmup", type=int, default=300, help="warm-up requests per round")
    p.add_argument("--concurrency", type=int, default=32, help="closed-loop clients")
    p.add_argument("--rounds", type=int, default=3, help="fresh servers per target")
    names = [t.name for t in TARGETS]
    p.add_argument("--targets", default=",".join(names), help="comma-separated subset")
    p.add_argument(
        "--baseline-tree",
        metavar="PATH",
        help="another checkout (e.g. a git worktree of the commit before a change): each "
        "pipeline target runs from it too, as NAME@base, in the same rounds",
    )
    common.add_common_args(p, health_timeout=120.0, request_timeout=10.0)
    args = p.parse_args()
    wanted = args.targets.split(",")
    if unknown := sorted(set(wanted) - set(names)):
        p.error(f"unknown targets {unknown}; known: {names}")
    targets = [t for t in TARGETS if t.name in wanted]
    if args.baseline_tree:
        tree = os.path.abspath(args.baseline_tree)
        targets += [replace(t, name=f"{t.name}@base", tree=tree) for t in targets if t.stages]
    why = perf_unavailable()
    args.perf = why is None
    print(
        f"{common.machine()}; warm-up {args.warmup}, requests {args.requests}, "
        f"c={args.concurrency}, rounds {args.rounds}; CPU time from {CPU_SOURCE}"
    )
    print("perf: counting instructions" if args.perf else f"perf: not available ({why})")
    common.exit_on_sigterm()
    runs: list[Run] = []
    for rnd in range(1, args.rounds + 1):  # interleaved, so drift hits every target alike
        runs += [bench_round(t, rnd, args) for t in targets]
    floor = {t.name for t in TARGETS if t.stages == 0}
    floors = {r.round: r.head_ms for r in runs if r.target in floor and r.error is None}
    for r in runs:
        if r.error is None and r.target not in floor and floors.get(r.round):
            r.head_ratio_to_floor = r.head_ms / floors[r.round]
    summary = report(targets, runs)
    if args.json:
        sections = {
            "cpu_source": CPU_SOURCE,
            "perf": why or "available",
            "runs": [asdict(r) for r in runs],
        }
        common.write_json(args.json, args, {**sections, "summary": summary}, skip=["perf"])
    # The other rounds' figures stand, but a run that failed is not one of them.
    if failed := sum(r.error is not None for r in runs):
        print(f"! {failed} round(s) FAILED")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
