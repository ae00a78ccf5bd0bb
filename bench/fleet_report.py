"""bench_fleet's figures and their report: per fleet size and number of heads, a column
for each head and, with several, one for the fleet (the heads together)."""

import argparse
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

TARGET_STORM_S = 10.0  # 1000 replicas registered and UP within this
TARGET_STORM_N = 1000
TARGET_CPU_PER_100 = 1.0  # % of one core per 100 idle replicas
# A silent replica is marked on the head's first 0.1 s expiry tick past the heartbeat
# timeout (since its last heartbeat): allowed that tick and as much again for scheduling.
DETECT_SLACK_S = 0.25


@dataclass
class HeadFigures:
    """One head's figures."""

    name: str
    # alone (joined to the others, if any), no replica
    idle_cpu_pct: float | None = None
    idle_rss_mib: float | None = None
    # registration storm, this head's view: all N UP in one poll; the first poll with
    # 50% / 90% / all past STARTING (READY reached it)
    storm_all_up_s: float | None = None
    storm_up_at_end: int = 0
    storm_t50_s: float | None = None
    storm_t90_s: float | None = None
    storm_all_ready_s: float | None = None
    storm_poll_every_s: float | None = None  # median time between those polls
    storm_poll_max_ms: float | None = None
    storm_ready_p50_s: float | None = None  # replica side: READY sent to this head
    storm_ready_p90_s: float | None = None
    storm_ready_max_s: float | None = None
    storm_head_cpu_s: float | None = None
    storm_threads_s: dict[str, float] = field(default_factory=dict)  # CPU-s by thread
    # In the polls: replicas in ERROR at once, the oldest heartbeat of a replica UP.
    storm_error_seen: int = 0
    storm_hb_age_max_s: float = 0.0
    # at rest
    rest_cpu_pct: float | None = None
    rest_cpu_pct_per_100: float | None = None
    rest_cpu_pct_per_100_above_idle: float | None = None
    rest_threads_pct: dict[str, float] = field(default_factory=dict)
    rest_rss_mib: float | None = None
    rest_rss_mib_per_100: float | None = None  # above the idle head's
    rest_not_up: int | None = None
    rest_hb_age_max_s: float | None = None
    stages_poll_ms: float | None = None  # one /v1/omni/stages at rest
    # req/s: this head's share of the client
    rps: float | None = None
    p50_ms: float | None = None
    p99_ms: float | None = None
    req_head_cpu_pct: float | None = None
    req_threads_pct: dict[str, float] = field(default_factory=dict)
    served_replicas: int | None = None
    # detection of a silent and of a crashed replica (this head's incarnation of it)
    silent_detect_s: list[float] = field(default_factory=list)  # from its last beat here
    silent_detect_from_stop_s: list[float] = field(default_factory=list)
    silent_missed: int = 0
    crash_detect_s: list[float] = field(default_factory=list)
    crash_missed: int = 0
    crash_head_cpu_s: float | None = None  # in the 3 s after the crash


@dataclass
class FleetResult:
    """N replicas given the first head; the others (if any) joined to it with
    --omni-join, learned by the replicas from it."""

    n: int
    workers: int
    heads: list[HeadFigures] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    partial: bool = False  # stopped early, or its requests failed: figures missing
    phases: dict[str, float] = field(default_factory=dict)  # wall time each phase began
    join_s: float | None = None  # the last head's HTTP up -> each lists the others UP
    storm_all_up_s: float | None = None  # all N UP at every head
    storm_failed: int = 0  # registrations with the first head that failed
    storm_failed_other: int = 0  # replicas not READY at every other head in time
    storm_retried_other: int = 0  # registrations with other heads tried again
    storm_fleet_cpu_s: float | None = None
    storm_listen_overflows: int | None = None  # TcpExt ListenOverflows during the storm
    storm_beat_lag_max_ms: float | None = None  # the fleet's lateness sending beats
    rest_s: float = 0.0
    rest_fleet_cpu_pct: float | None = None
    rest_beat_lag_max_ms: float | None = None
    rest_acks_not_up: int | None = None
    rps: float | None = None  # every head's share together
    req_fleet_cpu_pct: float | None = None
    req_total: int = 0
    served_replicas: int | None = None  # by any head
    served_expected: float | None = None  # uniform random choice
    served_max: int | None = None  # most requests on one replica (every head's)


def fmt(x: float | None, unit: str = "", digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}{unit}"


def by_thread(values: dict[str, float], digits: int) -> str:
    if not values:
        return "-"
    return "/".join(f"{values[k]:.{digits}f}" for k in ("loop", "control", "zmq"))


def span(xs: list[float], missed: int, digits: int = 2) -> str:
    if not xs:
        return "-" if not missed else f"{missed} missed"
    text = f"{xs[0]:.{digits}f}" if len(xs) == 1 else f"{xs[0]:.{digits}f}..{xs[-1]:.{digits}f}"
    return text + (f" ({missed} missed)" if missed else "")


def opt(x: int | None) -> str:
    return "-" if x is None else str(x)


