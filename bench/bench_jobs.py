"""Jobs: what the job machinery and the store cost, through a real head and the openai SDK.

Three parts, each beside the floor it is measured against, in the same run:

- **video**: the built-in ``video`` pipeline on the tiny random Wan of tests/video_tiny.py.
  The floor: the same videos made one after another by the ``video`` engine in this
  process (before and after the served part, to bracket drift). Served: ``--videos`` jobs
  created at once with ``client.videos.create``, then polled (``videos.list``, one call per
  ``--poll-ms``) until all are completed. jobs/min served over videos/min in process is
  what the job machinery (HTTP, store, runner, head, replica, media store) leaves of the
  engine's rate.
- **background**: ``--responses`` Responses API requests on ``echo-1stage``, made
  synchronously (``store: true``) by ``--concurrency`` clients, then as many with
  ``background: true`` created by as many clients and polled (``responses.retrieve``)
  until completed: jobs/min over req/min.
- **latency**: ``POST /v1/responses`` on ``echo-1stage`` at concurrency 1 with ``store:
  false`` (the floor), ``store: true``, and ``store: true`` continuing a stored response
  (``previous_response_id``, one turn back), in interleaved blocks, on a head with SQLite
  and on a head with PostgreSQL (a server of its own from tests/postgres.py, default
  durability): p50/p99 and the ms the store adds to each.

Per job, from the store's own rows (SQLite, read after the run) and the client's clock:
time queued (claimed - create sent) and running (completed - claimed), p50/p90, and the
gap between one completion and the next. A head claims jobs while the stage has room
(the replicas' ``max_inflight_per_replica``), so a claimed job may still wait in the
replica's queue: "running" includes that wait. And CPU time per job of the head, the
replicas and the clients (steadier than rates on a shared machine), with the polls'
share taken out: the head's CPU per poll request is measured alone after the run.
"""

import argparse
import asyncio
import itertools
import json
import sqlite3
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import common
import openai
from bench_head_cpu import cpu_seconds, descendants
from common import HOST, ServerProcess, free_port

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # for tests.*
from tests.postgres import PostgresMissingError, postgres_database
from tests.video_tiny import build_tiny_video_pipeline

# The SDK marks its video methods deprecated (OpenAI's own service is closing); the API
# they speak is what the head serves.
warnings.filterwarnings("ignore", message="The Sora API", category=DeprecationWarning)

FINAL = ("completed", "failed", "cancelled")
PROMPT = "a red ball bouncing on a wooden floor"
TEXT = "tell me about the store"


# -- helpers ---------------------------------------------------------------------------


@contextmanager
def head(
    name: str, pipeline: str, work: Path, store_url: str, timeout: float, *extra: str
) -> Iterator[ServerProcess]:
    """``omnistage serve PIPELINE`` on a free port with the given store, media in ``work``;
    stopped however the block ends."""
    port = free_port()
    media = str(work / f"media-{name}")
    serve = ["serve", pipeline, "--port", str(port), "--store-url", store_url, "--media-url", media]
    server = ServerProcess(name, [sys.executable, "-m", "omnistage", *serve, *extra], port)
    try:
        server.wait_ready(timeout)
        yield server
    except Exception:
        print(f"! {name}: the head's log ends with:{server.log_tail()}")
        raise
    finally:
        server.stop()


def sdk(server: ServerProcess, timeout: float) -> openai.OpenAI:
    url = f"http://{HOST}:{server.port}/v1"
    return openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=timeout)


def ms(xs: list[float], p: float) -> float:
    return common.pct(sorted(xs), p) * 1e3


def spread(xs: list[float]) -> dict[str, float]:
    """p50/p90 in ms."""
    return {"p50_ms": ms(xs, 50), "p90_ms": ms(xs, 90)} if xs else {}


def in_threads(n: int, calls: list[Callable[[], Any]]) -> list[Any]:
    """Run ``calls`` on ``n`` threads; their results in order (the first error raises)."""
    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(lambda call: call(), calls))


Sweep = Callable[[set[str]], tuple[dict[str, str], int]]


