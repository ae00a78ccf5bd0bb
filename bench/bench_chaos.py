"""Chaos on the default voice pipeline: every stage (listener, thinker, talker) at 2
replicas; streaming text+audio chats (typed and spoken questions) and realtime sessions
at once; a random UP replica of a random stage SIGKILLed every ``--kill-every`` seconds
for ``--minutes``, the last live replica of a stage included (requests then wait for its
restart). A first phase without kills (``--baseline-s``) is the same run's anchor.

Per answer: whether it failed (an HTTP error, an error event, a realtime response not
``completed``), the wait for its first audio, and the stall of a player that starts at
its first audio delta (``bench_realtime.Turn.stall_s``). Per kill: the restart-to-UP of
the killed slot. Run by hand (about ``--minutes`` + 2 minutes); see README.md.

``--kill heads`` / ``--kill api`` (chaos_fleet.py): two heads behind haproxy, a head or
one of a head's API server processes SIGKILLed once a minute; the clients resume.
"""

import argparse
import asyncio
import base64
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import chaos_stalls
import common
import httpx
from bench_realtime import Turn
from common import HOST, ServerProcess, free_port
from openai import AsyncOpenAI

QUESTIONS = (
    "What is the capital of France?",
    "Name a fruit that is yellow.",
    "How many days are there in a week?",
)
RATE = 24000
STAGES = {0: "thinker", 1: "talker", 2: "listener"}
GAP_S = 1.0  # the bound on an audio gap


@dataclass
class Answer:
    kind: str  # "chat typed", "chat spoken", "realtime"
    phase: str  # "baseline" or "chaos"
    ok: bool
    first_audio_s: float | None = None
    stall_s: float = 0.0
    error: str = ""
    rid: str = ""  # the head's request id (its log's failover lines name it)
    started: float = 0.0  # asked (monotonic)
    ended: float = 0.0
    deltas: list[tuple[float, float]] = field(default_factory=list)  # (time, audio s)


@dataclass
class Record:
    answers: list[Answer] = field(default_factory=list)
    kills: list[dict[str, Any]] = field(default_factory=list)
    broken_sessions: int = 0
    cut_by_length: int = 0  # realtime answers the model ran to its length limit
    phase: str = "baseline"
    loads: list[tuple[float, ...]] = field(default_factory=list)  # at the first kill, the end


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=10.0, help="of kills (default 10)")
    p.add_argument(
        "--kill",
        choices=("replicas", "heads", "api"),
        default="replicas",
        help="what dies: a replica (one head); a head, or one API server process of a head "
        "(two heads behind haproxy: chaos_fleet.py)",
    )
    p.add_argument("--kill-every", type=float, help="seconds (default 10; 60 for heads, api)")
    p.add_argument("--restart-after", type=float, default=2.0, help="a killed head's (s)")
    p.add_argument("--baseline-s", type=float, default=60.0)
    p.add_argument("--chat-clients", type=int, default=2)
    p.add_argument("--sessions", type=int, default=2, help="realtime sessions")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument(
        "--log", help="keep the server's log (INFO) here (--kill heads|api: a folder of logs)"
    )
    p.add_argument("--json", help="write the raw figures here")
    p.add_argument(
        "--stage-overrides",
        default="{}",
        help='more of the server\'s --stage-overrides, e.g. \'{"1": {"engine_args": '
        '{"later_nice": 0}}}\' (every stage is at 2 replicas whatever this says)',
    )
    args = p.parse_args()
    if args.kill_every is None:
        args.kill_every = 10.0 if args.kill == "replicas" else 60.0
    return args


def stages(port: int) -> dict[int, list[dict[str, Any]]]:
    with urllib.request.urlopen(f"http://{HOST}:{port}/v1/omni/stages", timeout=10) as r:
        return {s["stage_id"]: s["replicas"] for s in json.load(r)["stages"]}


