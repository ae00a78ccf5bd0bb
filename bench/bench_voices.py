"""Eight voices at once: N concurrent voice chats on the default ``voice``
pipeline (SmolLM2 thinker -> Piper talker), streamed chat completions with text and audio.

Starts ``omnistage serve voice`` itself. For each level N of ``--levels``, N clients at
once each send ``--per-client`` streamed ``POST /v1/chat/completions`` one after another
(``modalities: ["text", "audio"]``, pcm16). Streamed chat audio is base64 pcm16, mono,
24 kHz (``omnistage/api/audio_out.py``: every voice is resampled to OpenAI's rate), so a
delta of B bytes plays B / 2 / 24000 s. Per answer:

- **first audio**: from sending the request to the first non-empty audio delta;
- **RTF**: (last audio delta's arrival - first's) / (the answer's audio seconds minus the
  first delta's). A player starts at the first delta and has that delta's audio to play
  while the rest arrives; RTF < 1 means the rest arrived in less time than it plays: the
  answer was produced faster than real time. An answer whose audio came in one delta has
  RTF 0 (nothing was left to wait for);
- **gaps**: a player starts at the first delta's arrival, and each delta extends the time
  its audio ends by its duration; a delta that arrives after that time is a gap (the
  listener heard silence for the difference). Counted, and summed in seconds. RTF < 1 can
  still have gaps (a slow middle made up for by a fast end): both are given.

The head's own split of the time per stage comes from ``/metrics``, scraped before and after
each level: the mean of ``omnistage_stage_{queue_wait,first_output,duration}_seconds``
(``_sum`` / ``_count`` deltas) over the level's requests. See README.md.
"""

import argparse
import asyncio
import base64
import os
import statistics
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from typing import Any

import common
import machine_limits
from bench_models import chat_body, sse_events
from common import HOST, ServerProcess, free_port

RATE = 24000  # streamed chat audio: pcm16 mono at 24 kHz (api/audio_out.py OUTPUT_RATE)
QUESTIONS = (
    "Why is the sky blue?",
    "How do bees make honey?",
    "What causes the seasons on Earth?",
    "How does a rainbow form?",
    "Why do cats purr?",
    "How do airplanes stay in the air?",
    "What makes the ocean salty?",
    "How does a plant grow from a seed?",
)
# The head's per-stage histograms: (short name, family).
STAGE_FAMILIES = (
    ("queue_wait", "omnistage_stage_queue_wait_seconds"),
    ("first_output", "omnistage_stage_first_output_seconds"),
    ("duration", "omnistage_stage_duration_seconds"),
)
# The targets, at TARGET_N clients.
TARGET_N, TARGET_P50_S, TARGET_P90_S = 8, 1.2, 2.0


@dataclass
class Answer:
    """One streamed answer in client time (``time.perf_counter``)."""

    sent: float
    chunks: list[tuple[float, float]] = field(default_factory=list)  # (arrival, audio s)

    @property
    def first_audio_s(self) -> float:
        return self.chunks[0][0] - self.sent

    @property
    def audio_s(self) -> float:
        return sum(d for _, d in self.chunks)

    @property
    def stream_s(self) -> float:
        """From the first audio delta's arrival to the last's."""
        return self.chunks[-1][0] - self.chunks[0][0]

    def rtf(self) -> float:
        rest = self.audio_s - self.chunks[0][1]
        return self.stream_s / rest if rest > 0 else 0.0

    def gaps(self) -> tuple[int, float]:
        """(count, seconds) of deltas that arrived after the audio before them had played."""
        count, total, play_end = 0, 0.0, self.chunks[0][0]
        for t, d in self.chunks:
            if t > play_end:
                count, total, play_end = count + 1, total + t - play_end, t
            play_end += d
        return count, total

    def summary(self) -> dict[str, Any]:
        count, seconds = self.gaps()
        return {
            "first_audio_s": self.first_audio_s,
            "audio_s": self.audio_s,
            "stream_s": self.stream_s,
            "chunks": len(self.chunks),
            "rtf": self.rtf(),
            "gaps": count,
            "gap_s": seconds,
        }