def poll(
    ids: list[str], sweep: Sweep, every_s: float, timeout: float
) -> tuple[dict[str, dict[str, Any]], int]:
    """Until every id is final: ``sweep(pending)`` gives the statuses it saw and how many
    requests it took. Per id, the time.time() at which it was first seen final, and its
    final status; and the requests made."""
    seen: dict[str, dict[str, Any]] = {i: {} for i in ids}
    pending, deadline, requests = set(ids), time.monotonic() + timeout, 0
    while pending:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(pending)} job(s) not finished after {timeout:.0f}s")
        statuses, made = sweep(pending)
        requests += made
        now = time.time()
        for job_id, status in statuses.items():
            if status in FINAL and job_id in pending:
                seen[job_id].update(done=now, status=status)
                pending.discard(job_id)
        if pending:
            time.sleep(every_s)
    return seen, requests


class CpuMeter:
    """CPU seconds spent, from ``start()`` to ``stop()``, by the head, by its descendants
    (the replicas) and by this process (the clients): figures that move much less than
    rates when the machine is shared."""

    def __init__(self, server: ServerProcess) -> None:
        self.pid = server.pid

    def _now(self) -> tuple[float, float, float]:
        kids = sum(cpu_seconds(k) for k in descendants(self.pid))
        return cpu_seconds(self.pid), kids, time.process_time()

    def start(self) -> None:
        self.started = self._now()

    def stop(self, per: int) -> dict[str, float]:
        """ms per item (``per`` items) of each."""
        spent = [(b - a) * 1e3 / per for a, b in zip(self.started, self._now(), strict=True)]
        return dict(zip(("head_ms", "replicas_ms", "client_ms"), spent, strict=True))


def poll_cost(server: ServerProcess, calls: list[Callable[[], Any]], c: int) -> float:
    """The head's CPU ms per poll request, measured alone (after the run)."""
    cpu = CpuMeter(server)
    cpu.start()
    in_threads(c, calls)
    return cpu.stop(len(calls))["head_ms"]


def add_polls(out: dict[str, Any], polls: int, head_ms_per_poll: float) -> None:
    """Poll requests per job, and the head's CPU per job less what the polls took."""
    per_job = polls / out["jobs"]
    out["polls_per_job"] = per_job
    out["head_ms_per_poll"] = head_ms_per_poll
    out["head_ms_per_job_less_polls"] = out["cpu_per_job"]["head_ms"] - per_job * head_ms_per_poll


def job_rows(db: Path, ids: list[str]) -> dict[str, dict[str, float]]:
    """The store's times of these jobs (read-only; SQLite's WAL lets a reader in)."""
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        marks = ",".join("?" * len(ids))
        rows = conn.execute(
            f"SELECT id, created_at, started_at, completed_at, attempts FROM jobs "
            f"WHERE id IN ({marks})",
            ids,
        ).fetchall()
    return {
        r[0]: {"created": r[1], "started": r[2], "completed": r[3], "attempts": r[4]} for r in rows
    }


def job_figures(
    ids: list[str], created: dict[str, float], seen: dict[str, dict[str, float]], rows: dict
) -> dict[str, Any]:
    """jobs/min as the client saw it (first create sent to last completion polled) and as
    the store has it (to the last completed_at); per job queued / running / total; and
    the gaps between one completion and the next (the time per job in a steady stream,
    free of the start of the run)."""
    first = min(created.values())
    failed = [i for i in ids if seen[i].get("status") != "completed"]
    last_seen = max(s["done"] for s in seen.values())
    last_done = max(rows[i]["completed"] for i in ids)
    queued = [rows[i]["started"] - created[i] for i in ids]
    running = [rows[i]["completed"] - rows[i]["started"] for i in ids]
    total = [seen[i]["done"] - created[i] for i in ids]
    ends = sorted(rows[i]["completed"] for i in ids)
    gaps = [b - a for a, b in itertools.pairwise(ends)]
    return {
        "jobs": len(ids),
        "failed": len(failed),
        "reruns": sum(rows[i]["attempts"] > 1 for i in ids),
        "jobs_per_min_client": 60 * len(ids) / (last_seen - first),
        "jobs_per_min_store": 60 * len(ids) / (last_done - first),
        "makespan_s": last_done - first,
        "queued": spread(queued),
        "running": spread(running),
        "create_to_seen_done": spread(total),
        "gap_between_completions": spread(gaps),
    }


