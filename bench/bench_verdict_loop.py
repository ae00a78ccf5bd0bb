"""What Smart Turn's verdicts cost an event loop: several semantic_vad streams in one
asyncio loop, each fed a spoken question at a microphone's pace, with the end-of-turn model
run inside ``feed`` (on the loop, as before) or on the process's worker pool
(``audio/verdicts.py``), in the same run.

A 5 ms ticker on the same loop measures how late the loop answers (its stall): every
session's audio waits that long. Reported per mode: the worst stall, the p99, and whether
every stream ended its turn where it should (same events in both modes).
"""

import argparse
import asyncio
import statistics
import sys
import time

import common
import numpy as np
from bench_realtime import piper_voice, say

from omnistage.audio.semantic_vad import SemanticVadParams
from omnistage.audio.smart_turn import SmartTurn
from omnistage.audio.vad import VadStream
from omnistage.audio.verdicts import VerdictPool

RATE = 24_000
FRAME = RATE // 50  # 20 ms
TICK_S = 0.005
QUESTION = "What is the capital of France?"


async def feed(stream: VadStream, pcm: bytes, events: list, late: list) -> None:
    """Send ``pcm`` at real-time pace, 20 ms a frame; the verdicts awaited as they come."""
    due = time.monotonic()
    for i in range(0, len(pcm), FRAME * 2):
        due += 0.02
        await asyncio.sleep(max(0.0, due - time.monotonic()))
        events += stream.feed(pcm[i : i + FRAME * 2])
        for verdict in stream.verdicts():
            late.append(asyncio.ensure_future(verdict))


async def run(sessions: int, pool: VerdictPool | None, pcm: bytes) -> dict:
    model = SmartTurn().probability
    streams = [
        VadStream(SemanticVadParams(), RATE, judge=model, verdicts=pool) for _ in range(sessions)
    ]
    stalls: list[float] = []
    done = False

    async def ticker() -> None:
        while not done:
            t = time.monotonic()
            await asyncio.sleep(TICK_S)
            stalls.append(time.monotonic() - t - TICK_S)

    tick = asyncio.ensure_future(ticker())
    events: list[list] = [[] for _ in streams]
    late: list[list[asyncio.Future]] = [[] for _ in streams]
    # Staggered by 40 ms, as sessions are: their pauses, and verdicts, fall close together.
    feeds = []
    for i, s in enumerate(streams):
        feeds.append(asyncio.ensure_future(feed(s, pcm, events[i], late[i])))
        await asyncio.sleep(0.04)
    await asyncio.gather(*feeds)
    for i, verdicts in enumerate(late):
        for got in await asyncio.gather(*verdicts):
            events[i] += got
    done = True
    await tick
    stalls.sort()
    ends = sorted({tuple(type(e).__name__ for e in ev) for ev in events})
    return {
        "max_ms": stalls[-1] * 1000,
        "p99_ms": stalls[int(0.99 * (len(stalls) - 1))] * 1000,
        "p50_ms": statistics.median(stalls) * 1000,
        "events": ends,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--sessions", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3, help="runs per mode, alternating")
    args = p.parse_args()
    print(common.machine(), flush=True)
    voice = piper_voice()
    question = say(voice, QUESTION)
    silence = np.zeros(RATE * 2, dtype=np.int16)
    pcm = np.concatenate([silence[: RATE // 2], question, silence]).astype("<i2").tobytes()
    SmartTurn().probability(np.zeros(16_000, dtype=np.float32))  # loaded and warm
    pool = VerdictPool()
    results: dict[str, list[dict]] = {"on the loop": [], "worker pool": []}
    for _ in range(args.rounds):
        results["on the loop"].append(asyncio.run(run(args.sessions, None, pcm)))
        results["worker pool"].append(asyncio.run(run(args.sessions, pool, pcm)))
    print(f"\n{args.sessions} semantic_vad streams in one loop, {args.rounds} runs each")
    print(f"{'verdicts':<14} {'loop stall max':>15} {'p99':>8} {'p50':>8}  turn events")
    for mode, runs in results.items():
        worst = max(r["max_ms"] for r in runs)
        p99 = statistics.median(r["p99_ms"] for r in runs)
        p50 = statistics.median(r["p50_ms"] for r in runs)
        ends = sorted({e for r in runs for e in r["events"]})
        print(f"{mode:<14} {worst:>12.1f} ms {p99:>5.1f} ms {p50:>5.1f} ms  {ends}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
