"""Realtime answers under replica kills: the audio gap a client sees, and whether any word
is lost or repeated, beside the same answers undisturbed in the same run.

Starts ``omnistage serve`` (voice) with the thinker and the talker at 2 replicas each.
One realtime session (the openai SDK) asks the same typed question again and again at
temperature 0 (an answer of a few sentences, the same words every time): first
undisturbed, then with the busy talker's replica SIGKILLed once its first audio arrived,
then the busy thinker's. The head restarts a killed replica, and the next trial waits
until both stages have 2 UP again.

Per answer: the longest wait between two audio deltas, how long a player that starts at
the first delta runs dry (``stall``), and the words of the transcript against the
undisturbed answer's. See README.md.
"""

import argparse
import asyncio
import base64
import itertools
import json
import os
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import common
from bench_chaos import stages
from bench_realtime import Turn
from common import HOST, ServerProcess, free_port
from openai import AsyncOpenAI

QUESTION = "Describe Paris in four short sentences."
SESSION = {
    "type": "realtime",
    "instructions": "You are a helpful assistant.",
    "output_modalities": ["audio"],
    "audio": {"output": {"format": {"type": "audio/pcm", "rate": 24000}, "voice": "alloy"}},
}
RATE = 24000
THINKER, TALKER = 0, 1
TARGET_GAP_S = 1.0  # the bound on an audio gap under a kill


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=3, help="answers per kind (default 3)")
    p.add_argument("--health-timeout", type=float, default=300.0)
    p.add_argument("--json", help="write the raw figures here")
    p.add_argument("--log", help="keep the server's log (at INFO) in this file")
    p.add_argument("--kinds", default="undisturbed,talker,thinker", help="which answers")
    return p.parse_args()


def replicas(port: int, stage_id: int) -> list[dict[str, Any]]:
    return stages(port)[stage_id]


async def both_up(port: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ups = [sum(r["state"] == "UP" for r in replicas(port, sid)) for sid in (THINKER, TALKER)]
        if ups == [2, 2]:
            return
        await asyncio.sleep(0.2)
    raise TimeoutError("the thinker and the talker are not back at 2 replicas UP")


def kill_busy(port: int, stage_id: int) -> bool:
    busy = [r for r in replicas(port, stage_id) if r["in_flight"] > 0 and r.get("pid")]
    if not busy:
        return False
    os.kill(busy[0]["pid"], signal.SIGKILL)
    return True


async def answer(conn: Any, port: int, victim: int | None) -> tuple[Turn, bool]:
    """One answer to QUESTION; ``victim``: the stage whose busy replica is killed once
    the first audio is in. Returns the answer and whether a kill happened."""
    content = [{"type": "input_text", "text": QUESTION}]
    await conn.conversation.item.create(
        item={"type": "message", "role": "user", "content": content}
    )
    turn, killed = Turn(), False
    turn.end_of_speech = time.monotonic()
    await conn.response.create()
    while True:
        event = await asyncio.wait_for(conn.recv(), 120)
        now = time.monotonic()
        if event.type == "response.output_audio.delta":
            pcm = base64.b64decode(event.delta)
            turn.deltas.append((now, len(pcm) / 2 / RATE))
            if victim is not None and not killed:
                killed = kill_busy(port, victim)
        elif event.type == "response.output_audio_transcript.delta":
            turn.transcript += event.delta
        elif event.type == "response.done":
            turn.status = event.response.status
            return turn, killed
        elif event.type == "error":
            raise RuntimeError(f"error event: {event.error}")


def max_gap(turn: Turn) -> float:
    times = [t for t, _ in turn.deltas]
    return max((b - a for a, b in itertools.pairwise(times)), default=0.0)


async def measure(port: int, args: argparse.Namespace) -> dict[str, list[dict[str, Any]]]:
    client = AsyncOpenAI(base_url=f"http://{HOST}:{port}/v1", api_key="x", max_retries=0)
    results: dict[str, list[dict[str, Any]]] = {"undisturbed": [], "talker": [], "thinker": []}
    victims = {"undisturbed": None, "talker": TALKER, "thinker": THINKER}
    for kind in args.kinds.split(","):
        victim = victims[kind]
        for _ in range(args.trials):
            await both_up(port, args.health_timeout)
            # A session per answer: the question alone in its conversation, so the
            # same words every time.
            async with client.realtime.connect(model="voice") as conn:
                await conn.session.update(session={**SESSION, "temperature": 0})
                turn, killed = await answer(conn, port, victim)
            row = {
                "status": turn.status,
                "killed": killed,
                "max_gap_s": max_gap(turn),
                "stall_s": turn.stall_s(),
                "audio_s": turn.audio_s,
                "words": turn.transcript.split(),
            }
            results[kind].append(row)
            print(f"{kind:<11} gap {row['max_gap_s']:.2f} s, {row['status']}", flush=True)
    return results


def report(results: dict[str, list[dict[str, Any]]]) -> None:
    base = results["undisturbed"][0]["words"] if results["undisturbed"] else None
    print(
        f"\n{'answers':<11} {'n':>2} {'killed':>6} {'gap max':>8} {'median':>7} "
        f"{'stall max':>9} {'audio s':>7} {'words as undisturbed':>21}"
    )
    for kind, rows in results.items():
        if not rows:
            continue
        gaps = [r["max_gap_s"] for r in rows]
        same = sum(r["words"] == base for r in rows)
        print(
            f"{kind:<11} {len(rows):>2} {sum(r['killed'] for r in rows):>6} {max(gaps):>8.2f} "
            f"{statistics.median(gaps):>7.2f} {max(r['stall_s'] for r in rows):>9.2f} "
            f"{statistics.median(r['audio_s'] for r in rows):>7.1f} "
            f"{same:>17}/{len(rows)}"
        )
    worst = max((r["max_gap_s"] for k in ("talker", "thinker") for r in results[k]), default=0)
    print(f"\nworst gap under a kill {worst:.2f} s (target <= {TARGET_GAP_S:.1f} s)")


def main() -> int:
    args = parse_args()
    common.exit_on_sigterm()
    print(common.machine(), flush=True)
    port = free_port()
    two = json.dumps({"0": {"replicas": 2}, "1": {"replicas": 2}})
    cmd = [sys.executable, "-m", "omnistage", "serve", "voice", "--host", HOST]
    cmd += ["--port", str(port), "--log-level", "INFO" if args.log else "WARNING"]
    cmd += ["--stage-overrides", two]
    log = Path(args.log) if args.log else None
    server = ServerProcess("voice-2x2", cmd, port, log_path=log, pdeathsig=True)
    try:
        server.wait_ready(args.health_timeout)
        results = asyncio.run(measure(port, args))
    except Exception as exc:
        print(f"FAILED: {common.describe(exc)}{server.log_tail()}")
        return 1
    finally:
        server.stop()
    report(results)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
