"""Whisper's short encoder window against the full 30 s one, on the same clips, in one
process: Whisper tiny.en (faster-whisper, int8, CPU) on 1-8 s sentences the Piper voice
says, each clip through the full path (``WhisperModel.transcribe``, as the asr engine
calls it) and the short path (``whisper_short.transcribe_short``, falling back to the
full path when it returns None, as the engine does), alternating, ``--rounds`` times.

Prints per clip the median milliseconds of each path, their ratio and each path's word
error rate against the words said; and the machine's own speed (a fixed numpy matmul)
before and after, with the load average, so runs on a shared machine can be compared.
See docs/benchmarks.md, "Whisper's short window".
"""

import argparse
import asyncio
import io
import os
import re
import statistics
import time

import numpy as np

SENTENCES = [
    "Yes.",
    "Hello.",
    "What time is it?",
    "Turn off the lights in the kitchen.",
    "Please call me tomorrow morning.",
    "Can you tell me a joke about penguins?",
    "The quick brown fox jumps over the lazy dog.",
    "I would like to book a table for two people at seven o'clock tonight.",
    "What is the weather going to be like in Paris this weekend, and should I bring an umbrella?",
    "Remind me to buy milk, eggs, bread and coffee on my way home from work this evening, please.",
    "Replicas can live on other hosts, register with the head, and send heartbeats every "
    "second, so the head knows which ones are alive.",
]
RATE = 16_000
EDGE_S = 0.3


def words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9']+", text.lower())


def wer(heard: str, said: str) -> float:
    a, b = words(heard), words(said)
    row = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        prev, row[0] = row[0], i
        for j, y in enumerate(b, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (x != y))
    return row[-1] / len(b)


async def _say_all() -> list[tuple[bytes, int]]:
    from omnistage.config.schema import StageConfig
    from omnistage.engines.base import EngineRequest
    from omnistage.engines.speech.tts import TtsEngine
    from omnistage.protocol.messages import Prompt
    from omnistage.protocol.params import ParamKind, decode

    async def nothing():  # type: ignore[no-untyped-def]
        return
        yield

    tts = TtsEngine(StageConfig(stage_id=1, name="talker", engine="tts", output_modality="audio"))
    await tts.start()
    out = []
    for text in SENTENCES:
        params = decode(ParamKind.SPEECH, {})
        chunks = [
            c async for c in tts.generate(EngineRequest("s", Prompt(text=text), params, nothing()))
        ]
        out.append((b"".join(c.data for c in chunks), chunks[0].meta.sample_rate))
    await tts.shutdown()
    return out


def clips() -> list[np.ndarray]:
    from faster_whisper.audio import decode_audio

    from omnistage.audio.wav import wav_bytes

    edge = np.zeros(round(EDGE_S * RATE), dtype=np.float32)
    out = []
    for pcm, rate in asyncio.run(_say_all()):
        speech = decode_audio(io.BytesIO(wav_bytes(pcm, rate)), sampling_rate=RATE)
        out.append(np.concatenate([edge, speech, edge]))
    return out


def matmul_ms(n: int = 512, repeats: int = 30) -> float:
    """The machine's speed: median ms of a fixed float32 matmul (same inputs each run)."""
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((n, n), np.float32), rng.standard_normal((n, n), np.float32)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        a @ b
        times.append((time.perf_counter() - t) * 1000)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1, help="CTranslate2 threads (engine: 1)")
    args = parser.parse_args()

    from faster_whisper import WhisperModel

    from omnistage.engines.speech.asr import _temperatures, resolve_model
    from omnistage.engines.speech.whisper_short import transcribe_short

    load = os.getloadavg()
    speed_before = matmul_ms()
    model = WhisperModel(
        str(resolve_model("tiny.en")), device="cpu", compute_type="int8", cpu_threads=args.threads
    )
    audio = clips()
    options = {"beam_size": 1, "temperature": _temperatures(0.0), "language": None}

    def full(x: np.ndarray) -> str:
        segments, _ = model.transcribe(x, **options)
        return "".join(s.text for s in segments)

    def short(x: np.ndarray) -> tuple[str, bool]:
        result = transcribe_short(model, x, None, None)
        return (result.text, True) if result is not None else (full(x), False)

    full(audio[0]), short(audio[0])  # warm-up: CTranslate2's buffers
    times: dict[str, list[list[float]]] = {
        "full": [[] for _ in audio],
        "short": [[] for _ in audio],
    }
    texts: dict[str, list[str]] = {"full": [""] * len(audio), "short": [""] * len(audio)}
    taken = [0] * len(audio)
    started = time.perf_counter()
    for r in range(args.rounds):
        for i, x in enumerate(audio):
            order = ("full", "short") if (r + i) % 2 == 0 else ("short", "full")
            for path in order:
                t = time.perf_counter()
                if path == "full":
                    texts[path][i] = full(x)
                else:
                    texts[path][i], ok = short(x)
                    taken[i] += ok
                times[path][i].append((time.perf_counter() - t) * 1000)
    wall = time.perf_counter() - started
    speed_after, load_after = matmul_ms(), os.getloadavg()

    print(f"tiny.en int8, {args.threads} thread(s), {args.rounds} rounds, {os.cpu_count()} CPUs")
    print(
        f"{'clip':>6} {'full ms':>8} {'short ms':>9} {'ratio':>6} {'short':>6}"
        f" {'WER full':>9} {'WER short':>10}  text"
    )
    sums = {"full": 0.0, "short": 0.0}
    for i, x in enumerate(audio):
        f, s = statistics.median(times["full"][i]), statistics.median(times["short"][i])
        sums["full"] += wer(texts["full"][i], SENTENCES[i])
        sums["short"] += wer(texts["short"][i], SENTENCES[i])
        print(
            f"{len(x) / RATE:5.1f}s {f:8.0f} {s:9.0f} {f / s:5.1f}x {taken[i]:>3}/{args.rounds}"
            f" {wer(texts['full'][i], SENTENCES[i]):9.2f}"
            f" {wer(texts['short'][i], SENTENCES[i]):10.2f}"
            f"  {texts['short'][i].strip()[:48]!r}"
        )
    total_f = sum(statistics.median(t) for t in times["full"])
    total_s = sum(statistics.median(t) for t in times["short"])
    n = len(audio)
    print(
        f"{'all':>6} {total_f:8.0f} {total_s:9.0f} {total_f / total_s:5.1f}x"
        f" {'':>6} {sums['full'] / n:9.3f} {sums['short'] / n:10.3f}  (sum of medians; mean WER)"
    )
    same = sum(words(a) == words(b) for a, b in zip(texts["full"], texts["short"], strict=True))
    print(f"same words on both paths: {same}/{n} clips; measured part {wall:.0f} s")
    print(
        f"machine: 512x512 float32 matmul {speed_before:.2f} ms before, {speed_after:.2f} ms after"
    )
    print(
        f"load average (1/5/15 min): {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} before, "
        f"{load_after[0]:.2f} {load_after[1]:.2f} {load_after[2]:.2f} after"
    )


if __name__ == "__main__":
    main()
