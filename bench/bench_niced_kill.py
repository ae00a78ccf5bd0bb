"""How soon the head sees a SIGKILLed local replica whose threads are niced and busy, on
cores kept busy by nice-0 work, against one whose busy threads run at nice 0; with the
head's death watch (``launch.death_watch``) on and off.

A head serves two echo stages: a thinker whose ``--live-threads`` threads compute at nice
0 (the live work, in the head's own session: under autogroup scheduling nice only weighs
against threads of the same session), and two talker replicas that pass its chunks on.
Each talker runs ``--threads`` threads that compute for ever outside the GIL (a TTS
engine's later-chunk pool at work) at nice ``--nice`` or 0, and holds ``--ballast-mb`` of
touched memory (a model's weights: the killed process unmaps them as it exits).
``--busy`` nice-0 processes spin beside the head (other users' work). Per kill: two
streaming answers (``CHUNKS`` chunks ``CHUNK_S`` apart) run, one talker is SIGKILLed
mid-answer, and the benchmark times from the kill

- ``ERROR``: the first ``/v1/omni/stages`` poll (every 10 ms) showing the victim ERROR;
- ``gone``: its pid gone from /proc (the head reaps it as it exits: sockets closed);
- ``gap``: the longest pause between two chunks of the answers (the answer that failed
  over waits for the ERROR); ``calm``: the same for two answers with no kill, first.

    python bench/bench_niced_kill.py [--kills 4] [--busy 4] [--nice 19] [--json out.json]

About 2-3 minutes. Exit status 1 if an answer fails or a replica does not come back.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import common
import httpx
from common import HOST, ServerProcess, free_port

CHUNKS, CHUNK_S = 60, 0.05  # a 3 s answer
POLL_S = 0.01
TIMEOUT_S = 60.0
# The thinker computes at nice 0 (the live work, in the head's session: with autogroup
# scheduling, nice weighs only against threads of the same session); the two talkers pass
# its chunks on, beside their niced busy threads and their ballast.
CONFIG = """pipeline: niced-kill
stages:
  - stage_id: 0
    name: thinker
    engine: echo
    engine_args: {{num_chunks: {chunks}, chunk_delay_s: {chunk_s}, busy_threads: {live}}}
  - stage_id: 1
    name: talker
    engine: echo
    inputs: [0]
    engine_args: {{busy_threads: {threads}, busy_nice: {nice}, ballast_mb: {ballast}}}
    replicas: 2
    final_output: true
"""
VICTIM_STAGE = 1


class Head:
    def __init__(self, folder: str, args: argparse.Namespace, nice: int, watch: bool) -> None:
        self.port = free_port()
        config = Path(folder) / f"niced-kill-{nice}-{int(watch)}.yaml"
        config.write_text(
            CONFIG.format(
                chunks=CHUNKS,
                chunk_s=CHUNK_S,
                live=args.live_threads,
                threads=args.threads,
                nice=nice,
                ballast=args.ballast_mb,
            )
        )
        cmd = [sys.executable, "-m", "omnistage", "serve", str(config)]
        cmd += ["--host", HOST, "--port", str(self.port), "--log-level", "INFO"]
        saved = os.environ.get("OMNISTAGE_DEATH_WATCH_S")
        os.environ["OMNISTAGE_DEATH_WATCH_S"] = "0.05" if watch else "0"  # the head's own
        try:
            self.proc = ServerProcess(f"head (nice {nice}, watch {watch})", cmd, self.port)
        finally:
            os.environ.pop("OMNISTAGE_DEATH_WATCH_S")
            if saved is not None:
                os.environ["OMNISTAGE_DEATH_WATCH_S"] = saved

    def replicas(self) -> dict[int, dict[str, Any]]:
        url = f"http://{HOST}:{self.port}/v1/omni/stages"
        with urllib.request.urlopen(url, timeout=2.0) as resp:
            stages = json.load(resp)["stages"]
        stage = next(s for s in stages if s["stage_id"] == VICTIM_STAGE)
        return {r["replica_id"]: r for r in stage["replicas"]}

    def wait_up(self) -> dict[int, dict[str, Any]]:
        deadline = time.monotonic() + TIMEOUT_S
        while time.monotonic() < deadline:
            if not self.proc.alive():
                raise RuntimeError(f"the head exited{self.proc.log_tail()}")
            try:
                up = {k: r for k, r in self.replicas().items() if r["state"] == "UP"}
            except OSError:  # not listening yet
                up = {}
            if len(up) == 2:
                return up
            time.sleep(0.1)
        raise RuntimeError(f"2 replicas not UP in {TIMEOUT_S:g}s{self.proc.log_tail()}")


async def answer(client: httpx.AsyncClient, text: str, started: asyncio.Event) -> float:
    """Stream one answer; the longest pause between its chunks (seconds)."""
    body = {"model": "niced-kill", "stream": True, "messages": [{"role": "user", "content": text}]}
    last, gap = None, 0.0
    async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data:") or line.endswith("[DONE]"):
                continue
            if '"error"' in line:
                raise RuntimeError(f"the answer failed: {line[:200]}")
            now = time.perf_counter()
            if last is not None:
                gap = max(gap, now - last)
                started.set()
            last = now
    return gap


def pid_gone(pid: int) -> bool:
    """Reaped: its leader is a zombie while other threads still exit."""
    return not os.path.exists(f"/proc/{pid}")


async def one_kill(head: Head, victim: dict[str, Any] | None) -> dict[str, float]:
    """Two answers, ``victim`` (or the other talker, if only that one serves an answer)
    SIGKILLed in their midst; None: no kill, the answers' own pace."""
    async with httpx.AsyncClient(base_url=f"http://{HOST}:{head.port}", timeout=30.0) as client:
        started = [asyncio.Event(), asyncio.Event()]
        answers = [
            asyncio.create_task(answer(client, f"answer {i} " + "word " * CHUNKS, started[i]))
            for i in range(2)
        ]
        await asyncio.wait_for(asyncio.gather(*(s.wait() for s in started)), TIMEOUT_S)
        await asyncio.sleep(0.3)
        if victim is None:
            return {"gap": max(await asyncio.gather(*answers))}
        # The one serving an answer (both, if each serves one: the given one).
        busy = await asyncio.to_thread(head.replicas)
        if busy[victim["replica_id"]]["in_flight"] == 0:
            victim = max(busy.values(), key=lambda r: r["in_flight"])
        killed = time.perf_counter()
        os.kill(victim["pid"], signal.SIGKILL)
        seen: dict[str, float] = {}
        while len(seen) < 2 and time.perf_counter() - killed < TIMEOUT_S:
            now = time.perf_counter() - killed
            if "error" not in seen:
                state = await asyncio.to_thread(head.replicas)
                if state[victim["replica_id"]]["epoch"] != victim["epoch"] or (
                    state[victim["replica_id"]]["state"] == "ERROR"
                ):
                    seen["error"] = now
            if "gone" not in seen and pid_gone(victim["pid"]):
                seen["gone"] = now
            await asyncio.sleep(POLL_S)
        gaps = await asyncio.gather(*answers)
    return {**seen, "gap": max(gaps)}


