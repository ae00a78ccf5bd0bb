"""An answer's opening through Piper whole, and cut at its decoder: when its audio starts.

No server: the default voice (en_US-joe-medium), loaded in process twice on the same
thread count, as Piper runs it (one ONNX graph, ``PiperVoice``) and as the talker does
(``piper_stages.StagedVoice``, the graph cut at its decoder). For each opening phrase, in
turns, the median over ``--runs`` of:
- whole: Piper's synthesis of the phrase, its first sample with its last;
- first part: the staged voice's first ``FIRST_FRAMES`` frames' audio (given ``early``);
- staged all: the staged voice's whole synthesis of the phrase, both parts;
and, without the voice's noise (so both make the same audio), how the two compare: the
staged audio's loudness against the whole's (Piper scales a sentence to its peak, which
a first part without it cannot know: the staged one is then louder, its rest softly
limited), and how far apart they are once that gain is taken out, in dB below the signal.
The cut's timing rule (``StagedVoice.in_time``) is off: every opening is cut.

    python bench/bench_piper_split.py --threads 2 --runs 15
"""

import argparse
import statistics
import time

import numpy as np

from omnistage.engines.speech import piper_stages
from omnistage.engines.speech.piper_sessions import cut, piper_voice, synthesize_blocking
from omnistage.engines.speech.piper_stages import StagedVoice
from omnistage.engines.speech.voices import VoiceCatalog

OPENINGS = [
    "The capital of France is",
    "Sure, I can help",
    "The largest planet is",
    "Water boils at one hundred degrees",
    "Well, it depends on",
    "I would recommend",
    "Tomorrow at seven works",
    "Here is a joke about",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--runs", type=int, default=15)
    args = parser.parse_args()
    import threading

    # The cut itself, on every opening: not whether this machine's speed would allow it.
    piper_stages.DECODE_PER_ENCODE = 0.0
    voice = VoiceCatalog.discover(None, None, None).default
    staged = piper_voice(voice, args.threads, cut(voice))
    assert isinstance(staged, StagedVoice), "the voice's graph was not cut"
    whole = _whole(voice, args.threads)
    stop = threading.Event()

    def first_part_s(text: str) -> tuple[float, float]:
        started, at = time.perf_counter(), []
        synthesize_blocking(staged, text, 1.0, stop, early=lambda _: at.append(time.perf_counter()))
        done = time.perf_counter()
        return (at[0] if at else done) - started, done - started

    def whole_s(text: str) -> float:
        started = time.perf_counter()
        synthesize_blocking(whole, text, 1.0, stop)
        return time.perf_counter() - started

    for text in OPENINGS[:2]:  # warm both
        whole_s(text), first_part_s(text)
    print(f"{args.threads} thread(s), median of {args.runs} runs, ms:")
    print(
        f"{'opening':36s} {'whole':>7s} {'first part':>11s} {'staged all':>11s} {'ratio':>6s}"
        f" {'louder':>7s} {'apart dB':>9s}"
    )
    ratios = []
    for text in OPENINGS:
        wholes, firsts, alls = [], [], []
        for _ in range(args.runs):  # in turns, so the machine's noise falls on both
            wholes.append(whole_s(text))
            first, total = first_part_s(text)
            firsts.append(first)
            alls.append(total)
        w, f, a = (statistics.median(x) * 1000 for x in (wholes, firsts, alls))
        ratios.append(f / w)
        louder, apart = _apart(staged, whole, text, stop)
        print(f"{text:36s} {w:7.1f} {f:11.1f} {a:11.1f} {f / w:6.2f} {louder:7.2f} {apart:9.1f}")
    print(f"first part / whole, median: {statistics.median(ratios):.2f}")


def _whole(voice, threads: int):
    """Piper's voice as one graph, on the talker's session options."""
    import json

    import onnxruntime
    from piper import PiperVoice
    from piper.config import PiperConfig

    opts = onnxruntime.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    with open(voice.config_path, encoding="utf-8") as f:
        config = PiperConfig.from_dict(json.load(f))
    session = onnxruntime.InferenceSession(str(voice.model_path), sess_options=opts)
    return PiperVoice(config=config, session=session)


def _apart(staged, whole, text: str, stop) -> tuple[float, float]:
    """Without noise: the staged opening's (both parts) gain over the whole one, and how
    far apart they are once it is taken out (dB below the signal)."""
    noise = (0.0, 0.0)
    ref = np.frombuffer(synthesize_blocking(whole, text, 1.0, stop, noise), dtype=np.int16)
    head: list[bytes] = []
    rest = synthesize_blocking(staged, text, 1.0, stop, noise, early=head.append)
    got = np.frombuffer(b"".join(head) + rest, dtype=np.int16)
    ref, got = ref.astype(np.float64), got.astype(np.float64)
    gain = float(np.dot(got, ref) / np.dot(ref, ref))  # least squares: got ~ gain * ref
    error = ((got - gain * ref) ** 2).sum()
    return gain, 10 * np.log10((gain * gain * (ref**2).sum()) / max(error, 1e-9))


if __name__ == "__main__":
    main()
