"""The head's CPU per streamed event: what an answer streamed token by token costs the
one process every request goes through.

``echo-1stage`` with its replica splitting each answer into ``--chunks`` chunks,
``--delay-ms`` apart (a thinker's pace: one token every few milliseconds), and clients
that stream chat completions (``stream: true``) at each of ``--levels`` concurrencies, back
to back. For each level: the head's CPU time (all its threads, its CPU clock) per
request and per SSE event the clients received. At low concurrency each event is a
wake-up of its own (the replica's message, the orchestrator, the SSE write); at higher
concurrency a wake-up carries several, so the cost per event falls.

``--baseline-tree PATH`` runs a head from another checkout (a ``git worktree``) too, the
two alternating per round, and prints both.

    python bench/bench_stream_cpu.py [--levels 1,4,16] [--rounds 2] [--baseline-tree PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import common
from bench_head_cpu import cpu_seconds  # the process's CPU clock, in ns (not 10 ms ticks)
from common import HOST, ServerProcess, free_port


async def stream_one(port: int, body: bytes) -> int:
    """One streamed chat completion; the SSE data events received before [DONE]."""
    reader, writer = await asyncio.open_connection(HOST, port)
    try:
        writer.write(
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: {HOST}\r\nContent-Type: "
            f"application/json\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
            + body
        )
        head = await reader.readuntil(b"\r\n\r\n")
        if head.split(b" ", 2)[1] != b"200":
            raise RuntimeError(f"HTTP {head[:60]!r}")
        data = await reader.read()  # to the close: chunked framing left in, counted below
        if b"data: [DONE]" not in data:
            raise RuntimeError("the stream ended without [DONE]")
        return data.count(b"\ndata: ") + data.startswith(b"data: ") - 1
    finally:
        writer.close()


async def level(port: int, body: bytes, c: int, n: int, timeout: float) -> int:
    """``n`` streamed requests by ``c`` workers; the events received in all."""
    left, events = [n], [0]

    async def worker() -> None:
        while left[0] > 0:
            left[0] -= 1
            async with asyncio.timeout(timeout):
                got = await stream_one(port, body)  # not ``+= await``: that reads first
            events[0] += got

    await asyncio.gather(*(worker() for _ in range(c)))
    return events[0]


def run_head(tree: Path | None, args: argparse.Namespace) -> dict[int, tuple[float, float]]:
    """One fresh head; per level, (head CPU ms per request, us per event)."""
    port = free_port()
    over = {"0": {"engine_args": {"num_chunks": args.chunks, "chunk_delay_s": args.delay_ms / 1e3}}}
    cmd = [sys.executable, "-m", "omnistage", "serve", "echo-1stage", "--host", HOST]
    cmd += ["--port", str(port), "--log-level", "WARNING", "--stage-overrides", json.dumps(over)]
    if tree is not None:  # ``python -m`` imports from its working directory first
        cmd = ["env", "-C", str(tree), f"PYTHONPATH={tree}", *cmd]
    server = ServerProcess("head", cmd, port)
    msg = {"role": "user", "content": "hello there " * 16}
    body = json.dumps({"model": "echo-1stage", "messages": [msg], "stream": True}).encode()
    out = {}
    try:
        server.wait_ready(args.health_timeout)
        asyncio.run(level(port, body, 1, 10, args.request_timeout))  # warm-up
        for c in args.levels:
            n = args.requests * c
            before, t0 = cpu_seconds(server.pid), time.perf_counter()
            events = asyncio.run(level(port, body, c, n, args.request_timeout))
            cpu, wall = cpu_seconds(server.pid) - before, time.perf_counter() - t0
            out[c] = (cpu / n * 1e3, cpu / max(events, 1) * 1e6)
            print(
                f"    c={c:<3} {n} requests, {events / n:.1f} events each, {wall:.1f} s", flush=True
            )
    finally:
        server.stop()
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--levels", default="1,4,16", help="client concurrencies")
    p.add_argument("--requests", type=int, default=50, help="requests per client per level")
    p.add_argument("--chunks", type=int, default=64, help="chunks per answer")
    p.add_argument("--delay-ms", type=float, default=3.0, help="between an answer's chunks")
    p.add_argument("--rounds", type=int, default=2, help="fresh heads per tree")
    p.add_argument("--baseline-tree", type=Path, help="another checkout, run alike")
    common.add_common_args(p, health_timeout=60.0, request_timeout=60.0)
    args = p.parse_args()
    args.levels = [int(c) for c in args.levels.split(",")]
    common.exit_on_sigterm()
    trees: dict[str, Path | None] = {"this tree": None}
    if args.baseline_tree is not None:
        trees = {"baseline": args.baseline_tree.resolve(), **trees}
    print(f"{common.machine()}; echo-1stage, {args.chunks} chunks {args.delay_ms:g} ms apart")
    runs: dict[str, list[dict[int, tuple[float, float]]]] = {label: [] for label in trees}
    for rnd in range(1, args.rounds + 1):
        for label, tree in trees.items():  # alternating: drift hits both alike
            print(f"  round {rnd}, {label}", flush=True)
            runs[label].append(run_head(tree, args))
    print("head CPU per streamed request (ms) and per SSE event (us), median of the rounds")
    print(f"{'tree':<10}" + "".join(f"{f'c={c} ms':>10}{f'c={c} us':>10}" for c in args.levels))
    for label, rs in runs.items():
        cells = ""
        for c in args.levels:
            ms = statistics.median(r[c][0] for r in rs)
            us = statistics.median(r[c][1] for r in rs)
            cells += f"{ms:10.2f}{us:10.1f}"
        print(f"{label:<10}{cells}")
        per_round = "; ".join(" ".join(f"{r[c][1]:.0f}" for c in args.levels) for r in rs)
        print(f"{'':<10}per round, us/event: {per_round}")
    if args.json:
        found = {k: [{str(c): v for c, v in r.items()} for r in rs] for k, rs in runs.items()}
        common.write_json(args.json, args, {"runs": found}, skip=("baseline_tree",))
    return 0


if __name__ == "__main__":
    sys.exit(main())