def run(args: argparse.Namespace, folder: str, nice: int, watch: bool) -> list[dict[str, float]]:
    head = Head(folder, args, nice, watch)
    out = []
    try:
        head.wait_up()
        calm = asyncio.run(one_kill(head, None))["gap"]
        for k in range(args.kills):
            up = head.wait_up()
            time.sleep(1.0)  # the restarted one settles in
            for r in up.values():
                if common.parent_pid(r["pid"]) != head.proc.pid:
                    raise RuntimeError(f"replica pid {r['pid']} is not a child of the head")
            victim = up[k % 2]
            r = asyncio.run(one_kill(head, victim))
            r["calm"], r["load1"] = calm, os.getloadavg()[0]
            out.append(r)
            print(
                f"  nice {nice:2d} watch {'on ' if watch else 'off'} kill {k}: {fmt(r)}", flush=True
            )
    finally:
        head.proc.stop()
    return out


def fmt(r: dict[str, float]) -> str:
    return " ".join(f"{k} {v:.2f}" for k, v in r.items())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kills", type=int, default=4, help="kills per configuration")
    p.add_argument("--busy", type=int, default=os.cpu_count() or 2, help="nice-0 spinners")
    p.add_argument("--live-threads", type=int, default=4, help="the thinker's busy threads")
    p.add_argument("--nice", type=int, default=19, help="the niced threads' nice")
    p.add_argument("--threads", type=int, default=2, help="busy threads per replica")
    p.add_argument("--ballast-mb", type=int, default=1000, help="touched memory per replica")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = p.parse_args()
    configs = [(args.nice, False), (0, False), (args.nice, True), (0, True)]
    results: dict[str, list[dict[str, float]]] = {}
    try:
        with common.spinning(args.busy), tempfile.TemporaryDirectory(prefix="omni-kill-") as d:
            for nice, watch in configs:
                name = f"nice {nice}, watch {'on' if watch else 'off'}"
                results[name] = run(args, d, nice, watch)
    except RuntimeError as exc:
        print(f"FAILED: {exc}")
        return 1
    print(
        f"\n{common.machine()}; {args.busy} nice-0 spinners; each replica {args.threads} "
        f"busy threads, {args.ballast_mb} MB; {args.kills} kills each; seconds from the kill"
    )
    print(f"{'configuration':22} | ERROR med  max | gone med  max | gap med  max | calm  | load1")
    for name, rs in results.items():
        cols = []
        for key in ("error", "gone", "gap"):
            xs = sorted(r.get(key, float("nan")) for r in rs)
            cols.append(f"{common.pct(xs, 50):8.2f} {xs[-1]:4.2f}")
        load = sum(r["load1"] for r in rs) / len(rs)
        calm = max(r["calm"] for r in rs)
        print(f"{name:22} | {cols[0]} | {cols[1]} | {cols[2]} | {calm:5.2f} | {load:5.1f}")
    if args.json:
        common.write_json(args.json, args, {"results": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
