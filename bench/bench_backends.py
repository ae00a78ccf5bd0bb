"""Worker backends: the echo pipeline with its replicas as local processes and as Ray actors.

Side by side: req/s at c=32 and p50/p99 at c=1 and c=32, with ray / multi_process; then,
per backend, the time from a load step to the autoscaler's decision, to the new replica UP
and to the first request it serves. See README.md.
"""

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass
from typing import Any

import bench_pipeline
import common
from common import HOST, ServerProcess, free_port

BACKENDS = ("multi_process", "ray")
PIPELINE = "echo"
TARGET = bench_pipeline.Target(PIPELINE, 3, b"[vocoder]")
NO_RAY_CPU = {"ray": {"num_cpus": 0}}  # every replica fits a 2-CPU cluster; ignored locally
# The same config for both backends: the built-in echo pipeline.
THROUGHPUT_OVERRIDES = {str(s): NO_RAY_CPU for s in range(3)}
# Scale-up: the thinker takes ~0.2 s a request (4 chunks, 50 ms of sleep before each) and
# scales 1 -> 2 once its load (in flight + waiting) has been above 4 for 1 s.
SCALE_OVERRIDES = {
    **THROUGHPUT_OVERRIDES,
    "0": {
        **NO_RAY_CPU,
        "engine_args": {"num_chunks": 4, "chunk_delay_s": 0.05},
        "autoscaling": {
            "min_replicas": 1,
            "max_replicas": 2,
            "target_inflight_per_replica": 4,
            "upscale_delay_s": 1,
            "downscale_delay_s": 600,
        },
    },
}
SCALE_STAGE = 0
POLL_S = 0.02  # /v1/omni/stages polling during the load step


@dataclass
class Load:
    backend: str
    round: int
    concurrency: int
    rps: float | None = None
    p50_ms: float | None = None
    p99_ms: float | None = None
    error: str | None = None


@dataclass
class ScaleUp:
    backend: str
    round: int
    # Seconds from the load step to: the scaler's decision (its own timestamp), the new
    # replica's STARTING -> UP (the head's state-change record), and the first poll that
    # shows the new replica with dispatched_total > 0 (an upper bound; `served_lo` is when
    # the poll before it, which still showed 0, was sent).
    decision_s: float | None = None
    up_s: float | None = None
    served_s: float | None = None
    served_lo_s: float | None = None
    replica_id: int | None = None
    error: str | None = None


# -- servers -------------------------------------------------------------------------------


def start_head(backend: str, ray_address: str | None, overrides: dict[str, Any]) -> ServerProcess:
    port = free_port()
    cmd = [sys.executable, "-m", "omnistage", "serve", PIPELINE, "--host", HOST]
    cmd += ["--port", str(port), "--log-level", "INFO", "--stage-overrides", json.dumps(overrides)]
    if backend == "ray":
        cmd += ["--worker-backend", "ray", "--ray-address", str(ray_address)]
    return ServerProcess(f"head ({backend})", cmd, port)


def stages(port: int) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://{HOST}:{port}/v1/omni/stages", timeout=5.0) as resp:
        return json.load(resp)


def ready(head: ServerProcess, args: argparse.Namespace) -> None:
    """/health, then ``--settle-s`` for the start's CPU (Ray's above all) to die down."""
    head.wait_ready(args.health_timeout)
    time.sleep(args.settle_s)


# -- req/s and latency ---------------------------------------------------------------------


def throughput(
    backend: str, rnd: int, ray_address: str | None, args: argparse.Namespace
) -> list[Load]:
    counts = {1: args.requests_c1, 32: args.requests}
    out = [Load(backend, rnd, c) for c in counts]
    head = None
    try:
        head = start_head(backend, ray_address, THROUGHPUT_OVERRIDES)
        ready(head, args)
        for res, (c, n) in zip(out, counts.items(), strict=True):
            r = asyncio.run(
                bench_pipeline.load(TARGET, head.port or 0, c, n, args.warmup, args.request_timeout)
            )
            res.rps, res.p50_ms, res.p99_ms = r.rps, r.p50_ms, r.p99_ms
    except Exception as exc:
        error = common.describe(exc, args.request_timeout)
        for res in out:
            if res.rps is None:
                res.error = error
        print(f"! {backend} round {rnd}: {error.splitlines()[0][:300]}", flush=True)
    finally:
        if head is not None:
            head.stop()
    return out


# -- load step to the new replica serving --------------------------------------------------