def total(r: FleetResult, get: Callable[[HeadFigures], float | None]) -> float | None:
    xs = [get(h) for h in r.heads]
    return None if any(x is None for x in xs) else sum(x for x in xs if x is not None)


HeadCell = Callable[[HeadFigures], str] | None
FleetCell = Callable[[FleetResult], str] | None


def rows(args: argparse.Namespace) -> list[tuple[str, HeadCell, FleetCell]]:
    """(name, a head's cell, the fleet's cell): a one-head run shows the head's where it
    has one, else the fleet's; a run of several heads shows both."""
    return [
        ("heads joined (each lists the others UP) s", None, lambda r: fmt(r.join_s, digits=2)),
        ("fleet processes", None, lambda r: str(r.workers)),
        ("idle head (no replica): CPU %", lambda h: fmt(h.idle_cpu_pct, digits=2), None),
        ("idle head: RSS MiB", lambda h: fmt(h.idle_rss_mib, digits=0), None),
        (
            "storm: all UP at once s (head)",
            lambda h: fmt(h.storm_all_up_s, digits=2),
            lambda r: fmt(r.storm_all_up_s, digits=2),
        ),
        (
            "storm: 50%/90%/all READY s (head)",
            lambda h: f"{fmt(h.storm_t50_s)}/{fmt(h.storm_t90_s)}/{fmt(h.storm_all_ready_s)}",
            None,
        ),
        ("storm: polled every s", lambda h: fmt(h.storm_poll_every_s, digits=2), None),
        (
            "storm: READY sent p50/p90/max s",
            lambda h: "/".join(
                fmt(x) for x in (h.storm_ready_p50_s, h.storm_ready_p90_s, h.storm_ready_max_s)
            ),
            None,
        ),
        (
            "storm: failed registrations",
            None,
            lambda r: str(r.storm_failed)
            + (
                f" + {r.storm_failed_other} ({r.storm_retried_other} retried)"
                if len(r.heads) > 1
                else ""
            ),
        ),
        (
            "storm: head CPU-s",
            lambda h: fmt(h.storm_head_cpu_s),
            lambda r: fmt(total(r, lambda h: h.storm_head_cpu_s)),
        ),
        ("storm: head loop/control/zmq CPU-s", lambda h: by_thread(h.storm_threads_s, 1), None),
        ("storm: fleet CPU-s", None, lambda r: fmt(r.storm_fleet_cpu_s)),
        ("storm: most in ERROR at once", lambda h: str(h.storm_error_seen), None),
        ("storm: oldest beat of an UP s", lambda h: fmt(h.storm_hb_age_max_s, digits=2), None),
        ("storm: max beat lag ms (fleet)", None, lambda r: fmt(r.storm_beat_lag_max_ms, digits=0)),
        (
            "storm: listen queue overflows",
            None,
            lambda r: "-" if r.storm_listen_overflows is None else str(r.storm_listen_overflows),
        ),
        (
            "rest: head CPU % of a core",
            lambda h: fmt(h.rest_cpu_pct, digits=2),
            lambda r: fmt(total(r, lambda h: h.rest_cpu_pct), digits=2),
        ),
        ("rest: head CPU % per 100 repl.", lambda h: fmt(h.rest_cpu_pct_per_100, digits=2), None),
        (
            "rest: ... per 100 above idle",
            lambda h: fmt(h.rest_cpu_pct_per_100_above_idle, digits=2),
            lambda r: fmt(total(r, lambda h: h.rest_cpu_pct_per_100_above_idle), digits=2),
        ),
        ("rest: head loop/control/zmq %", lambda h: by_thread(h.rest_threads_pct, 1), None),
        (
            "rest: head RSS MiB",
            lambda h: fmt(h.rest_rss_mib, digits=0),
            lambda r: fmt(total(r, lambda h: h.rest_rss_mib), digits=0),
        ),
        ("rest: RSS MiB per 100 (> idle)", lambda h: fmt(h.rest_rss_mib_per_100, digits=2), None),
        ("rest: fleet CPU % (all procs)", None, lambda r: fmt(r.rest_fleet_cpu_pct, digits=0)),
        ("rest: max beat lag ms (fleet)", None, lambda r: fmt(r.rest_beat_lag_max_ms, digits=0)),
        ("rest: oldest beat of an UP s", lambda h: fmt(h.rest_hb_age_max_s, digits=2), None),
        ("rest: not UP after", lambda h: opt(h.rest_not_up), None),
        ("rest: non-UP acks (fleet)", None, lambda r: opt(r.rest_acks_not_up)),
        ("GET /v1/omni/stages ms", lambda h: fmt(h.stages_poll_ms, digits=0), None),
        (
            f"req/s (c={args.concurrency} in all)",
            lambda h: fmt(h.rps, digits=0),
            lambda r: fmt(r.rps, digits=0),
        ),
        ("p50 / p99 ms", lambda h: f"{fmt(h.p50_ms)} / {fmt(h.p99_ms)}", None),
        (
            "req: head CPU %",
            lambda h: fmt(h.req_head_cpu_pct, digits=0),
            lambda r: fmt(total(r, lambda h: h.req_head_cpu_pct), digits=0),
        ),
        ("req: head loop/control/zmq %", lambda h: by_thread(h.req_threads_pct, 0), None),
        ("req: fleet CPU %", None, lambda r: fmt(r.req_fleet_cpu_pct, digits=0)),
        (
            "req: replicas served (random)",
            lambda h: "-" if h.served_replicas is None else str(h.served_replicas),
            lambda r: "-"
            if r.served_replicas is None
            else f"{r.served_replicas} ({fmt(r.served_expected, digits=0)})",
        ),
        (
            "req: most on one replica",
            None,
            lambda r: "-" if r.served_max is None else str(r.served_max),
        ),
        ("silent: marked after last beat s", lambda h: span(h.silent_detect_s, h.silent_missed),
         None),
        ("silent: after it went silent s", lambda h: span(h.silent_detect_from_stop_s, 0), None),
        ("crash: marked after s", lambda h: span(h.crash_detect_s, h.crash_missed, 3), None),
        ("crash: head CPU-s in 3 s after", lambda h: fmt(h.crash_head_cpu_s, digits=2), None),
    ]  # fmt: skip


