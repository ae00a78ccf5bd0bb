"""Qwen2.5-Omni served as a staged pipeline (thinker -> talker -> token2wav, a replica
process each: ``omnistage serve DIR``) against transformers' monolithic
``Qwen2_5OmniForConditionalGeneration.generate`` in one process, on the same tiny
random-weight checkpoint, on this machine, in the same run.

The monolithic model cannot batch audio and cannot stream it: as a one-process server it
answers requests one after another, each with its whole waveform at once. So its time
to first audio is the time to its whole waveform (queueing included at c=4: four
requests arrive together and the fourth waits for three). The staged pipeline streams
(a chat with ``modalities: ["text", "audio"]``, ``stream: true``), and its stages work
on different requests at once.

Per side, at c=1 (``--requests`` one after another) and c=4 (``--waves`` waves of four
at once): time to first audio (p50 and max) and audio seconds produced per wall second.
Greedy in thinker and talker, the same answer and code budgets, the same prompts, the
same torch threads per process (``--threads``). See README.md.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import common
import httpx
from common import HOST, ServerProcess, free_port

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # for tests.*

from tests.omni_tiny import CODEC_EOS, build_tiny_omni

RATE = 24_000  # Qwen2.5-Omni's token2wav: 24 kHz int16
PROMPTS = (
    "Tell me about the sea.",
    "What do mountains look like?",
    "Describe a quiet forest at night.",
    "How does a river reach the ocean?",
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--width", type=int, default=256, help="LM hidden width (thinker, talker)")
    p.add_argument("--layers", type=int, default=4, help="LM layers (thinker, talker)")
    p.add_argument("--max-tokens", type=int, default=16, help="the thinker's answer")
    p.add_argument("--max-codes", type=int, default=96, help="the talker's codes")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--requests", type=int, default=4, help="measured requests at c=1")
    p.add_argument("--waves", type=int, default=2, help="measured waves of 4 at c=4")
    p.add_argument(
        "--variants",
        default="staged,talker2",
        help="staged sides, each a '+'-joined list of: staged (the checkpoint's pipeline, "
        "token2wav decoding whole utterances as the monolithic model), talker2 (two "
        "talker replicas), chunked (token2wav chunk_codes 24: audio leaves as codes come)",
    )
    p.add_argument("--model-dir", help="reuse this checkpoint (else one is built)")
    p.add_argument("--monolithic", metavar="SPEC", help=argparse.SUPPRESS)
    common.add_common_args(p, health_timeout=300, request_timeout=600)
    return p.parse_args(argv)


# -- the monolithic side, in a process of its own ------------------------------------------


def monolithic_serve(spec: dict[str, Any]) -> dict[str, Any]:
    """One process answering requests one after another with ``generate``: a warm-up,
    then the c=1 requests, then the waves of four arriving at once."""
    import torch
    from transformers import AutoTokenizer, Qwen2_5OmniForConditionalGeneration

    torch.set_num_threads(spec["threads"])
    model = Qwen2_5OmniForConditionalGeneration.from_pretrained(spec["dir"]).eval()
    tokenizer = AutoTokenizer.from_pretrained(spec["dir"])

    def answer(prompt: str) -> tuple[int, int]:
        messages = [{"role": "user", "content": prompt}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"]) if hasattr(ids, "keys") else list(ids)
        torch.manual_seed(0)
        sequences, wav = model.generate(
            torch.tensor([ids]),
            speaker="Chelsie",
            thinker_max_new_tokens=spec["max_tokens"],
            thinker_do_sample=False,
            talker_do_sample=False,
            talker_max_new_tokens=spec["max_codes"],
            talker_eos_token_id=[CODEC_EOS],
        )
        return sequences.shape[1] - len(ids), int(wav.numel())

    answer(PROMPTS[0])
    cpu0, wall0 = time.process_time(), time.perf_counter()
    c1 = []
    for i in range(spec["requests"]):
        t0 = time.perf_counter()
        tokens, samples = answer(PROMPTS[i % len(PROMPTS)])
        took = time.perf_counter() - t0
        c1.append({"ttfa": took, "end": took, "samples": samples, "tokens": tokens})
    cpu1, wall1 = time.process_time(), time.perf_counter()
    waves = []
    for _ in range(spec["waves"]):
        t0, wave = time.perf_counter(), []
        for prompt in PROMPTS:
            tokens, samples = answer(prompt)
            done = time.perf_counter() - t0  # all four arrived at t0
            wave.append({"ttfa": done, "end": done, "samples": samples, "tokens": tokens})
        waves.append(wave)
    busy = {
        "c1": (cpu1 - cpu0) / (wall1 - wall0),
        "c4": (time.process_time() - cpu1) / (time.perf_counter() - wall1),
    }
    return {"c1": c1, "c4": waves, "cpu_share": busy}


def run_monolithic(args: argparse.Namespace, directory: Path) -> dict[str, Any]:
    spec = {
        "dir": str(directory),
        "threads": args.threads,
        "max_tokens": args.max_tokens,
        "max_codes": args.max_codes,
        "requests": args.requests,
        "waves": args.waves,
    }
    cmd = [sys.executable, __file__, "--monolithic", json.dumps(spec)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if out.returncode:
        raise RuntimeError(f"monolithic side failed:\n{out.stderr[-3000:]}")
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


# -- the staged side: a head and its replicas ----------------------------------------------


def stage_overrides(args: argparse.Namespace, variant: str) -> dict[str, Any]:
    talker: dict[str, Any] = {"engine_args": {"do_sample": False, "max_new_tokens": args.max_codes}}
    overrides: dict[str, Any] = {"1": talker}
    for part in variant.split("+"):
        if part == "talker2":
            talker["replicas"] = 2
        elif part == "chunked":
            overrides["2"] = {"engine_args": {"chunk_codes": 24}}
        elif part != "staged":
            raise SystemExit(f"unknown variant part {part!r}")
    return overrides


def start_head(args: argparse.Namespace, directory: Path, variant: str) -> ServerProcess:
    port = free_port()
    cmd = [sys.executable, "-m", "omnistage", "serve", str(directory), "--host", HOST]
    cmd += ["--port", str(port), "-oma", HOST, "-omp", str(free_port())]
    cmd += ["--stage-overrides", json.dumps(stage_overrides(args, variant))]
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the replicas inherit it
    return ServerProcess(f"omnistage-{variant}", cmd, port, pdeathsig=True)


def stream_chat(
    client: httpx.Client, port: int, model: str, prompt: str, args: argparse.Namespace
) -> dict[str, Any]:
    """One streamed spoken chat: seconds to its first audio bytes and to its end, samples.
    ``client`` is made once per side and keeps its connections: making an httpx client
    (its SSL context) takes 40-130 ms of CPU here, which is the client's cost, not the
    server's, and the monolithic side has nothing like it in its timing."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "modalities": ["text", "audio"],
        "audio": {"voice": "Chelsie", "format": "pcm16"},
        "temperature": 0,
        "max_tokens": args.max_tokens,
        "stream": True,
    }
    t0, first, nbytes = time.perf_counter(), None, 0
    url = f"http://{HOST}:{port}/v1/chat/completions"
    with client.stream("POST", url, json=body, timeout=args.request_timeout) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            for choice in json.loads(line[6:])["choices"]:
                data = (choice["delta"].get("audio") or {}).get("data")
                if data:
                    first = first if first is not None else time.perf_counter() - t0
                    nbytes += len(base64.b64decode(data))
    if first is None:
        raise RuntimeError(f"no audio in the answer to {prompt!r}")
    return {"ttfa": first, "end": time.perf_counter() - t0, "samples": nbytes // 2}


def _get(port: int, path: str) -> Any:
    with urllib.request.urlopen(f"http://{HOST}:{port}{path}", timeout=10) as resp:
        return json.loads(resp.read())


def stage_pids(port: int, timeout: float) -> dict[str, list[int]]:
    """Each stage's replica pids, once every replica is UP (/health answers as soon as
    each stage has one)."""
    deadline = time.monotonic() + timeout
    while True:
        stages = _get(port, "/v1/omni/stages")["stages"]
        replicas = [r for s in stages for r in s["replicas"]]
        if replicas and all(r["state"] == "UP" for r in replicas):
            return {s["name"]: [int(r["pid"]) for r in s["replicas"]] for s in stages}
        if time.monotonic() > deadline:
            raise RuntimeError(f"replicas not all UP after {timeout:.0f}s: {stages}")
        time.sleep(0.5)


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, from /proc/<pid>/stat."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / 100.0


def stage_cpu(pids: dict[str, list[int]]) -> dict[str, float]:
    return {name: sum(cpu_seconds(pid) for pid in group) for name, group in pids.items()}


def run_staged(args: argparse.Namespace, directory: Path, variant: str) -> dict[str, Any]:
    server = start_head(args, directory, variant)
    # Enough connections for a wave, each opened by the warm-up wave before the timing.
    client = httpx.Client(limits=httpx.Limits(max_connections=len(PROMPTS)))
    try:
        server.wait_ready(args.health_timeout)
        port = server.port or 0
        model = _get(port, "/v1/models")["data"][0]["id"]
        pids = {"head": [server.pid], **stage_pids(port, args.health_timeout)}
        concurrent_wave(client, port, model, args)  # warm-up
        before = stage_cpu(pids)
        t0 = time.perf_counter()
        c1 = [
            stream_chat(client, port, model, PROMPTS[i % len(PROMPTS)], args)
            for i in range(args.requests)
        ]
        mid = stage_cpu(pids)
        t1 = time.perf_counter()
        waves = [concurrent_wave(client, port, model, args) for _ in range(args.waves)]
        t2 = time.perf_counter()
        after = stage_cpu(pids)
        busy = {
            "c1": {n: (mid[n] - before[n]) / (t1 - t0) for n in pids},
            "c4": {n: (after[n] - mid[n]) / (t2 - t1) for n in pids},
        }
        return {"c1": c1, "c4": waves, "stage_cpu_share": busy}
    finally:
        client.close()
        server.stop()


def concurrent_wave(
    client: httpx.Client, port: int, model: str, args: argparse.Namespace
) -> list[dict[str, Any]]:
    results: list[Any] = [None] * len(PROMPTS)

    def one(i: int) -> None:
        try:
            results[i] = stream_chat(client, port, model, PROMPTS[i], args)
        except Exception as exc:
            results[i] = exc

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r in results:
        if isinstance(r, Exception):
            raise r
    return results


# -- figures --------------------------------------------------------------------------------


def figures(side: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Per level: TTFA p50 and max, audio seconds per wall second, audio per request."""
    out = {}
    levels = {"c1": [side["c1"]], "c4": side["c4"]}
    for level, groups in levels.items():
        flat = [r for g in groups for r in g]
        ttfa = sorted(r["ttfa"] for r in flat)
        audio = sum(r["samples"] for r in flat) / RATE
        if level == "c1":
            wall = sum(r["end"] for r in flat)
        else:
            wall = sum(max(r["end"] for r in g) for g in groups)
        out[level] = {
            "ttfa_p50_s": statistics.median(ttfa),
            "ttfa_max_s": ttfa[-1],
            "audio_s_per_wall_s": audio / wall,
            "audio_s_per_request": audio / len(flat),
            "wall_s": wall,
        }
    return out


def print_table(results: dict[str, dict[str, dict[str, float]]]) -> None:
    sides = list(results)
    base = results["monolithic"]
    print(f"\n| level | figure | {' | '.join(sides)} |")
    print(f"|---|---|{'---|' * len(sides)}")
    rows = (
        ("ttfa_p50_s", "TTFA p50 (s)"),
        ("ttfa_max_s", "TTFA max (s)"),
        ("audio_s_per_wall_s", "audio s / wall s"),
    )
    for level in ("c1", "c4"):
        for key, label in rows:
            cells = [f"{results[s][level][key]:.3f}" for s in sides]
            print(f"| {level} | {label} | {' | '.join(cells)} |")
    print(
        "\nratios against monolithic (TTFA: monolithic / side, >1 = side faster; "
        "audio rate: side / monolithic):"
    )
    for side in (s for s in sides if not s.startswith("mono")):
        for level in ("c1", "c4"):
            r = results[side][level]
            b = base[level]
            print(
                f"  {side} {level}: TTFA p50 x{b['ttfa_p50_s'] / r['ttfa_p50_s']:.2f}, "
                f"audio rate x{r['audio_s_per_wall_s'] / b['audio_s_per_wall_s']:.2f}"
            )


def load_average() -> str:
    with open("/proc/loadavg") as f:
        return f.read().split()[0]


def run_sides(args: argparse.Namespace, directory: Path) -> dict[str, Any]:
    """The monolithic side before and after the staged ones (drift shows as their gap),
    then both runs pooled as ``monolithic``."""
    raw: dict[str, Any] = {}
    print(f"# load average {load_average()}: monolithic (before)", flush=True)
    raw["mono-before"] = run_monolithic(args, directory)
    for variant in args.variants.split(","):
        print(f"# load average {load_average()}: {variant}", flush=True)
        raw[variant] = run_staged(args, directory, variant)
    print(f"# load average {load_average()}: monolithic (after)", flush=True)
    raw["mono-after"] = run_monolithic(args, directory)
    before, after = raw["mono-before"], raw["mono-after"]
    raw = {
        "monolithic": {"c1": before["c1"] + after["c1"], "c4": before["c4"] + after["c4"]},
        **raw,
    }
    return raw


def cpu_cores(data: dict[str, Any], level: str) -> float:
    """The side's CPU over a level's wall time, in cores (every stage and the head)."""
    if "cpu_share" in data:
        return float(data["cpu_share"][level])
    return float(sum(data["stage_cpu_share"][level].values()))


def report_cpu(raw: dict[str, Any], results: dict[str, Any]) -> None:
    print(
        "\nCPU in cores over each level's wall time (1.0 = one core busy throughout), and "
        "CPU seconds per audio second (steadier than rates when the machine is shared):"
    )
    for side, data in raw.items():
        if "cpu_share" not in data and "stage_cpu_share" not in data:
            continue
        for level in ("c1", "c4"):
            cores = cpu_cores(data, level)
            per_audio = cores / results[side][level]["audio_s_per_wall_s"]
            parts = ""
            if "stage_cpu_share" in data:
                shares = data["stage_cpu_share"][level].items()
                parts = " (" + ", ".join(f"{name} {v:.2f}" for name, v in shares) + ")"
            print(f"  {side} {level}: {cores:.2f} cores{parts}, {per_audio:.1f} CPU s / audio s")


def main() -> int:
    args = parse_args()
    if args.monolithic:
        print(json.dumps(monolithic_serve(json.loads(args.monolithic))))
        return 0
    common.exit_on_sigterm()
    with tempfile.TemporaryDirectory(prefix="bench-omni-") as tmp:
        directory = Path(args.model_dir) if args.model_dir else None
        if directory is None:
            directory = Path(tmp) / "qwen2.5-omni-bench"
            build_tiny_omni(directory, width=args.width, layers=args.layers)
        print(
            f"# {common.machine()}; checkpoint: LM width {args.width}, {args.layers} layers "
            f"(thinker, talker); {args.max_tokens} answer tokens, {args.max_codes} codes; "
            f"{args.threads} torch thread(s) per process"
        )
        raw = run_sides(args, directory)
    results = {side: figures(data) for side, data in raw.items()}
    for side, data in raw.items():
        tokens = [r.get("tokens") for r in data["c1"]]
        extra = f", answer tokens {tokens}" if tokens[0] is not None else ""
        per = results[side]["c1"]["audio_s_per_request"]
        print(f"# {side}: audio s per request {per:.3f}{extra}")
    print_table(results)
    report_cpu(raw, results)
    if args.json:
        common.write_json(args.json, args, {"raw": raw, "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