async def load_step(port: int, args: argparse.Namespace, res: ScaleUp) -> None:
    body = bench_pipeline.request_body(TARGET)
    request = common.http_post(port, bench_pipeline.PATH, body)
    conns: list[bench_pipeline.Conn] = []
    try:
        for _ in range(args.step_clients):
            conns.append(await asyncio.open_connection(HOST, port))
        before = await asyncio.to_thread(stages, port)
        done = before["stages"][SCALE_STAGE]["autoscaling"]["decisions"]["up"]
        step = last_sent = time.time()
        load = asyncio.create_task(
            bench_pipeline.closed_loop(conns, 10**9, request, TARGET.expect, args.request_timeout)
        )
        while time.time() - step < args.step_timeout:
            if load.done():
                load.result()  # raises what failed
                raise RuntimeError("the load ended early")
            sent = time.time()
            status = await asyncio.to_thread(stages, port)
            answered = time.time()
            st = status["stages"][SCALE_STAGE]
            last = st["autoscaling"]["last_decision"]
            if res.decision_s is None and st["autoscaling"]["decisions"]["up"] > done:
                res.decision_s = last["time"] - step
                res.replica_id = last["replica_ids"][0]
            if res.replica_id is not None:
                key = (SCALE_STAGE, res.replica_id, "UP")
                ups = [
                    ch["time"]
                    for ch in status["recent_state_changes"]
                    if (ch["stage_id"], ch["replica_id"], ch["state"]) == key and ch["time"] >= step
                ]
                if res.up_s is None and ups:
                    res.up_s = min(ups) - step
                mine = [r for r in st["replicas"] if r["replica_id"] == res.replica_id]
                if mine and mine[0]["dispatched_total"] > 0:
                    res.served_s, res.served_lo_s = answered - step, last_sent - step
                    break
            last_sent = sent
            await asyncio.sleep(POLL_S)
        else:
            raise RuntimeError(f"no new replica serving {args.step_timeout:g}s after the step")
        load.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await load
    finally:
        for _, writer in conns:
            writer.close()


def scale_up(backend: str, rnd: int, ray_address: str | None, args: argparse.Namespace) -> ScaleUp:
    res = ScaleUp(backend, rnd)
    head = None
    try:
        head = start_head(backend, ray_address, SCALE_OVERRIDES)
        ready(head, args)
        asyncio.run(load_step(head.port or 0, args, res))
    except Exception as exc:
        res.error = common.describe(exc, args.request_timeout)
        print(f"! {backend} scale-up round {rnd}: {res.error.splitlines()[0][:300]}", flush=True)
    finally:
        if head is not None:
            head.stop()
    return res


# -- report --------------------------------------------------------------------------------


