"""Side-by-side benchmark: omnistage's 3-stage echo pipeline vs the same pipeline on Ray Serve.

One server at a time ("omnistage echo", then "ray-serve echo"), the same closed-loop keep-alive
load as bench_pipeline.py at concurrency 1 and 32; prints req/s, p50/p99 of each and
omnistage's req/s as a multiple of Ray Serve's. See README.md.

Ray lives in its own virtualenv (.venv-ray), not the project's: the driver runs under the
project's Python and starts the Ray app as ``.venv-ray/bin/python bench_ray_serve.py
--serve-ray PORT``, so every Ray import stays inside ``serve_ray``.
"""

import argparse
import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field
from typing import Any

import common
from bench_pipeline import PATH, Result, Target, load, request_body
from common import HOST, ServerProcess, free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RAY_VENV = os.path.join(ROOT, ".venv-ray")
CONCURRENCIES = (1, 32)
# Both servers get the omnistage pipeline's name as "model": the head checks it (Ray's ingress
# only echoes it back). Both must answer bench_pipeline's prompt ("hello") with the same text.
ECHO = Target("echo", 3, b'"content":"hello [thinker] [talker] [vocoder]"')
# Each Ray Serve replica takes this many requests at once. Ray's default (5) would queue the
# c=32 load in its router, a limit omnistage has no counterpart of; 64 keeps it out of the way.
RAY_MAX_ONGOING = 64
# Settling: after it answers, a server is loaded only once its processes use less than
# SETTLE_CPU of a core in SETTLE_WINDOWS windows of SETTLE_WINDOW_S in a row (Ray's own
# processes keep both cores busy for a few seconds after start), or after --settle-timeout.
SETTLE_CPU = 0.25
SETTLE_WINDOW_S = 1.0
SETTLE_WINDOWS = 2
STOP_GRACE_S = 15.0  # from SIGTERM to SIGKILL, as ServerProcess.stop
DRAIN_S = 5.0  # for the rest of the session to follow a server that has exited
CLK_TCK = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Server:
    label: str  # the row's name in the table
    key: str  # --only picks by this


SERVERS = (Server("omnistage echo", "omnistage"), Server("ray-serve echo", "ray-serve"))


@dataclass
class Run:
    server: str
    idle_cpu_pct: float | None = None  # the server's processes at rest, just before the load
    settle_s: float | None = None  # from answering to settled
    results: list[Result] = field(default_factory=list)
    # Per concurrency: CPU time of all the server's processes over the measured requests,
    # per request and in cores (a figure far less noisy than req/s on a shared machine).
    server_ms_per_request: dict[int, float] = field(default_factory=dict)
    server_cores: dict[int, float] = field(default_factory=dict)


# -- the Ray Serve app (runs in a subprocess under .venv-ray: this file with --serve-ray) ---


