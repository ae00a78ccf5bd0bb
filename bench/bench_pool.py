"""The head's routing cost per request, in process: ``StagePool.try_acquire`` then
``release`` on one stage of N live replicas, for least-queue-length and cache-aware.

Each replica has capacity 64 and the pool holds 16 requests throughout (so load varies
between replicas). For cache-aware, every replica has reported 512 prefix keys (a full
report, as a busy llm replica sends) and each request carries 8 keys, the first 5 of
which one replica holds: the index must find it among all the others. The figure is
microseconds per acquire + release, the best of ``--rounds`` (``--cpu``: of the process's
CPU time, not the wall clock: on a machine shared with other work).

A third row, ``one free``: least-queue-length on replicas of capacity 1, all but one
holding a request, so that a request's random sample almost never has room: what a
request costs a stage that is nearly full.

``--baseline-tree PATH`` runs the same measurement on another checkout (a ``git
worktree`` of an older commit) in a subprocess and prints both side by side; the
script itself only uses the pool's public methods, which both trees have.

    python bench/bench_pool.py [--sizes 2,100,1000,5000] [--baseline-tree PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

HELD = 16  # requests the pool holds while the measured ones come and go
REPORTED = 512  # keys each replica reported
KEYS = 8  # prefix keys per request
ONE_FREE = "one free"
ROWS = ("least-queue-length", "cache-aware", ONE_FREE)


def _measure(
    sizes: list[int], rounds: int, iterations: int, cpu: bool = False
) -> dict[str, dict[int, float]]:
    clock = time.process_time if cpu else time.perf_counter
    from omnistage.control.balancing import make_policy
    from omnistage.control.replica_table import ReplicaEntry, Transition
    from omnistage.dataplane.stage_pool import StagePool
    from omnistage.protocol.enums import Reason
    from omnistage.protocol.messages import ReplicaState

    try:  # newer trees: the prefix a request carries
        from omnistage.control.balancing.prefix_index import RequestPrefix
    except ImportError:  # pragma: no cover - trees before cache-aware routing
        RequestPrefix = None

    def pool_of(policy: str, n: int, rng: random.Random, capacity: int = 64) -> StagePool:
        pool = StagePool(0, "s", make_policy(policy, random.Random(1)))
        for rid in range(n):
            e = ReplicaEntry(
                stage_id=0,
                replica_id=rid,
                epoch=1,
                state=ReplicaState.UP,
                address="127.0.0.1",
                local=True,
                registered_at=0.0,
                last_seen=0.0,
                start_deadline=0.0,
                capacity=capacity,
            )
            pool.apply(Transition(e, ReplicaState.STARTING, ReplicaState.UP, Reason.READY))
            if policy == "cache-aware":
                keys = [rng.getrandbits(62) for _ in range(REPORTED)]
                pool.report_prefixes(rid, 1, 1, keys)
        return pool

    out: dict[str, dict[int, float]] = {}
    for row in ROWS:
        policy = "least-queue-length" if row == ONE_FREE else row
        out[row] = {}
        for n in sizes:
            rng = random.Random(n)
            pool = pool_of(policy, n, rng, capacity=1 if row == ONE_FREE else 64)
            prefix = None
            if policy == "cache-aware" and RequestPrefix is not None:
                keys = [rng.getrandbits(62) for _ in range(KEYS)]
                pool.report_prefixes(n // 2, 1, 2, keys[:5])
                prefix = RequestPrefix(keys, [10 * (i + 1) for i in range(KEYS)])
            held = [
                pool.try_acquire(f"held-{i}") for i in range(n - 1 if row == ONE_FREE else HELD)
            ]
            assert all(held), "the pool refused a request it had room for"
            best = float("inf")
            for _ in range(rounds):
                t0 = clock()
                for i in range(iterations):
                    handle = pool.try_acquire(f"r{i}", prefix=prefix)
                    pool.release(handle, f"r{i}")
                best = min(best, (clock() - t0) / iterations * 1e6)
            out[row][n] = best
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="2,100,1000,5000")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iterations", type=int, default=2000)
    ap.add_argument("--baseline-tree", type=Path, help="another checkout, run alike")
    ap.add_argument("--json", action="store_true", help="print the figures as JSON only")
    ap.add_argument("--cpu", action="store_true", help="time by process CPU, not wall clock")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    if args.json:
        print(json.dumps(_measure(sizes, args.rounds, args.iterations, args.cpu)))
        return 0
    columns = {"this tree": None}
    if args.baseline_tree is not None:
        columns = {"baseline": args.baseline_tree, **columns}
    figures: dict[str, dict[str, dict[int, float]]] = {}
    for label, tree in columns.items():
        root = Path(tree or Path(__file__).resolve().parent.parent).resolve()
        env = {**os.environ, "PYTHONPATH": str(root)}
        cmd = [sys.executable, str(Path(__file__).resolve()), "--json", "--sizes", args.sizes]
        cmd += ["--rounds", str(args.rounds), "--iterations", str(args.iterations)]
        cmd += ["--cpu"] if args.cpu else []
        done = subprocess.run(cmd, env=env, cwd=root, capture_output=True, text=True)
        if done.returncode != 0:
            print(f"{label}: failed\n{done.stderr[-2000:]}", file=sys.stderr)
            return 1
        raw = json.loads(done.stdout)
        figures[label] = {p: {int(n): v for n, v in by_n.items()} for p, by_n in raw.items()}
    what = "CPU us" if args.cpu else "us"
    print(f"{what} per acquire + release, best of {args.rounds} x {args.iterations}; {HELD} held")
    print(f"{'policy':20s} {'tree':10s}" + "".join(f"{n:>10,d}" for n in sizes))
    for policy in ROWS:
        for label in columns:
            row = figures[label][policy]
            print(f"{policy:20s} {label:10s}" + "".join(f"{row[n]:10.1f}" for n in sizes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
