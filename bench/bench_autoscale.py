"""Autoscaling: the time from a load step to the new replica serving; and, with
``--scenario ttft-step``, a load step against a time-to-first-token target, in-flight
mode vs latency mode side by side (``autoscale_ttft.py``).

Scenario ``new-replica`` (the default): a head serves one echo stage with
``autoscaling: {min_replicas: 1, max_replicas: 2}``. Each round: a step from no load to
``--clients`` closed-loop clients; ``/v1/omni/stages`` is polled every 20 ms for when the
head decided to scale up (the decision's own timestamp), when the new replica is UP, when
the head first sent it a request, and when it first answered one (dispatched minus in
flight > 0). Then the load ends and the round waits for the stage to drain back to one
replica.
"""

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import autoscale_ttft
import common
import httpx
from common import HOST, ServerProcess, free_port

POLL_S = 0.02
CONFIG = """\
pipeline: autoscale-bench
stages:
  - stage_id: 0
    name: worker
    engine: echo
    engine_args: {{num_chunks: 4, chunk_delay_s: {delay}}}
    final_output: true
    ray: {{num_cpus: 0}}
    autoscaling:
      min_replicas: 1
      max_replicas: 2
      target_inflight_per_replica: 2
      upscale_delay_s: {up}
      downscale_delay_s: {down}
"""


@dataclass
class Round:
    decision_ms: float = 0.0  # step -> the head's scale-up decision
    up_ms: float = 0.0  # step -> the new replica UP (READY)
    dispatch_ms: float = 0.0  # step -> first request sent to it
    serving_ms: float = 0.0  # step -> first request answered by it
    down_ms: float = 0.0  # load end -> back to one replica (drained, DOWN)
    requests: int = 0
    failed: int = 0
    error: str | None = None


def stage_view(port: int) -> dict[str, Any]:
    url = f"http://{HOST}:{port}/v1/omni/stages"
    with urllib.request.urlopen(url, timeout=5) as resp:
        return json.loads(resp.read())["stages"][0]


class Load:
    """``clients`` threads posting chats back to back until stopped."""

    def __init__(self, port: int, clients: int, timeout: float) -> None:
        self.ok = self.failed = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._url, self._timeout = f"http://{HOST}:{port}", timeout
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(clients)]
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(self._timeout + 5)

    def _run(self) -> None:
        body = {"messages": [{"role": "user", "content": "step"}]}
        with httpx.Client(base_url=self._url, timeout=self._timeout) as client:
            while not self._stop.is_set():
                try:
                    r = client.post("/v1/chat/completions", json=body)
                    good = r.status_code == 200 and r.json()["choices"][0]["message"][
                        "content"
                    ] == ("step [worker]")
                except (httpx.HTTPError, ValueError, LookupError):
                    good = False
                with self._lock:
                    if good:
                        self.ok += 1
                    else:
                        self.failed += 1


