"""Images out: images/s of one diffusion replica behind the head, by size and concurrency.

Builds the tiny random-weight Stable Diffusion pipeline the tests use (tests/
diffusion_tiny.py) in a temporary directory, serves it as a one-stage pipeline (one
replica, ``max_concurrent`` slots), and sends ``POST /v1/images/generations`` from
``c`` client threads: ``--warmup`` requests, then ``--requests`` measured ones per
(size, c). Every answer must be a 200 holding one image. The figures are the serving
path's (HTTP, head, replica, engine, PNG encoding) on a model whose compute is tiny;
with real weights the denoising steps dominate and images/s is roughly 1 / (steps x
seconds per step).
"""

import argparse
import base64
import json
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import common
from common import HOST, ServerProcess, free_port

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # for tests.diffusion_tiny
from tests.diffusion_tiny import build_tiny_pipeline

PIPELINE_YAML = """\
pipeline: tiny-painter
stages:
  - stage_id: 0
    name: painter
    engine: diffusion
    final_output: true
    output_modality: image
    engine_args: {engine_args}
    max_inflight_per_replica: 16
"""


def _post(port: int, body: dict[str, Any], timeout: float) -> float:
    """One request; its latency. Raises unless it is a 200 with one image."""
    req = urllib.request.Request(
        f"http://{HOST}:{port}/v1/images/generations",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    started = time.perf_counter()
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        out = json.loads(resp.read())
    elapsed = time.perf_counter() - started
    if len(out.get("data") or []) != 1 or not base64.b64decode(out["data"][0]["b64_json"]):
        raise RuntimeError(f"no image in {str(out)[:200]}")
    return elapsed


def _load(port: int, body: dict[str, Any], requests: int, c: int, timeout: float) -> dict:
    """``requests`` requests from ``c`` threads; images/s and latencies."""
    latencies: list[float] = []
    errors: list[str] = []
    left = iter(range(requests))
    lock = threading.Lock()

    def worker() -> None:
        while True:
            with lock:
                seed = next(left, None)
            if seed is None:
                return
            try:
                latency = _post(port, {**body, "seed": seed}, timeout)
            except Exception as exc:
                with lock:
                    errors.append(common.describe(exc, timeout))
                continue
            with lock:
                latencies.append(latency)

    started = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(c)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - started
    latencies.sort()
    return {
        "images": len(latencies),
        "wall_s": wall,
        "images_per_s": len(latencies) / wall if wall else 0.0,
        "p50_s": statistics.median(latencies) if latencies else None,
        "p99_s": common.pct(latencies, 99) if latencies else None,
        "errors": errors[:3],
    }


def _serve(
    model: Path, slots: int, steps: int, torch_threads: int | None, work: Path, timeout: float
) -> ServerProcess:
    engine_args: dict[str, Any] = {
        "model": str(model),
        "max_concurrent": slots,
        "num_inference_steps": steps,
    }
    if torch_threads:
        engine_args["torch_threads"] = torch_threads
    config = work / f"tiny-painter-{slots}.yaml"
    config.write_text(PIPELINE_YAML.format(engine_args=json.dumps(engine_args)))
    port = free_port()
    cmd = [sys.executable, "-m", "omnistage", "serve", str(config), "--port", str(port)]
    server = ServerProcess(f"tiny-painter slots={slots}", cmd, port)
    server.wait_ready(timeout)
    return server


def run(args: argparse.Namespace) -> list[dict]:
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model = build_tiny_pipeline(work / "tiny-sd")
        for slots in args.slots:
            server = _serve(model, slots, args.steps, args.torch_threads, work, args.health_timeout)
            try:
                for size in args.sizes:
                    body = {"prompt": "a lighthouse at night", "size": size}
                    for c in args.concurrency:
                        _load(server.port or 0, body, args.warmup, c, args.request_timeout)
                        result = _load(
                            server.port or 0, body, args.requests, c, args.request_timeout
                        )
                        rows.append({"slots": slots, "size": size, "c": c, **result})
                        _print_row(rows[-1])
            finally:
                server.stop()
    return rows


def _print_row(row: dict) -> None:
    p50 = f"{row['p50_s']:.3f}" if row["p50_s"] is not None else "-"
    p99 = f"{row['p99_s']:.3f}" if row["p99_s"] is not None else "-"
    print(
        f"{row['slots']:>5} {row['size']:>9} {row['c']:>3} {row['images']:>6} "
        f"{row['images_per_s']:>9.2f} {p50:>8} {p99:>8}  {'; '.join(row['errors'])}",
        flush=True,
    )


def _loadavg() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="64x64,256x256", help="comma-separated WxH sizes")
    p.add_argument("--concurrency", default="1,2", help="comma-separated client concurrencies")
    p.add_argument("--slots", default="1", help="comma-separated max_concurrent values")
    p.add_argument("--steps", type=int, default=20, help="denoising steps per image")
    p.add_argument(
        "--torch-threads",
        type=int,
        default=None,
        help="the engine's torch_threads (default: the cores split between the slots)",
    )
    p.add_argument("--requests", type=int, default=12, help="measured requests per cell")
    p.add_argument("--warmup", type=int, default=2, help="requests before each cell")
    common.add_common_args(p, health_timeout=180.0, request_timeout=120.0)
    args = p.parse_args()
    args.sizes = args.sizes.split(",")
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    args.slots = [int(s) for s in args.slots.split(",")]
    common.exit_on_sigterm()
    threads = args.torch_threads or "cores / slots"
    print(f"# {common.machine()}; tiny SD pipeline, {args.steps} steps, one replica")
    print(f"# torch threads: {threads}; load average before: {_loadavg()}")
    print(
        f"{'slots':>5} {'size':>9} {'c':>3} {'images':>6} {'images/s':>9} {'p50 s':>8} {'p99 s':>8}"
    )
    rows = run(args)
    print(f"# load average after: {_loadavg()}")
    if args.json:
        common.write_json(args.json, args, {"results": rows})
    # Every answer must hold an image: a cell with errors measured fewer than it says.
    if bad := sum(1 for r in rows if r["errors"]):
        print(f"! {bad} cell(s) with failed requests")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