def spoken(port: int, text: str) -> str:
    """``text`` said by the head's own voice, as a base64 WAV for ``input_audio``."""
    body = {"model": "voice", "input": text, "voice": "joe", "response_format": "wav"}
    r = httpx.post(f"http://{HOST}:{port}/v1/audio/speech", json=body, timeout=120)
    r.raise_for_status()
    return base64.b64encode(r.content).decode()


def chat_body(question: str, wav: str | None) -> dict[str, Any]:
    content: Any = question
    if wav is not None:
        content = [{"type": "input_audio", "input_audio": {"data": wav, "format": "wav"}}]
    return {
        "model": "voice",
        "messages": [{"role": "user", "content": content}],
        "modalities": ["text", "audio"],
        "audio": {"voice": "joe", "format": "pcm16"},
        "stream": True,
        "max_tokens": 60,
    }


def answer_of(turn: Turn, kind: str, phase: str, error: str, rid: str) -> Answer:
    """One answer's record, ended now (``error`` empty: it did not fail)."""
    first, stall = turn.first_audio_s, turn.stall_s()
    asked = turn.end_of_speech or 0.0
    return Answer(
        kind, phase, not error, first, stall, error, rid, asked, time.monotonic(), turn.deltas
    )


async def one_chat(client: httpx.AsyncClient, body: dict[str, Any], kind: str, rec: Record):
    turn, phase, error, rid = Turn(), rec.phase, "", ""
    turn.end_of_speech = time.monotonic()
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
            else:
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    rid = rid or event.get("id", "")
                    if "error" in event:
                        error = str(event["error"])[:200]
                        break
                    for choice in event.get("choices", []):
                        data = (choice["delta"].get("audio") or {}).get("data")
                        if data:
                            n = len(base64.b64decode(data))
                            turn.deltas.append((time.monotonic(), n / 2 / RATE))
    except (httpx.HTTPError, OSError) as exc:
        error = f"{type(exc).__name__}: {exc}"
    rec.answers.append(answer_of(turn, kind, phase, error, rid))


async def chat_client(port: int, wavs: list[str], stop: asyncio.Event, rec: Record) -> None:
    async with httpx.AsyncClient(base_url=f"http://{HOST}:{port}", timeout=300) as client:
        n = 0
        while not stop.is_set():
            q = n % len(QUESTIONS)
            wav = wavs[q] if n % 2 else None
            kind = "chat spoken" if wav else "chat typed"
            await one_chat(client, chat_body(QUESTIONS[q], wav), kind, rec)
            n += 1


async def realtime_answer(conn: Any, n: int, rec: Record) -> None:
    item = {
        "id": f"item_q{n}",
        "type": "message",
        "role": "user",
        "content": [{"type": "input_text", "text": QUESTIONS[n % len(QUESTIONS)]}],
    }
    turn, phase = Turn(), rec.phase
    await conn.conversation.item.create(item=item)
    turn.end_of_speech = time.monotonic()
    await conn.response.create()
    while True:
        event = await asyncio.wait_for(conn.recv(), 300)
        if event.type == "response.output_audio.delta":
            n_bytes = len(base64.b64decode(event.delta))
            turn.deltas.append((time.monotonic(), n_bytes / 2 / RATE))
        elif event.type == "error":
            raise RuntimeError(f"error event: {event.error}")
        elif event.type == "response.done":
            # An answer the model ran on to its own length limit (SmolLM2 now and then
            # rambles for 45 s) is incomplete but not failed: counted apart.
            details = event.response.status_details
            reason = getattr(details, "reason", None) if details else None
            ok = event.response.status == "completed" or reason == "max_output_tokens"
            rec.cut_by_length += reason == "max_output_tokens"
            why = "" if ok else f"status {event.response.status} ({reason})"
            rid = f"realtime-{event.response.id}"
            rec.answers.append(answer_of(turn, "realtime", phase, why, rid))
            # Keep the conversation short: this answer's items go.
            for out in [item["id"], *(o.id for o in event.response.output or [])]:
                await conn.conversation.item.delete(item_id=out)
            return