def columns(r: FleetResult) -> list[tuple[str, Callable[[HeadCell, FleetCell], str]]]:
    """A run's columns: (title, cell of a row)."""
    label = f"N={r.n}"
    if len(r.heads) == 1:
        (h,) = r.heads
        return [(label, lambda hc, fc: hc(h) if hc else fc(r) if fc else "-")]
    out: list[tuple[str, Callable[[HeadCell, FleetCell], str]]] = []
    for h in r.heads:
        out.append((f"{label} {h.name}", lambda hc, fc, h=h: hc(h) if hc else "-"))
    names = "+".join(h.name for h in r.heads)
    out.append((f"{label} {names}", lambda hc, fc: fc(r) if fc else "-"))
    return out


def report(results: list[FleetResult], args: argparse.Namespace) -> list[dict[str, Any]]:
    for count in sorted({len(r.heads) for r in results if r.heads}):
        runs = [r for r in results if len(r.heads) == count]
        table(runs, args, "one head" if count == 1 else f"{count} heads joined (--omni-join)")
    for r in results:
        for note in r.notes:
            print(f"  N={r.n}, {len(r.heads) or '?'} head(s): {note}")
    goals = targets(results, args)
    print("\ntargets:")
    for goal, value, met in goals:
        shown = "n/a" if value is None else f"{value:.2f}"
        print(f"  {goal:<62} {shown:>8}  {'PASS' if met else 'MISS'}")
    return [{"goal": g, "value": v, "met": m} for g, v, m in goals]


def table(runs: list[FleetResult], args: argparse.Namespace, title: str) -> None:
    cols = [c for r in runs for c in columns(r)]
    body = [(name, [cell(hc, fc) for _, cell in cols]) for name, hc, fc in rows(args)]
    if len(runs[0].heads) == 1:  # a fleet of one: no join, every row has a value
        body = body[1:]
    width = max(len(name) for name, _ in body) + 2
    widths = [
        max(12, len(t) + 2, *(len(v[i]) + 2 for _, v in body)) for i, (t, _) in enumerate(cols)
    ]
    print(f"\n{title}, {args.pipeline}, --omni-heartbeat-timeout {args.heartbeat_timeout:g}s:")
    print(f"{'':<{width}}" + "".join(f"{t:>{w}}" for (t, _), w in zip(cols, widths, strict=True)))
    for name, values in body:
        print(
            f"{name:<{width}}" + "".join(f"{v:>{w}}" for v, w in zip(values, widths, strict=True))
        )


def targets(results: list[FleetResult], args: argparse.Namespace) -> list[tuple[str, Any, bool]]:
    goals: list[tuple[str, Any, bool]] = []
    limit = args.heartbeat_timeout + DETECT_SLACK_S
    for r in results:
        many = len(r.heads) > 1
        who = f"{len(r.heads)} heads: " if many else ""
        if r.n == TARGET_STORM_N:
            t = r.storm_all_up_s
            at = " at every head" if many else ""
            ok = t is not None and t < TARGET_STORM_S
            goals.append((f"{who}{TARGET_STORM_N} replicas UP{at} < {TARGET_STORM_S:g} s", t, ok))
        for h in r.heads:
            name = f"head {h.name} " if many else "head "
            # What the replicas cost: the head's own idle CPU (its timers) is not theirs.
            per = h.rest_cpu_pct_per_100_above_idle
            ok = per is not None and per < TARGET_CPU_PER_100
            goal = f"{who}N={r.n}: {name}CPU per 100 idle replicas < {TARGET_CPU_PER_100:g}%"
            goals.append((goal, per, ok))
            # Marked once silent for longer than the timeout, on the 0.1 s expiry tick.
            worst = h.silent_detect_s[-1] if h.silent_detect_s else None
            ok = worst is not None and not h.silent_missed and worst <= limit
            goal = f"{who}N={r.n}: silent replica marked at {name}<= {limit:g} s"
            goals.append((goal, worst, ok))
    return goals