# -- video -----------------------------------------------------------------------------


def video_engine_args(model: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The video stage's engine_args, in process and served alike."""
    out: dict[str, Any] = {"model": str(model), "warmup": False}
    if args.video_torch_threads:
        out["torch_threads"] = args.video_torch_threads
    return out


def video_in_process(model: Path, args: argparse.Namespace, seeds: range) -> dict[str, float]:
    """The same videos made one after another by the video engine in this process (the
    stage's engine_args as served: the model, no warm-up run): p50 seconds per video,
    and CPU ms per video (this process: the engine's threads)."""
    from omnistage.config.schema import StageConfig
    from omnistage.engines.base import EngineRequest
    from omnistage.engines.video.engine import VideoEngine
    from omnistage.protocol.messages import Prompt
    from omnistage.protocol.params import StageParams, VideoParams

    async def nothing() -> Any:
        return
        yield

    async def make(engine: VideoEngine, seed: int) -> None:
        params = VideoParams(
            size=args.video_size,
            seconds=args.video_seconds,
            fps=args.video_fps,
            num_inference_steps=args.video_steps,
            seed=seed,
            progress=True,
        )
        request = EngineRequest(
            f"direct-{seed}", Prompt(text=PROMPT), StageParams(video=params), nothing()
        )
        chunks = [c async for c in engine.generate(request)]
        if not (chunks and chunks[-1].finished and chunks[-1].data):
            raise RuntimeError("the engine made no video")

    async def run() -> dict[str, float]:
        stage = StageConfig(
            stage_id=0,
            name="video",
            engine="video",
            output_modality="video",
            final_output=True,
            engine_args=video_engine_args(model, args),
        )
        engine = VideoEngine(stage)
        await engine.start()
        try:
            for seed in range(10_000, 10_000 + args.video_warmup):
                await make(engine, seed)
            times, cpu = [], time.process_time()
            for seed in seeds:
                started = time.perf_counter()
                await make(engine, seed)
                times.append(time.perf_counter() - started)
            cpu_ms = (time.process_time() - cpu) * 1e3 / len(seeds)
        finally:
            await engine.shutdown()
        return {"s_per_video": statistics.median(times), "cpu_ms": cpu_ms}

    return asyncio.run(run())


def video_served(model: Path, work: Path, args: argparse.Namespace, seeds: range) -> dict:
    overrides = json.dumps({"0": {"engine_args": video_engine_args(model, args)}})
    db = work / "video.db"
    with head(
        "video",
        "video",
        work,
        f"sqlite:///{db}",
        args.health_timeout,
        "--stage-overrides",
        overrides,
    ) as server:
        client = sdk(server, args.request_timeout)
        fields = {"model": "video", "size": args.video_size, "seconds": f"{args.video_seconds:g}"}

        def create(seed: int) -> tuple[str, float]:
            extra = {"fps": args.video_fps, "steps": args.video_steps, "seed": seed}
            sent = time.time()
            return client.videos.create(prompt=PROMPT, **fields, extra_body=extra).id, sent

        def sweep(pending: set[str]) -> tuple[dict[str, str], int]:
            out: dict[str, str] = {}
            page, pages = client.videos.list(limit=100), 1
            while True:  # newest first: the pending ones are on the first pages
                out.update({v.id: v.status for v in page.data})
                if not page.has_more or pending <= out.keys():
                    return out, pages
                page, pages = client.videos.list(limit=100, after=page.data[-1].id), pages + 1

        warm = [create(seed)[0] for seed in range(10_000, 10_000 + args.video_warmup)]
        poll(warm, sweep, args.poll_ms / 1e3, args.request_timeout)
        cpu = CpuMeter(server)
        cpu.start()
        made = in_threads(min(len(seeds), 16), [lambda s=s: create(s) for s in seeds])
        ids, created = [i for i, _ in made], dict(made)
        seen, polls = poll(ids, sweep, args.poll_ms / 1e3, args.request_timeout)
        out = job_figures(ids, created, seen, job_rows(db, ids))
        out["cpu_per_job"] = cpu.stop(len(ids))
        lists = [lambda: client.videos.list(limit=100)] * args.poll_probe
        add_polls(out, polls, poll_cost(server, lists, 1))
    return out


def run_video(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """In process, served, in process again: the served rate against the mean of both."""
    model = build_tiny_video_pipeline(work / "tiny-wan")
    seeds = range(1000, 1000 + args.videos)
    before = video_in_process(model, args, seeds)
    served = video_served(model, work, args, seeds)
    after = video_in_process(model, args, seeds)
    direct_s = (before["s_per_video"] + after["s_per_video"]) / 2
    served["in_process"] = {
        "before": before,
        "after": after,
        "s_per_video": direct_s,
        "videos_per_min": 60 / direct_s,
    }
    served["served_over_in_process"] = served["jobs_per_min_store"] * direct_s / 60
    # In a steady stream (the run's start left out): a video per completion gap.
    served["steady_over_in_process"] = direct_s / (
        served["gap_between_completions"]["p50_ms"] / 1e3
    )
    return served


# -- background responses --------------------------------------------------------------


def run_background(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    db = work / "background.db"
    n, c = args.responses, args.concurrency
    with head("background", "echo-1stage", work, f"sqlite:///{db}", args.health_timeout) as server:
        client = sdk(server, args.request_timeout)
        model = client.models.list().data[0].id

        def sync(_: int = 0) -> float:
            started = time.perf_counter()
            out = client.responses.create(model=model, input=TEXT, store=True)
            if out.status != "completed" or not out.output_text:
                raise RuntimeError(f"not completed: {out.status}")
            return time.perf_counter() - started

        def create(_: int = 0) -> tuple[str, float]:
            sent = time.time()
            out = client.responses.create(model=model, input=TEXT, background=True)
            return out.id, sent

        def sweep(pending: set[str]) -> tuple[dict[str, str], int]:
            ids = list(pending)
            got = in_threads(c, [lambda i=i: client.responses.retrieve(i).status for i in ids])
            return dict(zip(ids, got, strict=True)), len(ids)

        in_threads(c, [sync] * args.warmup)
        warm = in_threads(c, [create] * args.warmup)
        poll([i for i, _ in warm], sweep, args.poll_ms / 1e3, args.request_timeout)
        cpu = CpuMeter(server)
        cpu.start()
        started = time.perf_counter()
        latencies = in_threads(c, [sync] * n)
        sync_wall = time.perf_counter() - started
        sync_cpu = cpu.stop(n)
        cpu.start()
        made = in_threads(c, [create] * n)
        ids, created = [i for i, _ in made], dict(made)
        seen, polls = poll(ids, sweep, args.poll_ms / 1e3, args.request_timeout)
        out = job_figures(ids, created, seen, job_rows(db, ids))
        out["cpu_per_job"] = cpu.stop(n)
        gets = [lambda i=i: client.responses.retrieve(i) for i in ids[: args.poll_probe]]
        add_polls(out, polls, poll_cost(server, gets, c))
    out["sync"] = {
        "requests": n,
        "req_per_min": 60 * n / sync_wall,
        **spread(latencies),
        "cpu_per_request": sync_cpu,
    }
    out["background_over_sync"] = out["jobs_per_min_store"] / out["sync"]["req_per_min"]
    return out


# -- the store's added latency ---------------------------------------------------------

VARIANTS = ("store: false", "store: true", "previous_response_id")


def latency_on(
    backend: str, store_url: str, work: Path, args: argparse.Namespace
) -> dict[str, list[float]]:
    """Seconds per request of each variant, at concurrency 1, blocks of ``--block`` in
    turn so that drift over the run hits every variant alike."""
    with head(backend, "echo-1stage", work, store_url, args.health_timeout) as server:
        client = sdk(server, args.request_timeout)
        model = client.models.list().data[0].id
        base = client.responses.create(model=model, input=TEXT, store=True).id
        kwargs: dict[str, dict[str, Any]] = {
            "store: false": {"store": False},
            "store: true": {"store": True},
            "previous_response_id": {"store": True, "previous_response_id": base},
        }
        samples: dict[str, list[float]] = {v: [] for v in VARIANTS}
        for v in VARIANTS:  # warm-up, thrown away
            for _ in range(args.latency_warmup):
                client.responses.create(model=model, input=TEXT, **kwargs[v])
        while len(samples[VARIANTS[-1]]) < args.latency_requests:
            for v in VARIANTS:
                for _ in range(min(args.block, args.latency_requests - len(samples[v]))):
                    started = time.perf_counter()
                    out = client.responses.create(model=model, input=TEXT, **kwargs[v])
                    samples[v].append(time.perf_counter() - started)
                    if out.status != "completed":
                        raise RuntimeError(f"{v}: {out.status}")
    return samples


def latency_figures(samples: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    floor = ms(samples["store: false"], 50), ms(samples["store: false"], 99)
    return {
        v: {
            "p50_ms": ms(xs, 50),
            "p99_ms": ms(xs, 99),
            "added_p50_ms": ms(xs, 50) - floor[0],
            "added_p99_ms": ms(xs, 99) - floor[1],
        }
        for v, xs in samples.items()
    }


def run_latency(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """SQLite, then PostgreSQL (skipped, said so, where its server is not installed)."""
    sqlite_url = f"sqlite:///{work}/latency.db"
    out = {"sqlite": latency_figures(latency_on("sqlite", sqlite_url, work, args))}
    try:
        with postgres_database(durable=True) as pg_url:
            out["postgresql"] = latency_figures(latency_on("postgresql", pg_url, work, args))
    except PostgresMissingError as exc:
        print(f"! postgresql skipped: {exc}")
    return out


# -- report ----------------------------------------------------------------------------


def fmt(r: dict[str, float]) -> str:
    return f"{r['p50_ms']:.0f}/{r['p90_ms']:.0f}"


def cpu_line(what: str, cpu: dict[str, float]) -> str:
    return (
        f"{what}: head {cpu['head_ms']:.1f}, replicas {cpu['replicas_ms']:.1f}, "
        f"clients {cpu['client_ms']:.1f}"
    )


def print_jobs(name: str, r: dict[str, Any]) -> None:
    print(
        f"  {name}: {r['jobs']} jobs, {r['failed']} failed, {r['reruns']} re-run; jobs/min "
        f"{r['jobs_per_min_store']:.0f} (to the store's last completed_at), "
        f"{r['jobs_per_min_client']:.0f} (as polled)"
    )
    print(
        f"    per job, ms p50/p90: queued {fmt(r['queued'])}, running {fmt(r['running'])}, "
        f"create to seen done {fmt(r['create_to_seen_done'])}; between completions "
        f"{fmt(r['gap_between_completions'])}"
    )
    print(f"    {cpu_line('CPU ms per job', r['cpu_per_job'])}")
    print(
        f"    polls per job {r['polls_per_job']:.1f} at {r['head_ms_per_poll']:.2f} ms of head "
        f"CPU each: head CPU per job less polls {r['head_ms_per_job_less_polls']:.1f} ms"
    )


def print_video(args: argparse.Namespace, v: dict[str, Any]) -> None:
    d = v["in_process"]
    print(
        f"video: {args.videos} x {args.video_size}, {args.video_seconds:g} s at "
        f"{args.video_fps} fps, {args.video_steps} steps; polled every {args.poll_ms:g} ms"
    )
    print(
        f"  in process: {d['s_per_video'] * 1e3:.0f} ms/video p50 (before "
        f"{d['before']['s_per_video'] * 1e3:.0f}, after {d['after']['s_per_video'] * 1e3:.0f}):"
        f" {d['videos_per_min']:.0f} videos/min; CPU {d['before']['cpu_ms']:.0f}/"
        f"{d['after']['cpu_ms']:.0f} ms per video"
    )
    print_jobs("served", v)
    print(
        f"  served / in process: {v['served_over_in_process']:.2f}x over the run, "
        f"{v['steady_over_in_process']:.2f}x steady (p50 gap between completions)"
    )


def print_background(args: argparse.Namespace, b: dict[str, Any]) -> None:
    s = b["sync"]
    print(
        f"background responses on echo-1stage: {args.responses} at concurrency "
        f"{args.concurrency}, polled every {args.poll_ms:g} ms"
    )
    print(
        f"  synchronous (store: true): {s['req_per_min']:.0f} req/min, p50/p90 "
        f"{s['p50_ms']:.1f}/{s['p90_ms']:.1f} ms"
    )
    print(f"    {cpu_line('CPU ms per request', s['cpu_per_request'])}")
    print_jobs("background", b)
    print(f"  background / synchronous: {b['background_over_sync']:.2f}x")


def print_latency(args: argparse.Namespace, rows: dict[str, Any]) -> None:
    print(
        f"store latency: POST /v1/responses on echo-1stage, concurrency 1, "
        f"{args.latency_requests} per variant; + is over store: false"
    )
    print(f"  {'backend':<11} {'variant':<21} {'p50 ms':>7} {'p99 ms':>7} {'+p50':>6} {'+p99':>6}")
    for backend, variants in rows.items():
        for v, r in variants.items():
            print(
                f"  {backend:<11} {v:<21} {r['p50_ms']:>7.2f} {r['p99_ms']:>7.2f} "
                f"{r['added_p50_ms']:>6.2f} {r['added_p99_ms']:>6.2f}"
            )


def loadavg() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


PARTS = {
    "video": (run_video, print_video),
    "background": (run_background, print_background),
    "latency": (run_latency, print_latency),
}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--parts", default="video,background,latency", help="which, comma-separated")
    p.add_argument("--videos", type=int, default=20, help="video jobs created at once")
    p.add_argument("--video-size", default="32x32")
    p.add_argument("--video-seconds", type=float, default=1.0)
    p.add_argument("--video-fps", type=int, default=4)
    p.add_argument("--video-steps", type=int, default=4)
    p.add_argument(
        "--video-torch-threads",
        type=int,
        default=None,
        help="the video engine's torch_threads (default: its own, all the cores)",
    )
    p.add_argument("--video-warmup", type=int, default=2, help="videos before measuring")
    p.add_argument("--responses", type=int, default=400, help="background (and sync) requests")
    p.add_argument("--concurrency", type=int, default=8, help="clients, background and sync")
    p.add_argument("--warmup", type=int, default=20, help="requests before the background part")
    p.add_argument("--poll-ms", type=float, default=50.0, help="pause between polls of jobs")
    p.add_argument(
        "--poll-probe", type=int, default=100, help="polls timed alone for their head CPU"
    )
    p.add_argument("--latency-requests", type=int, default=400, help="per variant and backend")
    p.add_argument("--latency-warmup", type=int, default=30)
    p.add_argument("--block", type=int, default=25, help="requests per variant in turn")
    common.add_common_args(p, health_timeout=180.0, request_timeout=120.0)
    args = p.parse_args()
    parts = args.parts.split(",")
    if unknown := set(parts) - PARTS.keys():
        p.error(f"--parts: unknown {sorted(unknown)}; known: {', '.join(PARTS)}")
    common.exit_on_sigterm()
    print(f"# {common.machine()}; load average before: {loadavg()}", flush=True)
    results: dict[str, Any] = {}
    failed: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        for part in parts:
            run, show = PARTS[part]
            started = time.monotonic()
            try:
                results[part] = run(args, Path(tmp))
            except Exception as exc:
                print(f"! {part} FAILED: {common.describe(exc, args.request_timeout)}")
                failed.append(part)
                continue
            show(args, results[part])
            print(f"  ({time.monotonic() - started:.0f} s; load average {loadavg()})", flush=True)
            if results[part].get("failed"):  # jobs that ended failed or cancelled
                failed.append(part)
    if args.json:
        common.write_json(args.json, args, {"results": results})
    if failed:
        print(f"! failed: {', '.join(failed)} (a part that did not run, or failed jobs)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
