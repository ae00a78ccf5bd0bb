"""When to first ask the end-of-turn model: semantic_vad's detector offline, on Piper takes.

No server: Silero and Smart Turn (the real models) run in process on bench_turns.py's
utterances, each take synthesized afresh (Piper's voice varies take to take, and Smart
Turn's verdict with it). For each first-check silence (``Eager.first_check_ms`` of the
default eagerness, "auto"; the deciding check stays at ``CHECK_MS``, 192 ms) and each
threshold of that eagerness (``Eager.threshold``), on the same takes:
- finished questions: when the turn ends, from the question's last voiced frame (p50, and
  how many within 300 ms);
- paused sentences (600-800 ms of silence spliced in at a word boundary): how many the
  detector cuts off (ends before the sentence resumes).

And for each lead (``semantic_vad.LEAD_MS``: how long before its silence is due the model
is asked, hearing the silence so far repeated to the length asked about) and each noise
floor (white noise of this standard deviation in pcm16 under every take, silences
included: Piper's silence is digital zeros, a microphone's never is).

    python bench/bench_turn_checks.py --takes 4 --first 192,128 --thresholds 0.97,0.98
    python bench/bench_turn_checks.py --takes 5 --first 192 --leads 64,128,160 --noise 0,30,100
"""

import argparse
import dataclasses
import itertools
import statistics
import sys

import numpy as np
from bench_realtime import QUESTIONS, RATE, piper_voice, say
from bench_turns import MORE_QUESTIONS, paused_sentences

import omnistage.audio.semantic_vad as semantic_vad
from omnistage.audio.server_vad import SpeechStopped
from omnistage.audio.smart_turn import SmartTurn
from omnistage.audio.vad import VadStream


def turn_ends_ms(pcm: np.ndarray, judge: SmartTurn, noise: np.ndarray) -> list[float]:
    """Where the detector ends turns in ``pcm`` then 5 s of silence, ``noise`` under it all
    (ms of audio fed when each ``speech_stopped`` came), fed as a microphone's 20 ms frames."""
    stream = VadStream(semantic_vad.SemanticVadParams(), judge=judge.probability)
    audio = np.concatenate([pcm, np.zeros(RATE * 5, np.int16)]).astype(np.float32)
    audio = np.clip(audio + noise[: len(audio)], -32768, 32767).astype(np.int16)
    frame, ends = RATE // 50, []
    for i in range(0, len(audio), frame):
        for event in stream.feed(audio[i : i + frame].tobytes()):
            if isinstance(event, SpeechStopped):
                ends.append((i + frame) * 1000 / RATE)
    return ends


def main() -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--takes", type=int, default=4, help="Piper takes of every utterance")
    p.add_argument("--first", default="192,128", help="first-check silences, ms")
    p.add_argument("--thresholds", default="0.97", help="thresholds of the default eagerness")
    p.add_argument("--leads", default=str(semantic_vad.LEAD_MS), help="leads, ms")
    p.add_argument("--noise", default="0", help="noise floors (pcm16 standard deviation)")
    args = p.parse_args()

    def values(text: str, kind: type) -> list:
        return [kind(v) for v in text.split(",")]

    combos = list(
        itertools.product(
            values(args.first, int),
            values(args.thresholds, float),
            values(args.leads, int),
            values(args.noise, float),
        )
    )
    voice, judge, rng = piper_voice(), SmartTurn(), np.random.default_rng(0)
    ends: dict[tuple, list[float]] = {c: [] for c in combos}
    cut = dict.fromkeys(combos, 0)
    medium = semantic_vad.EAGERNESS["medium"]
    paused_n = 0
    for _ in range(args.takes):
        questions = [say(voice, q) for q in QUESTIONS + MORE_QUESTIONS]
        paused = [(pcm, resume) for pcm, _, resume in paused_sentences(voice)]
        paused_n += len(paused)
        # One noise per take, the same under every combination.
        longest = max(len(pcm) for pcm in questions + [pcm for pcm, _ in paused]) + RATE * 5
        hiss = rng.normal(0, 1, longest).astype(np.float32)
        for combo in combos:
            first, threshold, lead, sigma = combo
            # The default eagerness, asking first at this silence, ending at this verdict.
            semantic_vad.EAGERNESS["medium"] = dataclasses.replace(
                medium, first_check_ms=first, threshold=threshold
            )
            semantic_vad.LEAD_MS = lead
            for pcm in questions:
                stopped = turn_ends_ms(pcm, judge, hiss * sigma)
                ends[combo].append(stopped[0] - len(pcm) * 1000 / RATE)
            for pcm, resume in paused:
                late = turn_ends_ms(pcm, judge, hiss * sigma)
                cut[combo] += any(t < resume * 1000 / RATE for t in late)
    print(f"{args.takes} takes; deciding check at {semantic_vad.CHECK_MS} ms")
    head = f"{'first check':>12} {'threshold':>10} {'lead':>6} {'noise':>6} {'end p50':>8}"
    print(f"{head} {'<= 300 ms':>10} {'paused cut off':>15}")
    for combo in combos:
        first, threshold, lead, sigma = combo
        e = ends[combo]
        within = sum(x <= 300 for x in e)
        print(
            f"{first:>9} ms {threshold:>10.3f} {lead:>3} ms {sigma:>6.0f}"
            f" {statistics.median(e):>5.0f} ms {within:>5}/{len(e):<4} {cut[combo]:>8}/{paused_n}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