def serve_ray(port: int, stream_thinker: bool) -> None:
    """The echo pipeline as Ray Serve deployments, on HOST:port until SIGTERM.

    Thinker, Talker and Vocoder are three deployments (one replica each) that append
    " [name]" to their input, as omnistage's echo engine does; an Ingress deployment takes
    the OpenAI chat body and chains them with DeploymentHandles (Ray Serve's model
    composition). With ``stream_thinker`` the thinker yields its output in 4 chunks, as the
    echo config's thinker does, over a streaming handle; Ray Serve cannot feed a stream into
    another deployment, so the ingress joins them before the talker.
    """
    import logging

    import msgspec
    import ray
    from ray import serve
    from ray.serve.handle import DeploymentHandle, DeploymentResponse
    from starlette.requests import Request
    from starlette.responses import Response

    # num_cpus=0: Ray would otherwise reserve a whole (logical) CPU per replica, and four
    # replicas do not fit on this 2-core machine; the work is trivial either way.
    options: dict[str, Any] = {
        "num_replicas": 1,
        "max_ongoing_requests": RAY_MAX_ONGOING,
        "ray_actor_options": {"num_cpus": 0},
    }

    @serve.deployment(**options)
    class Stage:
        def __init__(self, name: str, num_chunks: int = 1) -> None:
            self.suffix, self.num_chunks = f" [{name}]", num_chunks

        async def __call__(self, text: str) -> str:
            return text + self.suffix

        async def stream(self, text: str) -> AsyncIterator[str]:
            for piece in split_even(text + self.suffix, self.num_chunks):
                yield piece

    @serve.deployment(**options)
    class Ingress:
        def __init__(
            self,
            thinker: DeploymentHandle,
            talker: DeploymentHandle,
            vocoder: DeploymentHandle,
            stream_thinker: bool,
        ) -> None:
            self.talker, self.vocoder = talker, vocoder
            self.thinker = thinker.options(method_name="stream", stream=True)
            self.thinker_unary, self.stream_thinker = thinker, stream_thinker
            self.decoder, self.encoder = msgspec.json.Decoder(), msgspec.json.Encoder()
            self.count = 0

        async def __call__(self, request: Request) -> Response:
            if request.method != "POST" or request.url.path != PATH:
                return Response(status_code=404)
            body = self.decoder.decode(await request.body())
            prompt = ""  # the last user message, as the echo engine reads it
            for m in reversed(body.get("messages") or []):
                if m.get("role") == "user":
                    prompt = m.get("content") or ""
                    break
            thought: str | DeploymentResponse
            if self.stream_thinker:
                thought = "".join([piece async for piece in self.thinker.remote(prompt)])
            else:
                # A DeploymentResponse passed on: Ray hands its result to the talker.
                thought = self.thinker_unary.remote(prompt)
            text: str = await self.vocoder.remote(self.talker.remote(thought))
            self.count += 1
            words_in, words_out = len(prompt.split()), len(text.split())
            reply = {
                "id": f"chatcmpl-{os.getpid():x}{self.count:024x}",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": body.get("model") or "echo",
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": text},
                        "finish_reason": "stop",
                        "logprobs": None,
                    }
                ],
                "usage": {
                    "prompt_tokens": words_in,
                    "completion_tokens": words_out,
                    "total_tokens": words_in + words_out,
                },
            }
            return Response(self.encoder.encode(reply), media_type="application/json")

    thinker = Stage.options(name="Thinker").bind("thinker", 4)
    talker = Stage.options(name="Talker").bind("talker")
    vocoder = Stage.options(name="Vocoder").bind("vocoder")
    app = Ingress.bind(thinker, talker, vocoder, stream_thinker)

    # Ray would try to report usage statistics to its makers: nothing to do with a benchmark.
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # SIGTERM unwinds to the finally below, so that Serve and Ray shut down in order (ray.init
    # puts in a handler that does the same; this one covers a SIGTERM before it).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    # Loopback address, no dashboard (Ray's core gRPC servers still listen on all interfaces:
    # nothing in Ray's options changes that). The object store is barely used (small strings
    # travel inline): a small one spares memory on the shared machine. Ray runs its workers
    # (the replicas) at nice 15 by default; 0 puts them on an equal footing with the omnistage
    # processes, the load generator and whatever else shares the 2 cores.
    ray.init(
        include_dashboard=False,
        _node_ip_address=HOST,
        object_store_memory=100 * 1024 * 1024,
        logging_level=logging.WARNING,
        _system_config={"worker_niceness": 0},
    )
    try:
        # Like the omnistage head: warnings only, no access log.
        quiet = {"log_level": "WARNING", "enable_access_log": False}
        serve.start(http_options={"host": HOST, "port": port}, logging_config=quiet)
        serve.run(app, name="echo", route_prefix="/", logging_config=quiet)
        print(f"ray serve echo app on http://{HOST}:{port}{PATH}", flush=True)
        while True:
            time.sleep(3600)
    finally:
        with contextlib.suppress(Exception):
            serve.shutdown()
        ray.shutdown()


def split_even(text: str, parts: int) -> list[str]:
    """As omnistage.engines.echo.split_even (copied: the Ray venv has no omnistage)."""
    if not text:
        return [""]
    parts = max(1, min(parts, len(text)))
    size, extra = divmod(len(text), parts)
    out, start = [], 0
    for i in range(parts):
        end = start + size + (1 if i < extra else 0)
        out.append(text[start:end])
        start = end
    return out


# -- server processes ---------------------------------------------------------------------


def start_server(server: Server, port: int, args: argparse.Namespace) -> ServerProcess:
    if server.key == "omnistage":
        cmd = [sys.executable, "-m", "omnistage", "serve", ECHO.name]
        cmd += ["--host", HOST, "--port", str(port), "--log-level", "WARNING"]
    else:
        if not os.path.exists(args.ray_python):
            raise RuntimeError(
                f"no {args.ray_python} (to make one: python3 -m venv {RAY_VENV} && "
                f'{RAY_VENV}/bin/pip install "ray[serve]" msgspec)'
            )
        cmd = [args.ray_python, os.path.abspath(__file__), "--serve-ray", str(port)]
        if args.ray_stream_thinker:
            cmd.append("--ray-stream-thinker")
    return ServerProcess(server.label, cmd, port)


def session_stats(sid: int) -> list[tuple[int, str, float]]:
    """(pid, name, CPU seconds) of every live process of session ``sid``.

    A server runs in a session of its own (ServerProcess starts it with start_new_session)
    and all it starts stays in it: Ray's actors get process groups of their own, and its
    agents, re-parented to init, outlive the raylet, but none of them leaves the session.
    """
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                name, _, rest = f.read().partition(b" (")[2].rpartition(b")")
        except OSError:  # gone meanwhile
            continue
        # After the name: state ppid pgrp session ... utime(11) stime(12), in clock ticks.
        fields = rest.split()
        if int(fields[3]) == sid and fields[0] != b"Z":
            cpu = (int(fields[11]) + int(fields[12])) / CLK_TCK
            out.append((int(entry), name.decode(errors="replace"), cpu))
    return out