def med(xs: list[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return statistics.median(vals) if vals else None


def fmt(x: float | None, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def report_throughput(loads: list[Load], backends: list[str]) -> dict[str, Any]:
    cells: dict[str, dict[str, float | None]] = {}
    for b in backends:
        mine = [r for r in loads if r.backend == b]
        c1 = [r for r in mine if r.concurrency == 1]
        c32 = [r for r in mine if r.concurrency == 32]
        cells[b] = {
            "rps_c32": med([r.rps for r in c32]),
            "p50_c1": med([r.p50_ms for r in c1]),
            "p99_c1": med([r.p99_ms for r in c1]),
            "p50_c32": med([r.p50_ms for r in c32]),
            "p99_c32": med([r.p99_ms for r in c32]),
            "rps_c1": med([r.rps for r in c1]),
        }
    rows = [
        ("req/s c=32", "rps_c32", ".0f"),
        ("req/s c=1", "rps_c1", ".0f"),
        ("p50 ms c=1", "p50_c1", ".2f"),
        ("p99 ms c=1", "p99_c1", ".2f"),
        ("p50 ms c=32", "p50_c32", ".1f"),
        ("p99 ms c=32", "p99_c32", ".1f"),
    ]
    both = len(backends) == 2
    print(f"\n{'':<12} " + " ".join(f"{b:>13}" for b in backends) + ("   ray / mp" if both else ""))
    for label, key, spec in rows:
        vals = [cells[b][key] for b in backends]
        line = f"{label:<12} " + " ".join(f"{fmt(v, spec):>13}" for v in vals)
        if both and vals[0] and vals[1]:
            line += f" {vals[1] / vals[0]:>10.2f}"
        print(line)
    for r in loads:
        if r.error is not None:
            print(f"  {r.backend} round {r.round} c={r.concurrency}: FAILED {r.error[:200]}")
    per_round = ", ".join(f"{r.backend} {fmt(r.rps, '.0f')}" for r in loads if r.concurrency == 32)
    print(f"  req/s c=32 per round: {per_round}")
    return cells


def report_scale(results: list[ScaleUp], backends: list[str]) -> dict[str, Any]:
    print(
        f"\n{'scale-up 1->2':<16} {'round':>5} {'decision s':>10} {'UP s':>6} "
        f"{'served s':>13} {'decision->UP':>12} {'UP->served':>10}"
    )
    meds: dict[str, Any] = {}

    def row(name: str, rnd: str, d: Any, u: Any, s: Any, lo: Any) -> None:
        du = u - d if u is not None and d is not None else None
        us = s - u if s is not None and u is not None else None
        served = "-" if s is None else f"{fmt(lo, '.2f')}..{s:.2f}"
        print(
            f"{name:<16} {rnd:>5} {fmt(d, '.2f'):>10} {fmt(u, '.2f'):>6} {served:>13} "
            f"{fmt(du, '.2f'):>12} {fmt(us, '.2f'):>10}"
        )

    for b in backends:
        mine = [r for r in results if r.backend == b]
        for r in mine:
            if r.error is not None:
                print(f"{b:<16} {r.round:>5}  FAILED: {r.error.splitlines()[0][:150]}")
            else:
                row(b, str(r.round), r.decision_s, r.up_s, r.served_s, r.served_lo_s)
        ok = [r for r in mine if r.error is None]
        if len(ok) > 1:
            m = [med([getattr(r, k) for r in ok]) for k in ("decision_s", "up_s", "served_s")]
            row(b, "med", m[0], m[1], m[2], med([r.served_lo_s for r in ok]))
        meds[b] = {k: med([getattr(r, k) for r in ok]) for k in ("decision_s", "up_s", "served_s")}
    if len(backends) == 2:
        a, b = (meds[x] for x in backends)
        ratios = [
            f"{k.removesuffix('_s')} {b[k] / a[k]:.2f}" if a[k] and b[k] else f"{k} -"
            for k in ("decision_s", "up_s", "served_s")
        ]
        print(f"{'ray / mp':<16} {'':>5} " + ", ".join(ratios))
    return meds


def main() -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--backends", default=",".join(BACKENDS), help="comma-separated (both)")
    p.add_argument("--rounds", type=int, default=2, help="req/s rounds per backend (2)")
    p.add_argument("--requests", type=int, default=2000, help="measured requests at c=32")
    p.add_argument("--requests-c1", type=int, default=500, help="measured requests at c=1")
    p.add_argument("--warmup", type=int, default=200, help="warm-up requests per run")
    p.add_argument("--scale-rounds", type=int, default=2, help="scale-up rounds per backend")
    p.add_argument("--step-clients", type=int, default=16, help="closed-loop clients in the step")
    p.add_argument("--step-timeout", type=float, default=60.0, help="seconds to wait for it")
    p.add_argument("--settle-s", type=float, default=3.0, help="idle seconds after ready")
    common.add_common_args(p, health_timeout=120.0, request_timeout=10.0)
    args = p.parse_args()
    backends = [b for b in args.backends.split(",") if b]
    if not backends or any(b not in BACKENDS for b in backends):
        p.error(f"--backends: one or both of {', '.join(BACKENDS)}")
    load0 = os.getloadavg()
    print(
        f"{common.machine()}; load average {' '.join(f'{x:.2f}' for x in load0)}; "
        f"{PIPELINE}: {args.rounds} round(s) of c=1 ({args.requests_c1}) and c=32 "
        f"({args.requests}) per backend, {args.scale_rounds} scale-up round(s)",
        flush=True,
    )
    common.exit_on_sigterm()
    loads: list[Load] = []
    scales: list[ScaleUp] = []
    started = time.monotonic()
    try:
        cluster = common.loopback_ray_cluster() if "ray" in backends else contextlib.nullcontext()
        with cluster as address:
            if address:
                print(f"ray: a loopback cluster at {address}", flush=True)
            for rnd in range(1, args.rounds + 1):
                for b in backends:
                    loads += throughput(b, rnd, address, args)
            for rnd in range(1, args.scale_rounds + 1):
                for b in backends:
                    scales.append(scale_up(b, rnd, address, args))
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    cells = report_throughput(loads, backends) if loads else {}
    meds = report_scale(scales, backends)
    load1 = os.getloadavg()
    print(
        f"\nload average {' '.join(f'{x:.2f}' for x in load0)} at start, "
        f"{' '.join(f'{x:.2f}' for x in load1)} at end; total {time.monotonic() - started:.0f} s"
    )
    if args.json:
        sections = {
            "load_average": {"start": load0, "end": load1},
            "throughput": {"runs": [asdict(r) for r in loads], "medians": cells},
            "scale_up": {"runs": [asdict(r) for r in scales], "medians": meds},
        }
        common.write_json(args.json, args, sections)
    # The medians leave a failed run out: say so in the exit status too.
    if failed := sum(r.error is not None for r in [*loads, *scales]):
        print(f"! {failed} run(s) FAILED")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
