"""Pipeline overhead benchmark: a bare FastAPI "HTTP floor" vs real omnistage heads.

One server at a time (floor, ``echo-1stage``, ``echo``), closed-loop load at concurrency 1
and 32; prints req/s, p50/p99 and the pipelines' cost relative to the floor. See README.md.
"""

import argparse
import asyncio
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

import common
from common import HOST, ServerProcess, free_port

PATH = "/v1/chat/completions"
CONCURRENCIES = (1, 32)
TARGET_RATIO_C32 = 0.5  # 3-stage req/s >= 50% of the floor's at c=32
TARGET_HOP_MS_C1 = 1.0  # 3-stage added p50 per stage hop at c=1 < 1 ms


@dataclass(frozen=True)
class Target:
    name: str
    stages: int  # 0 for the floor
    expect: bytes  # text the response body must contain
    # Another checkout to serve omnistage from (bench_head_cpu --baseline-tree); "": this one.
    tree: str = ""

    @property
    def pipeline(self) -> str:
        """The pipeline served (a baseline target is named ``PIPELINE@base``)."""
        return self.name.split("@")[0]


TARGETS = (
    Target("floor", 0, b"[floor]"),
    Target("echo-1stage", 1, b"[echo]"),
    Target("echo", 3, b"[vocoder]"),
)


@dataclass
class Result:
    target: str
    stages: int
    concurrency: int
    requests: int
    rps: float = 0.0
    p50_ms: float = 0.0
    p99_ms: float = 0.0
    mean_ms: float = 0.0
    client_cpu_pct: float = 0.0  # the load generator's CPU time over the measured wall time
    ratio_to_floor: float | None = None
    added_p50_per_hop_ms: float | None = None
    error: str | None = None


# -- the HTTP floor (runs in a subprocess: this file with --serve-floor PORT) -------------


def serve_floor(port: int) -> None:
    import msgspec
    import uvicorn
    from fastapi import FastAPI, Request
    from starlette.responses import Response

    app = FastAPI()
    encoder, decoder = msgspec.json.Encoder(), msgspec.json.Decoder()
    usage = {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}
    message = {"role": "assistant", "content": "hello [floor]"}
    reply = {
        "id": "chatcmpl-0123456789abcdef0123456789abcdef",
        "object": "chat.completion",
        "created": 0,
        "model": "floor",
        "choices": [{"index": 0, "message": message, "finish_reason": "stop", "logprobs": None}],
        "usage": usage,
    }

    @app.post(PATH)
    async def chat(request: Request) -> Response:
        body = decoder.decode(await request.body())
        return Response(
            encoder.encode({**reply, "model": body.get("model", "floor")}),
            media_type="application/json",
        )

    # Same settings as omnistage.head: one worker, no access log, no lifespan.
    uvicorn.run(app, host=HOST, port=port, log_level="warning", access_log=False, lifespan="off")


# -- server processes ---------------------------------------------------------------------


def start_server(target: Target, port: int) -> ServerProcess:
    if target.stages == 0:
        cmd = [sys.executable, os.path.abspath(__file__), "--serve-floor", str(port)]
    else:
        cmd = [sys.executable, "-m", "omnistage", "serve", target.pipeline]
        cmd += ["--host", HOST, "--port", str(port), "--log-level", "WARNING"]
        if target.tree:
            # ``python -m`` imports from its working directory first: run it in the tree.
            cmd = ["env", "-C", target.tree, f"PYTHONPATH={target.tree}", *cmd]
    return ServerProcess(target.name, cmd, port)


def wait_ready(server: ServerProcess, target: Target, timeout: float) -> None:
    # The floor has only the POST route; a head is ready when /health says 200.
    if target.stages:
        server.wait_ready(timeout)
    else:
        server.wait_ready(timeout, PATH, request_body(target))


# -- a minimal HTTP/1.1 keep-alive load generator -----------------------------------------


def request_body(target: Target) -> bytes:
    msg = {"role": "user", "content": "hello"}
    return json.dumps({"model": target.pipeline, "messages": [msg]}).encode()


Conn = tuple[asyncio.StreamReader, asyncio.StreamWriter]


async def post(conn: Conn, request: bytes, expect: bytes) -> None:
    reader, writer = conn
    writer.write(request)
    head = await reader.readuntil(b"\r\n\r\n")
    status_line, _, headers = head.partition(b"\r\n")
    length = -1
    for line in headers.split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    if length < 0:
        raise RuntimeError(f"no Content-Length in response: {head!r}")
    body = await reader.readexactly(length)
    if status_line.split(b" ", 2)[1] != b"200":
        raise RuntimeError(f"{status_line.decode(errors='replace')}: {body[:300]!r}")
    if expect not in body:
        raise RuntimeError(f"{expect!r} not in response body {body[:300]!r}")


async def closed_loop(
    conns: list[Conn], n: int, request: bytes, expect: bytes, timeout: float
) -> tuple[list[float], float]:
    """Send n requests over the connections, one at a time on each; return latencies, wall."""
    left = [n]
    latencies: list[float] = []

    async def worker(conn: Conn) -> None:
        while left[0] > 0:
            left[0] -= 1
            t0 = time.perf_counter()
            async with asyncio.timeout(timeout):
                await post(conn, request, expect)
            latencies.append(time.perf_counter() - t0)

    start = time.perf_counter()
    async with asyncio.TaskGroup() as tg:
        for conn in conns:
            tg.create_task(worker(conn))
    return latencies, time.perf_counter() - start