def session_cpu(sid: int) -> float:
    return sum(cpu for *_, cpu in session_stats(sid))


def settle(proc: ServerProcess, timeout: float) -> tuple[float, float]:
    """Wait until the server's processes are near idle; return (their CPU use in cores over
    the last window, seconds waited).

    Ray's processes are still starting up when its app first answers; loading it then would
    charge that to Ray. Ray at rest uses ~10% of a core (omnistage ~0), hence the threshold
    (SETTLE_CPU) above that, held for SETTLE_WINDOWS windows in a row because start-up comes
    in bursts with lulls between them.
    """
    start = time.monotonic()
    prev, quiet = (session_cpu(proc.pid), start), 0
    while True:
        time.sleep(SETTLE_WINDOW_S)
        now = (session_cpu(proc.pid), time.monotonic())
        used = (now[0] - prev[0]) / (now[1] - prev[1])
        quiet = quiet + 1 if used < SETTLE_CPU else 0
        if quiet >= SETTLE_WINDOWS or now[1] - start >= timeout:
            return used, now[1] - start
        prev = now


def stop_server(proc: ServerProcess) -> None:
    """As ServerProcess.stop (SIGTERM, SIGKILL to the group after STOP_GRACE_S), then, after
    DRAIN_S for what it started to follow it, SIGKILL by pid to what is left of its session:
    Ray's actors run in process groups of their own."""
    sid = proc.pid
    if proc.alive():
        proc.proc.send_signal(signal.SIGTERM)
        try:
            proc.proc.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            print(f"! {proc.name}: no exit {STOP_GRACE_S:.0f}s after SIGTERM, killing")
            with contextlib.suppress(ProcessLookupError):
                os.killpg(sid, signal.SIGKILL)
            proc.proc.wait(5.0)
    # Ray's actors exit a few seconds after their raylet; its agents not at all.
    deadline = time.monotonic() + DRAIN_S
    while session_stats(sid) and time.monotonic() < deadline:
        time.sleep(0.2)
    kill_session(proc.name, sid)
    # Only the log is left to close: ServerProcess.stop would take the zombies of what was
    # just killed (orphans, until init reaps them) for live processes of the group.
    proc.log.close()


def kill_session(name: str, sid: int) -> None:
    """SIGKILL, by pid, to every process left in session ``sid``."""
    if not (left := session_stats(sid)):
        return
    names = ", ".join(sorted({comm for _, comm, _ in left}))
    print(f"! {name}: {len(left)} processes left in its session ({names}), killing")
    for pid, *_ in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5.0
    while (left := session_stats(sid)) and time.monotonic() < deadline:
        time.sleep(0.1)
    if left:
        # `ray stop --force` would end them too, but it kills every Ray process of the
        # machine by name, whoever started them: left to the user.
        pids = [pid for pid, *_ in left]
        print(f"! {name}: still running: {pids}; see `{RAY_VENV}/bin/ray stop --force`")


# -- driver and report --------------------------------------------------------------------


def bench_server(server: Server, args: argparse.Namespace) -> Run:
    counts = {1: args.requests_c1, 32: args.requests}
    run = Run(server.label, results=[Result(server.label, 3, c, counts[c]) for c in CONCURRENCIES])
    proc = None
    try:
        proc = start_server(server, free_port(), args)
        if server.key == "omnistage":
            proc.wait_ready(args.health_timeout)
        else:
            # Ray Serve has no /health of this app's: ready when the chat route answers.
            proc.wait_ready(args.health_timeout, PATH, request_body(ECHO), interval=0.5)
        idle, run.settle_s = settle(proc, args.settle_timeout)
        run.idle_cpu_pct = idle * 100
        for i, c in enumerate(CONCURRENCIES):
            # Warm-up and measured requests are two load() calls (fresh connections each, as
            # in bench_head_cpu.py) so that the CPU readings bracket the measured ones only.
            if args.warmup > 0:  # load() cannot take 0 requests
                asyncio.run(load(ECHO, proc.port, c, args.warmup, 0, args.request_timeout))
            cpu = session_cpu(proc.pid)
            r = asyncio.run(load(ECHO, proc.port, c, counts[c], 0, args.request_timeout))
            cpu = session_cpu(proc.pid) - cpu
            r.target, run.results[i] = server.label, r
            run.server_ms_per_request[c] = cpu * 1e3 / r.requests
            run.server_cores[c] = cpu * r.rps / r.requests  # over the wall time, n / rps
    except Exception as exc:  # an ExceptionGroup from the load's TaskGroup, too
        error = common.describe(exc, args.request_timeout)
        if proc is not None and "\n" not in error:  # wait_ready's errors hold the log already
            error += proc.log_tail()
        for r in run.results:
            if not r.rps:
                r.error = error
        print(f"! {server.label}: FAILED: {error}", flush=True)
    finally:
        if proc is not None:
            stop_server(proc)
    return run


