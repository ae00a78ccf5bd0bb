"""The ``ttft-step`` scenario of bench_autoscale.py: a load step against a time-to-first-
token target, in-flight mode vs latency mode side by side.

Each column is a fresh head serving one echo stage whose replicas work on ``--capacity``
requests at once (``max_inflight_per_replica``; more wait at the head), autoscaled from 1
replica: in-flight mode with a ``target_inflight_per_replica``, or latency mode with
``target_p90_first_token_s``. The step goes from no load to ``--clients`` closed-loop
streaming clients for ``--step-s`` seconds; every request's time to its first token is
measured by the client, and ``/v1/omni/stages`` is polled every 0.1 s for the replicas.

Figures per column: when the target was met again (from then on, the p90 first token of
the requests begun in every ``MET_WINDOW_S`` window stays at or under the target), the
p90 first token over the step and over its last 5 s, the most replicas UP, the
replica-seconds used, and when the scaler first added a replica.
"""

import argparse
import json
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import common
import httpx
from common import HOST, ServerProcess, free_port

MET_WINDOW_S = 2.0
POLL_S = 0.1
CONFIG = """\
pipeline: ttft-step
stages:
  - stage_id: 0
    name: worker
    engine: echo
    engine_args: {{num_chunks: 4, chunk_delay_s: {delay}}}
    final_output: true
    max_inflight_per_replica: {capacity}
    ray: {{num_cpus: 0}}
    autoscaling:
      min_replicas: 1
      max_replicas: {max_replicas}
      upscale_delay_s: {up}
      downscale_delay_s: 600
{mode}
"""


@dataclass
class Column:
    name: str
    met_s: float | None = None  # step -> the target met for good (None: never)
    p90_step_s: float = 0.0  # p90 first token over the whole step
    p90_tail_s: float = 0.0  # ... over its last 5 s
    max_replicas: int = 0
    replica_s: float = 0.0  # replica-seconds UP during the step
    first_up_s: float | None = None  # step -> the first replica added (decision seen)
    requests: int = 0
    failed: int = 0
    error: str | None = None
    samples: list[tuple[float, float]] = field(default_factory=list, repr=False)


class StreamingLoad:
    """``clients`` threads streaming chats back to back; keeps (began, first token s)."""

    def __init__(self, port: int, clients: int, timeout: float, t0: float) -> None:
        self.samples: list[tuple[float, float]] = []
        self.failed = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._url, self._timeout, self._t0 = f"http://{HOST}:{port}", timeout, t0
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(clients)]
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(self._timeout + 5)

    def _one(self, client: httpx.Client) -> float | None:
        body = {"messages": [{"role": "user", "content": "step"}], "stream": True}
        began, first = time.monotonic(), None
        with client.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                return None
            for line in r.iter_lines():
                if first is None and line.startswith("data: {") and '"content":"' in line:
                    first = time.monotonic()
        return None if first is None else first - began

    def _run(self) -> None:
        with httpx.Client(base_url=self._url, timeout=self._timeout) as client:
            while not self._stop.is_set():
                began = time.monotonic() - self._t0
                try:
                    ttft = self._one(client)
                except httpx.HTTPError:
                    ttft = None
                with self._lock:
                    if ttft is None:
                        self.failed += 1
                    else:
                        self.samples.append((began, ttft))


def _stage(port: int) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://{HOST}:{port}/v1/omni/stages", timeout=5) as resp:
        return json.loads(resp.read())["stages"][0]


def met_at(samples: list[tuple[float, float]], target: float, end: float) -> float | None:
    """The earliest start from which every MET_WINDOW_S window of requests (by when they
    began; windows 0.25 s apart, up to the step's end) has a p90 first token <= target."""
    starts = [i * 0.25 for i in range(int((end - MET_WINDOW_S) / 0.25) + 1)]
    met: float | None = None
    for s in starts:
        window = sorted(v for b, v in samples if s <= b < s + MET_WINDOW_S)
        ok = not window or common.pct(window, 90) <= target
        if ok and met is None:
            met = s
        elif not ok:
            met = None
    return met