async def ask(port: int, text: str, max_tokens: int, greedy: bool = False) -> Answer:
    body = chat_body(text, max_tokens, audio=True)
    if not greedy:
        # The pipeline's own sampling (temperature 0.7, top-p 0.9), as users get it; a
        # seed per question keeps runs comparable.
        del body["temperature"]
        body["seed"] = sum(map(ord, text))
    answer = Answer(time.perf_counter())
    async for t, ev in sse_events(port, body):
        for choice in ev["choices"]:
            data = (choice["delta"].get("audio") or {}).get("data")
            if data:
                answer.chunks.append((t, len(base64.b64decode(data)) / 2 / RATE))
    if not answer.chunks:
        raise RuntimeError("no audio in the stream")
    return answer


# -- the head's per-stage histograms -----------------------------------------------------

# (short name, stage) -> (sum, count)
Scrape = dict[tuple[str, str], tuple[float, float]]


def scrape(port: int) -> tuple[Scrape, list[str]]:
    """The per-stage histograms' sums and counts, ``omnistage_audio_seconds_total`` per
    stage (as ("audio", stage) -> (seconds, 0)), and the stages in stage_id order."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://{HOST}:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    names = dict(STAGE_FAMILIES)
    short = {family: key for key, family in names.items()}
    out: dict[tuple[str, str], list[float]] = {}
    order: dict[str, int] = {}
    for family in text_string_to_metric_families(text):
        if family.name == "omnistage_audio_seconds":  # the parser drops the _total
            for s in family.samples:
                out[("audio", s.labels.get("stage", "?"))] = [s.value, 0.0]
        if family.name not in short:
            continue
        for s in family.samples:
            stage = s.labels.get("stage", "?")
            order[stage] = int(s.labels.get("stage_id", 0))
            pair = out.setdefault((short[family.name], stage), [0.0, 0.0])
            if s.name.endswith("_sum"):
                pair[0] = s.value
            elif s.name.endswith("_count"):
                pair[1] = s.value
    return {k: (v[0], v[1]) for k, v in out.items()}, sorted(order, key=order.__getitem__)


def stage_means(
    before: Scrape, after: Scrape, stages: list[str]
) -> dict[str, dict[str, float | None]]:
    """Per stage: each histogram's mean over what was observed between the scrapes, and
    the count of dispatches (a stage a request did not reach has none)."""
    out: dict[str, dict[str, float | None]] = {}
    for stage in stages:
        row: dict[str, float | None] = {}
        for key, _ in STAGE_FAMILIES:
            s1, n1 = after.get((key, stage), (0.0, 0.0))
            s0, n0 = before.get((key, stage), (0.0, 0.0))
            row[key] = (s1 - s0) / (n1 - n0) if n1 > n0 else None
            if key == "duration":
                row["dispatches"] = n1 - n0
        out[stage] = row
    return out


# -- a level: N clients at once ----------------------------------------------------------


@dataclass
class Level:
    clients: int
    requests: int
    answers: list[Answer] = field(default_factory=list)
    failed: int = 0
    errors: list[str] = field(default_factory=list)
    wall_s: float = 0.0
    stages: dict[str, dict[str, float | None]] = field(default_factory=dict)
    server_audio_s: float = 0.0  # omnistage_audio_seconds_total's increase over the level

    def row(self) -> dict[str, Any]:
        fa = sorted(a.first_audio_s for a in self.answers)
        rtf = sorted(a.rtf() for a in self.answers)
        gaps = [a.gaps() for a in self.answers]
        return {
            "clients": self.clients,
            "requests": self.requests,
            "done": len(self.answers),
            "failed": self.failed,
            "first_audio_p50_s": common.pct(fa, 50) if fa else None,
            "first_audio_p90_s": common.pct(fa, 90) if fa else None,
            "first_audio_max_s": fa[-1] if fa else None,
            "rtf_median": statistics.median(rtf) if rtf else None,
            "rtf_worst": rtf[-1] if rtf else None,
            "gaps": sum(n for n, _ in gaps),
            "gap_s": sum(s for _, s in gaps),
            "audio_s_mean": statistics.fmean(a.audio_s for a in self.answers)
            if self.answers
            else None,
            "server_audio_s": self.server_audio_s,
            "client_audio_s": sum(a.audio_s for a in self.answers),
            "wall_s": self.wall_s,
        }


async def client(port: int, i: int, args: argparse.Namespace, level: Level) -> None:
    """Client ``i``: ``--per-client`` questions, one after another; failures counted."""
    for j in range(args.per_client):
        text = QUESTIONS[(i * args.per_client + j) % len(QUESTIONS)]
        try:
            async with asyncio.timeout(args.request_timeout):
                level.answers.append(await ask(port, text, args.max_tokens, args.greedy))
        except Exception as exc:
            level.failed += 1
            level.errors.append(common.describe(exc, args.request_timeout))


async def run_level(port: int, n: int, args: argparse.Namespace) -> Level:
    level = Level(n, n * args.per_client)
    before, _ = scrape(port)
    t0 = time.perf_counter()
    async with asyncio.TaskGroup() as tg:
        for i in range(n):
            tg.create_task(client(port, i, args, level))
    level.wall_s = time.perf_counter() - t0
    after, stages = scrape(port)
    level.stages = stage_means(before, after, stages)
    level.server_audio_s = sum(
        v - before.get(k, (0.0, 0.0))[0] for k, (v, _) in after.items() if k[0] == "audio"
    )
    return level


async def measure(server: ServerProcess, args: argparse.Namespace) -> list[Level]:
    assert server.port is not None
    print(f"warm-up: {args.warmup} requests", flush=True)
    for i in range(args.warmup):
        async with asyncio.timeout(args.request_timeout):
            await ask(server.port, QUESTIONS[i % len(QUESTIONS)], args.max_tokens, args.greedy)
    levels = []
    for n in args.levels:
        print(f"{n} clients at once, {args.per_client} requests each", flush=True)
        lv = await run_level(server.port, n, args)
        levels.append(lv)
        if not server.alive():
            raise RuntimeError(f"the server exited ({server.proc.returncode})")
    return levels


# -- report ------------------------------------------------------------------------------


def fmt(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def print_levels(rows: list[dict[str, Any]]) -> None:
    print(
        f"\n{'clients':>7} {'done':>7} {'failed':>6} {'first audio p50':>15} {'p90':>5} "
        f"{'max':>5} {'RTF median':>10} {'worst':>5} {'gaps':>4} {'gap s':>5} "
        f"{'audio s/answer':>14} {'wall s':>6}"
    )
    for r in rows:
        done = f"{r['done']}/{r['requests']}"
        print(
            f"{r['clients']:>7} {done:>7} {r['failed']:>6} "
            f"{fmt(r['first_audio_p50_s']):>13} s {fmt(r['first_audio_p90_s']):>5} "
            f"{fmt(r['first_audio_max_s']):>5} {fmt(r['rtf_median']):>10} "
            f"{fmt(r['rtf_worst']):>5} {r['gaps']:>4} {r['gap_s']:>5.2f} "
            f"{fmt(r['audio_s_mean'], 1):>14} {r['wall_s']:>6.1f}"
        )
    # A check of the 24 kHz decode: the server counts bytes / 2 / its own output rate.
    both = ", ".join(f"{r['client_audio_s']:.1f}/{r['server_audio_s']:.1f}" for r in rows)
    print(f"audio s per level, client/server (omnistage_audio_seconds_total): {both}")


def print_stages(levels: list[Level]) -> None:
    print("\nthe head's split per stage, mean s over each level's requests (/metrics)")
    print(
        f"{'clients':>7} {'stage':<10} {'dispatches':>10} {'queue wait':>10} "
        f"{'first output':>12} {'duration':>8}"
    )
    for lv in levels:
        for stage, m in lv.stages.items():
            if not m["dispatches"]:
                continue  # a stage these requests never reach (the listener)
            print(
                f"{lv.clients:>7} {stage:<10} {m['dispatches']:>10.0f} "
                f"{fmt(m['queue_wait'], 3):>10} {fmt(m['first_output'], 3):>12} "
                f"{fmt(m['duration'], 3):>8}"
            )


def targets(levels: list[Level]) -> list[dict[str, Any]]:
    """The issue's targets at TARGET_N clients, printed PASS, MISS, or n/a (not run)."""
    lv = next((x for x in levels if x.clients == TARGET_N), None)
    r = lv.row() if lv else {}
    complete = bool(lv) and r["failed"] == 0 and r["done"] == r["requests"]
    p50, p90, worst = (r.get(k) for k in ("first_audio_p50_s", "first_audio_p90_s", "rtf_worst"))
    rows = [
        (f"first audio p50, {TARGET_N} clients <= {TARGET_P50_S} s", p50, TARGET_P50_S),
        (f"first audio p90, {TARGET_N} clients <= {TARGET_P90_S} s", p90, TARGET_P90_S),
        (f"every answer's RTF < 1, {TARGET_N} clients (worst)", worst, None),
    ]
    print("\ntargets")
    out = []
    for goal, value, bound in rows:
        if lv is None:
            met = None
        elif value is None:
            met = False
        else:
            met = complete and (value <= bound if bound is not None else value < 1.0)
        verdict = "n/a" if met is None else ("PASS" if met else "MISS")
        print(f"  {goal:<44} {fmt(value):>6}  {verdict}")
        out.append({"goal": goal, "value": value, "met": met})
    if lv is not None and not complete:
        print(f"  (MISS: {r['failed']} of {r['requests']} requests at {TARGET_N} failed)")
    return out


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--levels", default="1,2,4,8", help="clients at once, in order")
    p.add_argument("--per-client", type=int, default=3, help="requests per client per level")
    p.add_argument("--warmup", type=int, default=2, help="warm-up requests, one at a time")
    p.add_argument("--max-tokens", type=int, default=64, help="max_tokens of each request")
    p.add_argument("--serve-args", default="", help="extra arguments for omnistage serve")
    p.add_argument(
        "--greedy", action="store_true", help="temperature 0 (default: the pipeline's sampling)"
    )
    common.add_common_args(p, health_timeout=300.0, request_timeout=120.0)
    args = p.parse_args()
    args.levels = [int(x) for x in args.levels.split(",")]
    return args


