"""Tensors between two stages: the shm connector against the zmq one, on this machine, in
the same run.

Per tensor size (``--sizes``) and connector, a head serves two echo stages: the thinker
emits a tensor of that size per token (``tensor_bytes``), the talker reads them over a
direct edge (``omni_kv_config``) and checks them (order, CRC-32) and times each one's
transit, from the thinker's engine making it to the talker's engine reading it (one
CLOCK_MONOTONIC on one host). Requests run one at a time, twice per row: flat out, for
tensor bytes per second (a request's tensor bytes over its wall time at the client), and
paced (a token every ``--pace-ms``), for the added latency per token (the transit's p50
and mean when no token waits behind another). Also the bytes the talker's TCP sockets
received per request: the tensors themselves on zmq, descriptors on shm. See README.md.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import common
from common import HOST, ServerProcess, free_port

from omnistage.engines import echo_tensors

PIPELINE = """\
pipeline: bench-{connector}
stages:
  - stage_id: 0
    name: thinker
    engine: echo
    engine_args: {{num_chunks: {tokens}, tensor_bytes: {nbytes}, chunk_delay_s: {pace_s}}}
  - stage_id: 1
    name: talker
    engine: echo
    inputs: [0]
    final_output: true
    engine_args: {{check_tensors: true}}
    omni_kv_config:
      - omni_from_stage: 0
        connector_config: {{name: {connector}, segment_bytes: {segment}}}
"""


def tcp_received(pid: int) -> int:
    """Bytes the TCP sockets of process ``pid`` have received (``ss``'s tcp_info)."""
    out = subprocess.run(["ss", "-tinpH"], capture_output=True, text=True, check=True).stdout
    total, mine = 0, False
    for line in out.splitlines():
        if not line[:1].isspace():
            mine = f"pid={pid}," in line
        elif mine and (found := re.search(r"bytes_received:(\d+)", line)):
            total += int(found.group(1))
    return total


def _post(port: int, prompt: str, timeout: float) -> str:
    body = json.dumps({"messages": [{"role": "user", "content": prompt}]}).encode()
    req = urllib.request.Request(
        f"http://{HOST}:{port}/v1/chat/completions",
        data=body,
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return str(json.loads(resp.read())["choices"][0]["message"]["content"])


def _talker_pid(port: int) -> int:
    with urllib.request.urlopen(f"http://{HOST}:{port}/v1/omni/stages", timeout=10) as resp:
        stages = json.loads(resp.read())["stages"]
    talker = next(s for s in stages if s["stage_id"] == 1)
    return int(talker["replicas"][0]["pid"])


def run_one(
    args: argparse.Namespace, connector: str, nbytes: int, pace_s: float, tmp: Path
) -> dict[str, Any]:
    path = tmp / f"{connector}-{nbytes}-{pace_s}.yaml"
    path.write_text(
        PIPELINE.format(
            connector=connector,
            tokens=args.tokens,
            nbytes=nbytes,
            segment=args.segment_bytes,
            pace_s=pace_s,
        )
    )
    port = free_port()
    cmd = [sys.executable, "-m", "omnistage", "serve", str(path), "--port", str(port)]
    cmd += ["-oma", HOST, "-omp", str(free_port())]
    server = ServerProcess(f"{connector}-{nbytes}", cmd, port)
    try:
        server.wait_ready(args.health_timeout)
        talker = _talker_pid(port)
        prompt = "x" * (args.tokens + 8)
        want = echo_tensors.expected(args.tokens, nbytes)
        for _ in range(args.warmup):
            _post(port, prompt, args.request_timeout)
        walls, p50s, means, tcp = [], [], [], []
        for _ in range(args.requests):
            before = tcp_received(talker)
            start = time.perf_counter()
            answer = _post(port, prompt, args.request_timeout)
            walls.append(time.perf_counter() - start)
            tcp.append(tcp_received(talker) - before)
            found = echo_tensors.parse(answer)
            got = None if found is None else (found["n"], found["bytes"], found["crc"])
            if got != want or found is None or found["ordered"] != "yes":
                raise RuntimeError(f"tensors did not arrive intact: {found} != {want}")
            p50s.append(int(found["transit_us_p50"]))
            means.append(int(found["transit_us_mean"]))
        tensor_bytes = args.tokens * nbytes
        return {
            "connector": connector,
            "tensor_bytes": nbytes,
            "pace_ms": pace_s * 1000,
            "mb_per_s": tensor_bytes / statistics.median(walls) / 1e6,
            "transit_us_p50": statistics.median(p50s),
            "transit_us_mean": statistics.fmean(means),
            "talker_tcp_bytes_per_request": statistics.median(tcp),
            "wall_s_median": statistics.median(walls),
        }
    finally:
        server.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="4096,65536,1048576", help="tensor bytes, comma-separated")
    p.add_argument("--tokens", type=int, default=64, help="tensors (tokens) per request")
    p.add_argument("--requests", type=int, default=5, help="measured requests per row")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured requests per row")
    p.add_argument("--segment-bytes", type=int, default=128 << 20, help="shm ring size")
    p.add_argument("--pace-ms", type=float, default=10.0, help="token interval, paced runs")
    common.add_common_args(p, health_timeout=60.0, request_timeout=120.0)
    args = p.parse_args()
    common.exit_on_sigterm()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for nbytes in (int(s) for s in args.sizes.split(",")):
            for connector in ("zmq", "shm"):
                flat = run_one(args, connector, nbytes, 0.0, Path(tmp))
                paced = run_one(args, connector, nbytes, args.pace_ms / 1000, Path(tmp))
                rows.append({"flat_out": flat, "paced": paced})
    print(f"# {common.machine()}; {args.tokens} tokens/request, {args.requests} requests/row")
    print(
        f"{'size':>9} {'connector':>9} {'MB/s':>8} {'flat-out transit us':>20} "
        f"{'paced transit us':>17} {'talker TCP B/req':>17}"
    )
    print(f"{'':>28}{'p50 / mean':>20} {'p50 / mean':>17}")
    for row in rows:
        r, q = row["flat_out"], row["paced"]
        print(
            f"{r['tensor_bytes']:>9} {r['connector']:>9} {r['mb_per_s']:>8.1f} "
            f"{r['transit_us_p50']:>11.0f} / {r['transit_us_mean']:<6.0f} "
            f"{q['transit_us_p50']:>8.0f} / {q['transit_us_mean']:<6.0f} "
            f"{r['talker_tcp_bytes_per_request']:>17.0f}"
        )
    if args.json:
        common.write_json(args.json, args, {"rows": rows})


if __name__ == "__main__":
    main()