async def realtime_client(port: int, stop: asyncio.Event, rec: Record) -> None:
    client = AsyncOpenAI(base_url=f"http://{HOST}:{port}/v1", api_key="x", max_retries=0)
    try:
        async with client.realtime.connect(model="voice") as conn:
            await conn.session.update(session={"type": "realtime", "output_modalities": ["audio"]})
            n = 0
            while not stop.is_set():
                await realtime_answer(conn, n, rec)
                n += 1
    except Exception as exc:  # the session broke: counted, and a new one goes on
        rec.broken_sessions += 1
        rec.answers.append(Answer("realtime", rec.phase, False, error=common.describe(exc)))
        if not stop.is_set():
            await realtime_client(port, stop, rec)


async def killer(port: int, args: argparse.Namespace, stop: asyncio.Event, rec: Record):
    rng = random.Random(args.seed)
    while not stop.is_set():
        await asyncio.sleep(args.kill_every)
        view = await asyncio.to_thread(stages, port)
        sid = rng.choice(sorted(view))
        up = [r for r in view[sid] if r["state"] == "UP" and r.get("pid")]
        if not up:
            continue
        victim = rng.choice(up)
        try:
            os.kill(victim["pid"], signal.SIGKILL)
        except ProcessLookupError:
            continue
        rec.kills.append(
            {
                "stage": STAGES.get(sid, str(sid)),
                "key": (sid, victim["replica_id"]),
                "pid": victim["pid"],
                "at": time.monotonic(),
                "last_live": len(up) == 1,
                "up_after_s": None,
            }
        )


async def watch_restarts(port: int, stop: asyncio.Event, rec: Record) -> None:
    while not stop.is_set() or any(k["up_after_s"] is None for k in rec.kills):
        view = await asyncio.to_thread(stages, port)
        now = time.monotonic()
        for kill in rec.kills:
            if kill["up_after_s"] is not None:
                continue
            sid, rid = kill["key"]
            for r in view.get(sid, []):
                same = r["replica_id"] == rid and r.get("pid") not in (None, kill["pid"])
                if same and r["state"] == "UP":
                    kill["up_after_s"] = now - kill["at"]
        if stop.is_set() and now - max((k["at"] for k in rec.kills), default=now) > 300:
            return
        await asyncio.sleep(0.25)


async def run(port: int, args: argparse.Namespace, wavs: list[str]) -> Record:
    rec, stop = Record(), asyncio.Event()
    clients = [chat_client(port, wavs, stop, rec) for _ in range(args.chat_clients)]
    clients += [realtime_client(port, stop, rec) for _ in range(args.sessions)]
    tasks = [asyncio.create_task(c) for c in clients]
    await asyncio.sleep(args.baseline_s)
    rec.phase = "chaos"
    rec.loads.append(os.getloadavg())
    print(f"baseline done: {len(rec.answers)} answers; killing now", flush=True)
    kills = asyncio.create_task(killer(port, args, stop, rec))
    watch = asyncio.create_task(watch_restarts(port, stop, rec))
    await asyncio.sleep(args.minutes * 60)
    stop.set()
    rec.loads.append(os.getloadavg())
    kills.cancel()
    await asyncio.gather(*tasks)  # every answer under way finishes
    await watch
    return rec


def by_phase_kind(answers: list[Any]) -> Iterator[tuple[str, str, list[Any]]]:
    """The answers (anything with ``phase`` and ``kind``) per phase and kind, in the
    report's order, empty groups left out."""
    for phase in ("baseline", "chaos"):
        for kind in ("chat typed", "chat spoken", "realtime"):
            rows = [a for a in answers if a.phase == phase and a.kind == kind]
            if rows:
                yield phase, kind, rows