def wait_view(port: int, cond: Any, timeout: float, what: str) -> tuple[float, dict[str, Any]]:
    """Poll until ``cond(view)``; returns the monotonic time of that poll's answer."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        view = stage_view(port)
        if cond(view):
            return time.monotonic(), view
        time.sleep(POLL_S)
    raise TimeoutError(f"no {what} within {timeout:g}s")


def up_ids(view: dict[str, Any]) -> set[int]:
    return {r["replica_id"] for r in view["replicas"] if r["state"] == "UP"}


def one_round(port: int, args: argparse.Namespace) -> Round:
    r = Round()
    _, view = wait_view(port, lambda v: len(up_ids(v)) == 1, 60, "single UP replica")
    before = up_ids(view)
    ups_before = view["autoscaling"]["decisions"]["up"]
    step_wall, step = time.time(), time.monotonic()
    load = Load(port, args.clients, args.request_timeout)
    try:

        def new(v: dict[str, Any]) -> list[dict[str, Any]]:
            return [
                x for x in v["replicas"] if x["state"] == "UP" and x["replica_id"] not in before
            ]

        t_up, view = wait_view(port, lambda v: new(v), 120, "new UP replica")
        r.up_ms = (t_up - step) * 1000
        t, _ = wait_view(port, lambda v: any(x["dispatched_total"] for x in new(v)), 30, "dispatch")
        r.dispatch_ms = (t - step) * 1000
        t, view = wait_view(
            port,
            lambda v: any(x["dispatched_total"] - x["in_flight"] > 0 for x in new(v)),
            30,
            "answer",
        )
        r.serving_ms = (t - step) * 1000
        scaling = view["autoscaling"]
        if scaling["decisions"]["up"] > ups_before and scaling["last_decision"]:
            r.decision_ms = (scaling["last_decision"]["time"] - step_wall) * 1000
    finally:
        load.stop()
    end = time.monotonic()
    t, _ = wait_view(port, lambda v: len(up_ids(v)) == 1, 120, "scale down to 1")
    r.down_ms = (t - end) * 1000
    r.requests, r.failed = load.ok + load.failed, load.failed
    return r


def main() -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--scenario", choices=("new-replica", "ttft-step"), default="new-replica")
    p.add_argument("--rounds", type=int, default=3, help="load steps, each on the same head")
    p.add_argument("--clients", type=int, default=8, help="closed-loop clients in the step")
    p.add_argument("--chunk-delay", type=float, default=0.05, help="echo seconds per chunk")
    p.add_argument("--upscale-delay", type=float, default=0.0, help="upscale_delay_s")
    p.add_argument("--downscale-delay", type=float, default=1.0, help="downscale_delay_s")
    t = p.add_argument_group("ttft-step")
    t.add_argument("--target-ttft", type=float, default=0.3, help="target_p90_first_token_s")
    t.add_argument(
        "--inflight-targets",
        type=lambda v: [float(x) for x in v.split(",")],
        default=[4.0],
        help="in-flight mode columns: target_inflight_per_replica, comma-separated",
    )
    t.add_argument("--capacity", type=int, default=2, help="max_inflight_per_replica")
    t.add_argument("--max-replicas", type=int, default=6, help="max_replicas")
    t.add_argument("--step-s", type=float, default=20.0, help="seconds of load")
    t.add_argument("--latency-window", type=float, default=5.0, help="latency_window_s")
    t.add_argument("--min-samples", type=int, default=10, help="latency_min_samples")
    p.add_argument(
        "--worker-backend",
        default="multi_process",
        choices=("multi_process", "ray"),
        help="how the head runs replicas (ray: one Ray actor each)",
    )
    p.add_argument("--logs", metavar="DIR", help="keep the head's log here")
    common.add_common_args(p, health_timeout=90.0, request_timeout=30.0)
    args = p.parse_args()
    common.exit_on_sigterm()
    if args.scenario == "ttft-step":
        return autoscale_ttft.main(args)
    tmp = Path(tempfile.mkdtemp(prefix="omni-autoscale-"))
    config = tmp / "autoscale.yaml"
    config.write_text(
        CONFIG.format(delay=args.chunk_delay, up=args.upscale_delay, down=args.downscale_delay)
    )
    port = free_port()
    cmd = [sys.executable, "-m", "omnistage", "serve", str(config), "--host", HOST]
    cmd += ["--port", str(port), "--worker-backend", args.worker_backend]
    cmd += ["--omni-lb-policy", "least-queue-length"]
    print(
        f"{common.machine()}; one echo stage, {args.chunk_delay * 4:g} s/request, "
        f"autoscaling 1..2 replicas, target 2, upscale_delay_s {args.upscale_delay:g}; "
        f"a step to {args.clients} clients; backend {args.worker_backend}",
        flush=True,
    )
    server = ServerProcess("head", cmd, port)
    rounds: list[Round] = []
    try:
        server.wait_ready(args.health_timeout)
        for n in range(args.rounds):
            try:
                rounds.append(one_round(port, args))
            except (TimeoutError, OSError) as exc:
                rounds.append(Round(error=common.describe(exc)))
                break
            print(f"round {n + 1}: {asdict(rounds[-1])}", flush=True)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
    finally:
        if args.logs:
            Path(args.logs).mkdir(parents=True, exist_ok=True)
            (Path(args.logs) / "head.log").write_text(server.log_text())
        server.stop()
    _print_table(rounds)
    if args.json:
        common.write_json(args.json, args, {"rounds": [asdict(r) for r in rounds]})
    # Scaling up must not fail a request, and a round that errored has no figures.
    if bad := [i for i, r in enumerate(rounds, 1) if r.error or r.failed]:
        print(f"! failed requests or errors in round(s) {', '.join(map(str, bad))}")
        return 1
    return 0


def _print_table(rounds: list[Round]) -> None:
    good = [r for r in rounds if r.error is None]
    cols = ("decision_ms", "up_ms", "dispatch_ms", "serving_ms", "down_ms")
    print(f"\n{'round':>5} " + " ".join(f"{c:>12}" for c in cols) + f" {'failed/total':>13}")
    for i, r in enumerate(rounds, 1):
        if r.error:
            print(f"{i:>5} error: {r.error}")
            continue
        figures = " ".join(f"{getattr(r, c):>12.0f}" for c in cols)
        print(f"{i:>5} {figures} {r.failed:>6}/{r.requests:<6}")
    if good:
        med = " ".join(f"{statistics.median(getattr(r, c) for r in good):>12.0f}" for c in cols)
        print(f"{'p50':>5} {med}")
    print(
        "\nserving_ms: from the step to the first request the new replica answered "
        "(upper bound: polled every 20 ms)."
    )


if __name__ == "__main__":
    sys.exit(main())