def main() -> int:
    args = parse_args()
    common.exit_on_sigterm()  # so that the finally block stops the server
    print(
        f"{common.machine()}; levels {args.levels}, {args.per_client} requests per client, "
        f"max_tokens {args.max_tokens}",
        flush=True,
    )
    # The machine's limits first, on an idle CPU, so that runs on other machines compare.
    limits = machine_limits.measure(os.cpu_count() or 1)
    print(f"machine: {limits.line()}", flush=True)
    port = free_port()
    cmd = [sys.executable, "-m", "omnistage", "serve", "voice", "--host", HOST]
    cmd += ["--port", str(port), "--log-level", "WARNING", *args.serve_args.split()]
    server = ServerProcess("voice", cmd, port)
    try:
        t0 = time.monotonic()
        server.wait_ready(args.health_timeout)
        print(f"serving after {time.monotonic() - t0:.0f} s", flush=True)
        levels = asyncio.run(measure(server, args))
    except Exception as exc:
        print(f"FAILED: {common.describe(exc)}{server.log_tail()}")
        return 1
    finally:
        server.stop()
    rows = [lv.row() for lv in levels]
    print_levels(rows)
    print_stages(levels)
    for e in sorted({e for lv in levels for e in lv.errors})[:5]:
        print(f"error: {e.splitlines()[0][:200]}")
    goals = targets(levels)
    if args.json:
        sections = {
            "machine": asdict(limits),
            "levels": [
                r | {"stages": lv.stages, "answers": [a.summary() for a in lv.answers]}
                for r, lv in zip(rows, levels, strict=True)
            ],
            "errors": sorted({e for lv in levels for e in lv.errors}),
            "targets": goals,
        }
        common.write_json(args.json, args, sections)
    return 0


if __name__ == "__main__":
    sys.exit(main())