def report(rec: Record, log: Path, wall_minus_mono: float) -> None:
    print(
        f"\n{'phase':<9} {'answers':<12} {'n':>4} {'failed':>6} {'first audio p50':>15} "
        f"{'max':>6} {'stall>1s':>8} {'stall max':>9}"
    )
    for phase, kind, rows in by_phase_kind(rec.answers):
        firsts = [a.first_audio_s for a in rows if a.first_audio_s is not None]
        print(
            f"{phase:<9} {kind:<12} {len(rows):>4} {sum(not a.ok for a in rows):>6} "
            f"{statistics.median(firsts) if firsts else float('nan'):>15.2f} "
            f"{max(firsts, default=float('nan')):>6.2f} "
            f"{sum(a.stall_s > GAP_S for a in rows):>8} "
            f"{max(a.stall_s for a in rows):>9.2f}"
        )
    print(
        f"\nkills: {len(rec.kills)} ({sum(k['last_live'] for k in rec.kills)} of a stage's "
        f"last live replica); broken realtime sessions: {rec.broken_sessions}; realtime "
        f"answers cut at the model's length limit (not failed): {rec.cut_by_length}"
    )
    for name in sorted({k["stage"] for k in rec.kills}):
        ups = [k["up_after_s"] for k in rec.kills if k["stage"] == name]
        done = [u for u in ups if u is not None]
        print(
            f"  {name:<9} {len(ups):>3} kills, restart-to-UP median "
            f"{statistics.median(done) if done else float('nan'):.1f} s, "
            f"max {max(done, default=float('nan')):.1f} s, never UP: {len(ups) - len(done)}"
        )
    for a in [a for a in rec.answers if not a.ok][:10]:
        print(f"  failed ({a.phase}, {a.kind}): {a.error}")
    print(
        f"load average (1, 5, 15 min) at the first kill {rec.loads[0]}, at the end {rec.loads[-1]}"
    )
    seen = chaos_stalls.seen_after(log, wall_minus_mono, rec.kills)
    if seen:
        print(
            f"a kill seen by the head (ERROR) after median {statistics.median(seen):.2f} s, "
            f"p90 {common.pct(sorted(seen), 90):.2f} s, max {max(seen):.2f} s"
        )
    stalled = [a for a in rec.answers if a.stall_s > GAP_S]
    if stalled:
        print(f"\nstalls over {GAP_S:g} s, why (times from the answer's start):")
        failovers = chaos_stalls.read_failovers(log, wall_minus_mono)
        causes: dict[str, int] = {}
        for a in stalled:
            lines = chaos_stalls.explain(a, rec.kills, failovers.get(a.rid, []))
            print("\n".join(lines))
            cause = lines[-1].split("-> ", 1)[-1].split(":")[0] if "-> " in lines[-1] else "?"
            causes[cause] = causes.get(cause, 0) + 1
        print("causes: " + "; ".join(f"{n} {c}" for c, n in sorted(causes.items())))


def main() -> int:
    args = parse_args()
    common.exit_on_sigterm()
    print(common.machine(), flush=True)
    if args.kill != "replicas":
        import chaos_fleet  # it imports this module

        return chaos_fleet.main(args)
    port = free_port()
    more = json.loads(args.stage_overrides)
    every = json.dumps({str(sid): {**more.get(str(sid), {}), "replicas": 2} for sid in STAGES})
    cmd = [sys.executable, "-m", "omnistage", "serve", "voice", "--host", HOST]
    # INFO: its failover lines say which replica an answer lost (chaos_stalls).
    cmd += ["--port", str(port), "--log-level", "INFO", "--stage-overrides", every]
    log = Path(args.log or tempfile.mkstemp(prefix="chaos-", suffix=".log")[1])
    server = ServerProcess("voice-chaos", cmd, port, log_path=log, pdeathsig=True)
    wall_minus_mono = time.time() - time.monotonic()
    try:
        server.wait_ready(300)
        wavs = [spoken(port, q) for q in QUESTIONS]
        rec = asyncio.run(run(port, args, wavs))
    except Exception as exc:
        print(f"FAILED: {common.describe(exc)}{server.log_tail()}")
        return 1
    finally:
        server.stop()
    report(rec, log, wall_minus_mono)
    if not args.log:
        log.unlink()
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            raw = {"answers": [a.__dict__ for a in rec.answers], "kills": rec.kills}
            json.dump(raw | {"wall_minus_mono": wall_minus_mono, "loads": rec.loads}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