def ratios(runs: list[Run]) -> dict[int, float | None]:
    """omnistage's req/s over Ray Serve's, per concurrency (None where either failed)."""
    by = {(run.server, r.concurrency): r for run in runs for r in run.results}
    out: dict[int, float | None] = {}
    for c in CONCURRENCIES:
        omni, ray = by.get((SERVERS[0].label, c)), by.get((SERVERS[1].label, c))
        if omni is None or ray is None or omni.error is not None or ray.error is not None:
            out[c] = None
        else:
            out[c] = omni.rps / ray.rps
    return out


def report(runs: list[Run], rel: dict[int, float | None]) -> None:
    """One row per concurrency, the servers side by side, then omnistage's req/s over Ray's."""
    names = "".join(f" | {run.server:^26}" for run in runs)
    cols = f" | {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8}" * len(runs)
    print(f"\n{'':>4}{names} | {'req/s':^11}")
    print(f"{'conc':>4}{cols} | {'omni / ray':^11}")
    for i, c in enumerate(CONCURRENCIES):
        line = f"{c:>4}"
        for run in runs:
            r = run.results[i]
            if r.error is not None:
                line += f" | {'FAILED':^26}"
            else:
                line += f" | {r.rps:>8.0f} {r.p50_ms:>8.3f} {r.p99_ms:>8.3f}"
        x = rel.get(c)
        print(f"{line} | {f'{x:.2f}x' if x is not None else '-':^11}")
    print()
    for run in runs:
        if run.idle_cpu_pct is None:
            continue
        print(
            f"{run.server}: {run.idle_cpu_pct:.0f}% of a core at rest (settled in "
            f"{run.settle_s:.1f}s); under load:"
        )
        for r in run.results:
            if r.error is None:
                c = r.concurrency
                ms, cores = run.server_ms_per_request[c], run.server_cores[c]
                print(
                    f"  c={c:<2} server cpu {ms:.3f} ms/request ({cores:.2f} cores), "
                    f"load generator {r.client_cpu_pct:.0f}% of a core"
                )
    for run in runs:
        for error in {r.error for r in run.results if r.error is not None}:
            print(f"{run.server}: FAILED: {error.splitlines()[0][:300]}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=2000, help="measured requests at c=32")
    p.add_argument("--requests-c1", type=int, default=300, help="measured requests at c=1")
    p.add_argument("--warmup", type=int, default=200, help="warm-up requests per run")
    p.add_argument(
        "--settle-timeout",
        type=float,
        default=30.0,
        help="at most this many seconds for a server to go idle once it answers",
    )
    p.add_argument(
        "--only", choices=[s.key for s in SERVERS], help="run one target only (default: both)"
    )
    p.add_argument(
        "--ray-python",
        default=os.path.join(RAY_VENV, "bin", "python"),
        help="the Python with ray[serve] and msgspec (default: .venv-ray's)",
    )
    p.add_argument(
        "--ray-stream-thinker",
        action="store_true",
        help="the Ray thinker yields 4 chunks over a streaming handle (default: one value)",
    )
    common.add_common_args(p, health_timeout=180.0, request_timeout=10.0)
    p.add_argument("--serve-ray", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve_ray:
        serve_ray(args.serve_ray, args.ray_stream_thinker)
        return 0
    ray_mode = "streamed thinker" if args.ray_stream_thinker else "unary stages"
    print(
        f"{common.machine()}; warm-up {args.warmup}, requests c=1: {args.requests_c1}, "
        f"c=32: {args.requests}; ray-serve: {ray_mode}"
    )
    common.exit_on_sigterm()
    runs = [bench_server(s, args) for s in SERVERS if args.only in (None, s.key)]
    rel = ratios(runs)
    report(runs, rel)
    if args.json:
        floor_only = {"stages", "ratio_to_floor", "added_p50_per_hop_ms"}
        sections = {
            "runs": [
                {
                    **{k: v for k, v in asdict(run).items() if k != "results"},
                    "results": [
                        {k: v for k, v in asdict(r).items() if k not in floor_only}
                        for r in run.results
                    ],
                }
                for run in runs
            ],
            "omnistage_over_ray_serve_rps": {str(c): x for c, x in rel.items()},
        }
        common.write_json(args.json, args, sections, skip=["serve_ray"])
    if failed := sum(r.error is not None for run in runs for r in run.results):
        print(f"! {failed} run(s) FAILED")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
