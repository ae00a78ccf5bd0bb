"""Restart-to-UP of the default thinker's replicas, with the packed int4 weights cached on
disk (``packed_cache``, the default) against packing them at every start, on a busy machine.

A head serves the default pipeline's thinker alone (SmolLM2, the fast int4 backend) with
two local replicas. Each round SIGKILLs one replica, then both at once, and times each from the kill
until the head shows its new incarnation UP (polling ``/v1/omni/stages`` every 50 ms). The
head restarts a replica that had reached UP at once, so the figure is the replica's start:
process, imports, weights, warm-up. ``--busy N`` runs N spinning processes meanwhile (the
default: one per core), as the machine of a chaos run is.

    python bench/bench_restart.py [--rounds 2] [--busy 2] [--json out.json]

About 4 minutes. Exit status 1 if a replica does not come back within the timeout.
"""

from __future__ import annotations

import argparse
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
from common import HOST, ServerProcess, free_port

from omnistage import envs
from omnistage.launch.restart import SETTLE_S

TIMEOUT_S = 300.0
# The default pipeline's thinker alone, at two replicas.
THINKER = """pipeline: thinker
stages:
  - stage_id: 0
    name: thinker
    engine: llm
    engine_args: {{model: smollm2, packed_cache: {packed_cache}}}
    replicas: 2
    final_output: true
    output_modality: text
"""


class Head:
    def __init__(self, packed_cache: bool, cache_dir: str) -> None:
        self.port = free_port()
        config = Path(cache_dir) / "thinker.yaml"
        config.write_text(THINKER.format(packed_cache=str(packed_cache).lower()))
        cmd = [sys.executable, "-m", "omnistage", "serve", str(config)]
        cmd += ["--host", HOST, "--port", str(self.port), "--log-level", "INFO"]
        env_cache = os.environ.get("OMNISTAGE_CACHE_DIR")
        os.environ["OMNISTAGE_CACHE_DIR"] = cache_dir  # the replicas inherit it
        try:
            self.proc = ServerProcess(f"head (packed_cache={packed_cache})", cmd, self.port)
        finally:
            if env_cache is None:
                os.environ.pop("OMNISTAGE_CACHE_DIR")
            else:
                os.environ["OMNISTAGE_CACHE_DIR"] = env_cache

    def replicas(self) -> list[dict[str, Any]]:
        url = f"http://{HOST}:{self.port}/v1/omni/stages"
        with urllib.request.urlopen(url, timeout=2.0) as resp:
            stages = json.load(resp)["stages"]
        return next(s["replicas"] for s in stages if s["stage_id"] == 0)

    def up(self) -> dict[int, dict[str, Any]]:
        if not self.proc.alive():
            raise RuntimeError(f"the head exited{self.proc.log_tail()}")
        try:
            replicas = self.replicas()
        except OSError:  # not listening yet
            return {}
        return {r["replica_id"]: r for r in replicas if r["state"] == "UP"}

    def wait_up(self, count: int) -> dict[int, dict[str, Any]]:
        deadline = time.monotonic() + TIMEOUT_S
        while time.monotonic() < deadline:
            up = self.up()
            if len(up) >= count:
                return up
            time.sleep(0.1)
        raise RuntimeError(f"{count} replicas not UP in {TIMEOUT_S:g}s{self.proc.log_tail()}")

    def settled(self) -> dict[int, dict[str, Any]]:
        """Both replicas UP for longer than the restart policy's settle time, so a kill
        restarts them at once (launch/restart.py), as it does a replica that served."""
        up = self.wait_up(2)
        time.sleep(SETTLE_S + 1.0)
        return up

    def restart(self, victims: list[dict[str, Any]]) -> list[float]:
        """Kill ``victims`` at once; seconds from the kill to each one's new epoch UP."""
        for v in victims:
            if common.parent_pid(v["pid"]) != self.proc.pid:
                raise RuntimeError(f"replica pid {v['pid']} is not a child of the head")
        killed = time.perf_counter()
        for v in victims:
            os.kill(v["pid"], signal.SIGKILL)
        back: dict[int, float] = {}
        while len(back) < len(victims):
            if time.perf_counter() - killed > TIMEOUT_S:
                raise RuntimeError(f"not back in {TIMEOUT_S:g}s{self.proc.log_tail()}")
            up = self.up()
            for v in victims:
                now = up.get(v["replica_id"])
                if v["replica_id"] not in back and now and now["epoch"] != v["epoch"]:
                    back[v["replica_id"]] = time.perf_counter() - killed
            time.sleep(0.05)
        return [back[v["replica_id"]] for v in victims]


def run_mode(packed_cache: bool, rounds: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="omni-restart-") as cache_dir:
        # A cache of its own for the packed weights, but the converted GGUF as it is.
        (Path(cache_dir) / "models").symlink_to(Path(envs.cache_dir()) / "models")
        head = Head(packed_cache, cache_dir)
        try:
            head.wait_up(2)
            one, two = [], []
            for _ in range(rounds):
                up = head.settled()
                one += head.restart([up[min(up)]])
                up = head.settled()
                two += head.restart(list(up.values()))
            return {"packed_cache": packed_cache, "one": one, "two": two}
        finally:
            head.proc.stop()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--busy", type=int, default=os.cpu_count() or 2, help="spinning processes")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = p.parse_args()
    try:
        with common.spinning(args.busy):
            results = [run_mode(True, args.rounds), run_mode(False, args.rounds)]
    except RuntimeError as exc:
        print(f"FAILED: {exc}")
        return 1
    print(f"{common.machine()}; {args.busy} spinning processes beside the replicas")
    print("restart-to-UP, s   | one replica killed     | two killed at once (each)")
    rows = {}
    for r in results:
        one, two = sorted(r["one"]), sorted(r["two"])
        name = "packed cache" if r["packed_cache"] else "packed at start"
        rows[name] = (one, two)
        print(
            f"{name:18} | median {common.pct(one, 50):5.2f} max {one[-1]:5.2f} "
            f"| median {common.pct(two, 50):5.2f} max {two[-1]:5.2f}"
        )
    (c1, c2), (p1, p2) = rows["packed cache"], rows["packed at start"]
    print(
        f"the cache's speed-up (median): one {common.pct(p1, 50) / common.pct(c1, 50):.1f}x, "
        f"two at once {common.pct(p2, 50) / common.pct(c2, 50):.1f}x"
    )
    if args.json:
        common.write_json(args.json, args, {"results": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