async def load(target: Target, port: int, c: int, n: int, warmup: int, timeout: float) -> Result:
    body = request_body(target)
    request = (
        f"POST {PATH} HTTP/1.1\r\nHost: {HOST}:{port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    conns: list[Conn] = []
    try:
        async with asyncio.timeout(timeout):
            for _ in range(c):
                conns.append(await asyncio.open_connection(HOST, port))
        await closed_loop(conns, warmup, request, target.expect, timeout)
        cpu = time.process_time()
        lat, wall = await closed_loop(conns, n, request, target.expect, timeout)
        cpu = time.process_time() - cpu
    finally:
        for _, writer in conns:
            writer.close()
    lat.sort()
    p50_ms, p99_ms = common.pct(lat, 50) * 1e3, common.pct(lat, 99) * 1e3
    r = Result(target.name, target.stages, c, n, n / wall, p50_ms, p99_ms)
    r.mean_ms, r.client_cpu_pct = sum(lat) / len(lat) * 1e3, cpu / wall * 100
    return r


# -- driver and report --------------------------------------------------------------------


def bench_target(target: Target, args: argparse.Namespace) -> list[Result]:
    counts = {1: args.requests_c1, 32: args.requests}
    results = [Result(target.name, target.stages, c, counts[c]) for c in CONCURRENCIES]
    server = None
    try:
        server = start_server(target, free_port())
        wait_ready(server, target, args.health_timeout)
        for i, c in enumerate(CONCURRENCIES):
            coro = load(target, server.port, c, counts[c], args.warmup, args.request_timeout)
            results[i] = asyncio.run(coro)
    except Exception as exc:  # an ExceptionGroup from the load's TaskGroup, too
        error = common.describe(exc, args.request_timeout)
        for r in results:
            if not r.rps:
                r.error = error
        print(f"! {target.name}: {results[-1].error}", flush=True)
    finally:
        if server is not None:
            server.stop()
    return results


def fill_relative(results: list[Result]) -> None:
    floor = {r.concurrency: r for r in results if r.stages == 0 and r.error is None}
    for r in results:
        f = floor.get(r.concurrency)
        if r.stages == 0 or r.error is not None or f is None:
            continue
        r.ratio_to_floor = r.rps / f.rps
        if r.concurrency == 1:
            r.added_p50_per_hop_ms = (r.p50_ms - f.p50_ms) / r.stages


def report(results: list[Result]) -> list[dict[str, Any]]:
    cols = f"{'target':<12} {'stages':>6} {'conc':>4} {'req/s':>9} {'p50 ms':>8} {'p99 ms':>8}"
    print(f"\n{cols} {'x floor':>8} {'+p50/hop ms':>12} {'client cpu':>10}")
    for r in results:
        if r.error is not None:
            why = r.error.splitlines()[0][:200]
            print(f"{r.target:<12} {r.stages:>6} {r.concurrency:>4}  FAILED: {why}")
            continue
        ratio = f"{r.ratio_to_floor:.2f}" if r.ratio_to_floor is not None else "-"
        hop = f"{r.added_p50_per_hop_ms:.3f}" if r.added_p50_per_hop_ms is not None else "-"
        print(
            f"{r.target:<12} {r.stages:>6} {r.concurrency:>4} {r.rps:>9.0f} {r.p50_ms:>8.3f} "
            f"{r.p99_ms:>8.3f} {ratio:>8} {hop:>12} {r.client_cpu_pct:>9.0f}%"
        )
    by = {(r.target, r.concurrency): r for r in results}
    ratio, hop = by[("echo", 32)].ratio_to_floor, by[("echo", 1)].added_p50_per_hop_ms
    ratio_ok = ratio is not None and ratio >= TARGET_RATIO_C32
    hop_ok = hop is not None and hop < TARGET_HOP_MS_C1
    goals = [
        (f"3-stage req/s at c=32 >= {TARGET_RATIO_C32:.0%} of floor", ratio, ratio_ok),
        (f"3-stage added p50 per stage hop at c=1 < {TARGET_HOP_MS_C1:g} ms", hop, hop_ok),
    ]
    print("\ntargets:")
    for goal, value, met in goals:
        shown = "n/a" if value is None else f"{value:.3f}"
        print(f"  {goal:<48} {shown:>8}  {'PASS' if met else 'MISS'}")
    return [{"goal": goal, "value": value, "met": met} for goal, value, met in goals]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=2000, help="measured requests at c=32")
    p.add_argument("--requests-c1", type=int, default=500, help="measured requests at c=1")
    p.add_argument("--warmup", type=int, default=200, help="warm-up requests per run")
    common.add_common_args(p, health_timeout=120.0, request_timeout=10.0)
    p.add_argument("--serve-floor", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve_floor:
        serve_floor(args.serve_floor)
        return 0
    print(
        f"{common.machine()}; warm-up {args.warmup}, requests c=1: {args.requests_c1}, "
        f"c=32: {args.requests}"
    )
    common.exit_on_sigterm()
    results: list[Result] = []
    for target in TARGETS:
        results += bench_target(target, args)
    fill_relative(results)
    goals = report(results)
    if args.json:
        sections = {"results": [asdict(r) for r in results], "targets": goals}
        common.write_json(args.json, args, sections, skip=["serve_floor"])
    # A run that failed gave no figures: exit 1 (a MISS is a figure and exits 0).
    if failed := sum(r.error is not None for r in results):
        print(f"! {failed} run(s) FAILED")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
