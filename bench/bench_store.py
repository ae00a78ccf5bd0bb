"""The store: the latency it adds to a request, on SQLite and PostgreSQL side by side.

What a request adds when it goes through the store (``omnistage/store/sql.py``, through
its async API, thread hop included):

- **stored response**: ``put_response`` then ``get_response`` (a Responses API turn
  stored, and read back as the next turn's ``previous_response_id``);
- **job**: ``create_job``, ``claim_job``, ``renew_lease``, ``finish_job``, ``get_job``
  (a video's life, less the generation: one renewal, one status poll).

SQLite is a file in a temporary directory (WAL, synchronous=NORMAL: a commit is not
fsynced, a checkpoint is). PostgreSQL is a server of its own on 127.0.0.1 over TCP, started
with tests/postgres.py's helper and PostgreSQL's default durability (each commit fsyncs
its WAL). Before measuring, ``--preload`` finished jobs and stored responses fill each
database, so that queries go through indexes of some size. One client, one request at a
time (``--concurrency`` for more, in one event loop). Prints p50/p99/mean per sequence
and per call.
"""

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
import uuid
from collections import defaultdict
from collections.abc import Awaitable
from pathlib import Path
from typing import TypeVar

import common

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # for tests.postgres
from omnistage.store.records import Job, JobKind, JobStatus, StoredResponse
from omnistage.store.sql import SqlStore
from tests.postgres import postgres_database

T = TypeVar("T")
KINDS = [JobKind.VIDEO]
LEASE_S = 30.0
BODY = {
    "object": "response",
    "status": "completed",
    "output": [{"type": "message", "content": [{"type": "output_text", "text": "x" * 400}]}],
    "usage": {"input_tokens": 42, "output_tokens": 100, "total_tokens": 142},
}
INPUT = [{"type": "message", "role": "user", "content": "Tell me about the store. " * 8}]


def _response(owner: str) -> StoredResponse:
    rid = f"resp_{uuid.uuid4().hex}"
    return StoredResponse(
        id=rid,
        owner=owner,
        created_at=time.time(),
        status="completed",
        conversation=rid,
        input_items=INPUT,
        body=BODY,
    )


def _job(owner: str) -> Job:
    request = {"model": "wan", "prompt": "a cat on a boat " * 4, "seconds": 4, "seed": 7}
    return Job(
        id=f"video_{uuid.uuid4().hex}",
        kind=JobKind.VIDEO,
        owner=owner,
        request=request,
        created_at=time.time(),
    )


async def _preload(store: SqlStore, n: int) -> None:
    for i in range(n):
        job = _job(f"owner{i % 10}")
        await store.create_job(job)
        claimed = await store.claim_job(KINDS, "preload", time.time(), LEASE_S, 3)
        assert claimed is not None
        await store.finish_job(claimed.id, "preload", JobStatus.COMPLETED, time.time())
        await store.put_response(_response(f"owner{i % 10}"))


class Timer:
    """Seconds per named call or sequence."""

    def __init__(self) -> None:
        self.samples: dict[str, list[float]] = defaultdict(list)

    async def time(self, name: str, call: Awaitable[T]) -> T:
        started = time.perf_counter()
        out = await call
        self.samples[name].append(time.perf_counter() - started)
        return out


async def _response_turn(store: SqlStore, timer: Timer) -> None:
    started = time.perf_counter()
    stored = _response("bench")
    await timer.time("put_response", store.put_response(stored))
    got = await timer.time("get_response", store.get_response(stored.id, "bench"))
    assert got is not None
    timer.samples["stored response"].append(time.perf_counter() - started)


async def _job_life(store: SqlStore, timer: Timer, holder: str) -> None:
    started = time.perf_counter()
    await timer.time("create_job", store.create_job(_job("bench")))
    job = await timer.time("claim_job", store.claim_job(KINDS, holder, time.time(), LEASE_S, 3))
    assert job is not None, "no job to claim"
    renewed = await timer.time(
        "renew_lease", store.renew_lease(job.id, holder, time.time(), LEASE_S, progress=50)
    )
    finished = await timer.time(
        "finish_job",
        store.finish_job(job.id, holder, JobStatus.COMPLETED, time.time(), result={"n": 1}),
    )
    assert renewed and finished
    assert await timer.time("get_job", store.get_job(job.id, "bench")) is not None
    timer.samples["job"].append(time.perf_counter() - started)


async def _measure(url: str, args: argparse.Namespace) -> dict[str, list[float]]:
    store = SqlStore(url)
    await store.start()
    try:
        await _preload(store, args.preload)
        timer = Timer()

        async def client(i: int) -> None:
            for n in range(args.warmup + args.requests):
                into = timer if n >= args.warmup else Timer()  # warm-up: thrown away
                await _response_turn(store, into)
                await _job_life(store, into, f"bench{i}")

        await asyncio.gather(*(client(i) for i in range(args.concurrency)))
        return timer.samples
    finally:
        await store.close()


def _row(backend: str, name: str, xs: list[float]) -> str:
    xs = sorted(xs)
    p50, p99 = common.pct(xs, 50) * 1e3, common.pct(xs, 99) * 1e3
    mean = statistics.fmean(xs) * 1e3
    return f"{backend:<11} {name:<16} {p50:>8.3f} {p99:>8.3f} {mean:>8.3f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=1000, help="measured requests per client")
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--preload", type=int, default=1000, help="rows in each table first")
    p.add_argument("--concurrency", type=int, default=1, help="clients at once")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = p.parse_args()
    common.exit_on_sigterm()

    results: dict[str, dict[str, list[float]]] = {}
    with tempfile.TemporaryDirectory() as tmp, postgres_database(durable=True) as pg_url:
        for backend, url in (("sqlite", f"sqlite:///{tmp}/store.db"), ("postgresql", pg_url)):
            results[backend] = asyncio.run(_measure(url, args))

    print(f"# {common.machine()}; preload {args.preload}, concurrency {args.concurrency}")
    print(f"# {args.requests} measured requests per client after {args.warmup} warm-up")
    print(f"{'backend':<11} {'sequence/call':<16} {'p50 ms':>8} {'p99 ms':>8} {'mean ms':>8}")
    order = ["stored response", "put_response", "get_response", "job", "create_job",
             "claim_job", "renew_lease", "finish_job", "get_job"]  # fmt: skip
    for name in order:
        for backend, samples in results.items():
            print(_row(backend, name, samples[name]))
    if args.json:
        summary = {
            backend: {
                name: {
                    "p50_ms": common.pct(sorted(xs), 50) * 1e3,
                    "p99_ms": common.pct(sorted(xs), 99) * 1e3,
                    "mean_ms": statistics.fmean(xs) * 1e3,
                }
                for name, xs in samples.items()
            }
            for backend, samples in results.items()
        }
        common.write_json(args.json, args, {"results": summary})


if __name__ == "__main__":
    main()