def run_column(name: str, mode: str, args: argparse.Namespace, tmp: Path) -> Column:
    col = Column(name)
    config = tmp / f"{name.replace(' ', '_')}.yaml"
    config.write_text(
        CONFIG.format(
            delay=args.chunk_delay,
            capacity=args.capacity,
            max_replicas=args.max_replicas,
            up=args.upscale_delay,
            mode=mode,
        )
    )
    port = free_port()
    cmd = [sys.executable, "-m", "omnistage", "serve", str(config), "--host", HOST]
    cmd += ["--port", str(port)]
    cmd += ["--worker-backend", args.worker_backend, "--omni-lb-policy", "least-queue-length"]
    server = ServerProcess(name, cmd, port)
    try:
        server.wait_ready(args.health_timeout)
        t0 = time.monotonic()
        load = StreamingLoad(port, args.clients, args.request_timeout, t0)
        last = t0
        try:
            while (now := time.monotonic()) - t0 < args.step_s:
                view = _stage(port)
                up = sum(1 for r in view["replicas"] if r["state"] == "UP")
                col.max_replicas = max(col.max_replicas, up)
                col.replica_s += up * (now - last)
                last = now
                if col.first_up_s is None and view["autoscaling"]["decisions"]["up"]:
                    col.first_up_s = now - t0
                time.sleep(POLL_S)
        finally:
            load.stop()
        col.samples, col.failed = load.samples, load.failed
    except (TimeoutError, OSError) as exc:
        col.error = common.describe(exc)
        return col
    finally:
        if args.logs:
            Path(args.logs).mkdir(parents=True, exist_ok=True)
            (Path(args.logs) / f"{config.stem}.log").write_text(server.log_text())
        server.stop()
    col.requests = len(col.samples) + col.failed
    ttfts = sorted(v for _, v in col.samples)
    tail = sorted(v for b, v in col.samples if b >= args.step_s - 5)
    col.p90_step_s = common.pct(ttfts, 90) if ttfts else 0.0
    col.p90_tail_s = common.pct(tail, 90) if tail else 0.0
    col.met_s = met_at(col.samples, args.target_ttft, args.step_s)
    return col


def main(args: argparse.Namespace) -> int:
    tmp = Path(tempfile.mkdtemp(prefix="omni-ttft-step-"))
    columns: list[tuple[str, str]] = [
        (f"inflight {t:g}", f"      target_inflight_per_replica: {t:g}")
        for t in args.inflight_targets
    ]
    columns.append(
        (
            f"latency {args.target_ttft:g}s",
            f"      target_p90_first_token_s: {args.target_ttft:g}\n"
            f"      latency_window_s: {args.latency_window:g}\n"
            f"      latency_min_samples: {args.min_samples}",
        )
    )
    print(
        f"{common.machine()}; one echo stage, 4 chunks {args.chunk_delay:g} s apart, "
        f"{args.capacity} request(s) at once per replica, autoscaling 1..{args.max_replicas} "
        f"(upscale_delay_s {args.upscale_delay:g}); a step to {args.clients} streaming "
        f"clients for {args.step_s:g} s; TTFT target {args.target_ttft:g} s (p90 over "
        f"{MET_WINDOW_S:g} s windows); backend {args.worker_backend}",
        flush=True,
    )
    results = []
    for name, mode in columns:
        results.append(run_column(name, mode, args, tmp))
        summary = {k: v for k, v in asdict(results[-1]).items() if k != "samples"}
        print(f"{name}: {summary}", flush=True)
    _print_table(results)
    if args.json:
        doc = [{**asdict(c), "samples": c.samples} for c in results]
        common.write_json(args.json, args, {"columns": doc})
    # Queued requests wait at the head: none should fail, and a column that errored has
    # no figures.
    if bad := [c.name for c in results if c.error or c.failed]:
        print(f"! failed requests or errors in: {', '.join(bad)}")
        return 1
    return 0


def _print_table(cols: list[Column]) -> None:
    def fmt(v: Any, digits: int = 2) -> str:
        if v is None:
            return "never"
        return f"{v:.{digits}f}" if isinstance(v, float) else str(v)

    rows = [
        ("target met again at (s)", lambda c: fmt(c.met_s)),
        ("first replica added at (s)", lambda c: fmt(c.first_up_s)),
        ("p90 TTFT, whole step (s)", lambda c: fmt(c.p90_step_s)),
        ("p90 TTFT, last 5 s (s)", lambda c: fmt(c.p90_tail_s)),
        ("most replicas UP", lambda c: fmt(c.max_replicas)),
        ("replica-seconds", lambda c: fmt(c.replica_s, 1)),
        ("failed / requests", lambda c: f"{c.failed}/{c.requests}"),
    ]
    width = max(14, *(len(c.name) + 2 for c in cols))
    print("\n" + " " * 28 + "".join(f"{c.name:>{width}}" for c in cols))
    for label, get in rows:
        cells = "".join(f"{'error' if c.error else get(c):>{width}}" for c in cols)
        print(f"{label:<28}{cells}")
    for c in cols:
        if c.error:
            print(f"{c.name}: {c.error}")
