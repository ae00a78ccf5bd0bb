"""Start-up: from ``omnistage serve`` to the first 200 of ``/health``, against the HTTP floor.

Fresh servers, one at a time, interleaved over rounds: the floor (bench_pipeline's bare
FastAPI app in its own Python process: what starting any Python HTTP server costs
here), the three-stage ``echo`` pipeline (a head and three local replica processes,
which need no weights: what the head and its replicas cost to start), and with
``--baseline-tree`` the same pipeline served from another checkout, for a change's
before and after in one run. Tests start a head hundreds of times, and an operator
restarting a head waits for it. See README.md.
"""

import argparse
import statistics
import time
from dataclasses import asdict, dataclass

import common
from bench_pipeline import PATH, TARGETS, Target, request_body, start_server
from common import free_port

POLL_S = 0.02  # how often readiness is asked: the figures' resolution


@dataclass
class Start:
    target: str
    round: int
    ready_s: float | None = None  # from the spawn to the first 200
    error: str | None = None


def start_once(target: Target, round_no: int, timeout: float) -> Start:
    port = free_port()
    started = time.monotonic()
    server = start_server(target, port)
    try:
        wait_ready_fast(server, target, timeout)
        return Start(target.name, round_no, time.monotonic() - started)
    except RuntimeError as exc:
        return Start(target.name, round_no, error=common.describe(exc))
    finally:
        server.stop()


def wait_ready_fast(server: common.ServerProcess, target: Target, timeout: float) -> None:
    """bench_pipeline's readiness (a head's /health, the floor's POST of a chat), asked
    every ``POLL_S``."""
    if target.stages:
        server.wait_ready(timeout, interval=POLL_S)
    else:
        server.wait_ready(timeout, PATH, request_body(target), interval=POLL_S)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=8, help="starts of each server")
    p.add_argument(
        "--baseline-tree",
        metavar="DIR",
        help="also start the echo pipeline from this checkout (echo@base), in the same rounds",
    )
    common.add_common_args(p, health_timeout=60, request_timeout=10)
    args = p.parse_args()
    common.exit_on_sigterm()
    floor, echo = TARGETS[0], TARGETS[2]
    targets = [floor, echo]
    if args.baseline_tree:
        targets.append(Target("echo@base", echo.stages, echo.expect, args.baseline_tree))
    starts: list[Start] = []
    for round_no in range(args.rounds):
        for target in targets:
            start = start_once(target, round_no, args.health_timeout)
            starts.append(start)
            shown = f"{start.ready_s:.2f} s" if start.ready_s is not None else start.error
            print(f"round {round_no} {target.name:<10} {shown}", flush=True)
    rows = report(targets, starts)
    if args.json:
        common.write_json(args.json, args, {"summary": rows, "starts": [asdict(s) for s in starts]})


def report(targets: list[Target], starts: list[Start]) -> list[dict[str, object]]:
    print(f"\n{'server':<10} {'starts':>6} {'p50':>7} {'min':>7} {'max':>7} {'p50 - floor':>12}")
    rows: list[dict[str, object]] = []
    floor_p50: float | None = None
    for target in targets:
        times = sorted(s.ready_s for s in starts if s.target == target.name and s.ready_s)
        failed = sum(1 for s in starts if s.target == target.name and s.error)
        if not times:
            print(f"{target.name:<10} {0:>6} (all {failed} failed)")
            continue
        p50 = statistics.median(times)
        floor_p50 = p50 if target.stages == 0 else floor_p50
        over = "" if target.stages == 0 or floor_p50 is None else f"{p50 - floor_p50:>10.2f} s"
        print(
            f"{target.name:<10} {len(times):>6} {p50:>5.2f} s {times[0]:>5.2f} s "
            f"{times[-1]:>5.2f} s {over:>12}" + (f"  ({failed} failed)" if failed else "")
        )
        rows.append(
            {
                "target": target.name,
                "starts": len(times),
                "failed": failed,
                "p50_s": p50,
                "min_s": times[0],
                "max_s": times[-1],
            }
        )
    return rows


if __name__ == "__main__":
    main()
