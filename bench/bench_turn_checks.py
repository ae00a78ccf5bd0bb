"""When to first ask the end-of-turn model: semantic_vad's detector offline, on Piper takes.

No server: Silero and Smart Turn (the real models) run in process on bench_turns.py's
utterances, each take synthesized afresh (Piper's voice varies take to take, and Smart
Turn's verdict with it). For each first-check silence (``Eager.first_check_ms`` of the
default eagerness, "auto"; the deciding check stays at ``CHECK_MS``, 192 ms), on the same
takes:
- finished questions: when the turn ends, from the question's last voiced frame (p50, and
  how many within 300 ms);
- paused sentences (600-800 ms of silence spliced in at a word boundary): how many the
  detector cuts off (ends before the sentence resumes).

    python bench/bench_turn_checks.py --takes 4 --first 200,100,64
"""

import argparse
import dataclasses
import statistics
import sys

import numpy as np
from bench_realtime import QUESTIONS, RATE, piper_voice, say
from bench_turns import MORE_QUESTIONS, PAUSED, spliced

import omnistage.audio.semantic_vad as semantic_vad
from omnistage.audio.server_vad import SpeechStopped
from omnistage.audio.smart_turn import SmartTurn
from omnistage.audio.vad import VadStream


def turn_ends_ms(pcm: np.ndarray, judge: SmartTurn) -> list[float]:
    """Where the detector ends turns in ``pcm`` then 5 s of silence (ms of audio fed when
    each ``speech_stopped`` came), fed as a microphone's 20 ms frames."""
    stream = VadStream(semantic_vad.SemanticVadParams(), judge=judge.probability)
    audio = np.concatenate([pcm, np.zeros(RATE * 5, np.int16)])
    frame, ends = RATE // 50, []
    for i in range(0, len(audio), frame):
        for event in stream.feed(audio[i : i + frame].tobytes()):
            if isinstance(event, SpeechStopped):
                ends.append((i + frame) * 1000 / RATE)
    return ends


def main() -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--takes", type=int, default=4, help="Piper takes of every utterance")
    p.add_argument("--first", default="200,100,64", help="first-check silences, ms")
    args = p.parse_args()
    firsts = [int(v) for v in args.first.split(",")]
    voice, judge = piper_voice(), SmartTurn()
    ends: dict[int, list[float]] = {f: [] for f in firsts}
    cut = dict.fromkeys(firsts, 0)
    paused_n = 0
    for _ in range(args.takes):
        questions = [say(voice, q) for q in QUESTIONS + MORE_QUESTIONS]
        steps = len(PAUSED) - 1
        paused = [spliced(voice, a, b, 0.6 + 0.2 * i / steps) for i, (a, b) in enumerate(PAUSED)]
        paused_n += len(paused)
        for first in firsts:
            # The default eagerness, asking first at this silence.
            eager = semantic_vad.EAGERNESS["medium"]
            semantic_vad.EAGERNESS["medium"] = dataclasses.replace(eager, first_check_ms=first)
            for pcm in questions:
                stopped = turn_ends_ms(pcm, judge)
                ends[first].append(stopped[0] - len(pcm) * 1000 / RATE)
            for pcm, resume in paused:
                cut[first] += any(t < resume * 1000 / RATE for t in turn_ends_ms(pcm, judge))
    print(f"{args.takes} takes; deciding check at {semantic_vad.CHECK_MS} ms")
    print(f"{'first check':>12} {'end p50':>8} {'<= 300 ms':>10} {'paused cut off':>15}")
    for first in firsts:
        e = ends[first]
        within = sum(x <= 300 for x in e)
        print(
            f"{first:>9} ms {statistics.median(e):>6.0f} ms {within:>5}/{len(e):<4}"
            f" {cut[first]:>8}/{paused_n}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
