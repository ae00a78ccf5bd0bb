"""Speech in: the real-time factor of ``POST /v1/audio/transcriptions`` (seconds of audio
per second of wall time) on Piper speech of ~5 s and ~20 s, one client and two.

Serves a two-stage pipeline of its own, the voice pipeline's talker and listener (no
thinker: a transcription never reaches it, and it would only take memory), with the
listener's engine args from --listener-args. The speech is synthesized by that talker
first (``/v1/audio/speech``, WAV); each client then uploads it again and again, one
request at a time, after a warm-up. Per request: latency and audio seconds / latency;
per run: all audio seconds / the run's wall time (what the replica gets through).
"""

import argparse
import json
import re
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import common
import httpx
from common import HOST, ServerProcess, free_port

TEXTS = {
    "5 s": "The quick brown fox jumps over the lazy dog. Please call me tomorrow morning.",
    "20 s": (
        "The head keeps a table of every replica it knows. A replica registers, gets an "
        "id, and sends a heartbeat every second. When heartbeats stop, the head marks it "
        "as down and sends its work elsewhere. Clients never notice, because each request "
        "is retried on another replica of the same stage, from where it stopped."
    ),
}

PIPELINE = """\
pipeline: asr-bench
stages:
  - stage_id: 0
    name: talker
    engine: tts
    final_output: true
    output_modality: audio
  - stage_id: 1
    name: listener
    engine: asr
    engine_args: {engine_args}
    prompt_modalities: [audio]
    final_output: true
    output_modality: text
"""


def words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9']+", text.lower())


def transcribe(client: httpx.Client, wav: bytes) -> tuple[float, str]:
    t0 = time.perf_counter()
    r = client.post("/v1/audio/transcriptions", files={"file": ("speech.wav", wav)})
    r.raise_for_status()
    return time.perf_counter() - t0, r.json()["text"]


def run(
    url: str, wav: bytes, clients: int, per_client: int, timeout: float
) -> tuple[list[float], float, str]:
    """(each request's latency, the run's wall time, one transcript)."""
    latencies: list[float] = []
    heard: list[str] = []
    errors: list[BaseException] = []

    def client_loop() -> None:
        try:
            with httpx.Client(base_url=url, timeout=timeout) as c:
                for _ in range(per_client):
                    seconds, text = transcribe(c, wav)
                    latencies.append(seconds)
                    heard.append(text)
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=client_loop) for _ in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise RuntimeError(common.describe(errors[0], timeout))
    return latencies, wall, heard[0]


def listener_rss_mb(client: httpx.Client) -> tuple[float, float]:
    """The listener replica's resident memory now and at its peak (VmRSS, VmHWM), MB."""
    stages = client.get("/v1/omni/stages").json()["stages"]
    pid = next(s for s in stages if s["name"] == "listener")["replicas"][0]["pid"]
    status = Path(f"/proc/{pid}/status").read_text()
    kb = {k: int(v.split()[0]) for k, v in re.findall(r"^(VmRSS|VmHWM):\s+(.*)$", status, re.M)}
    return kb["VmRSS"] / 1024, kb["VmHWM"] / 1024


def main() -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--requests", type=int, default=6, help="measured requests per client")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 2])
    p.add_argument(
        "--listener-args",
        default="{}",
        help="the listener's engine_args as JSON, e.g. '{\"beam_size\": 5}'",
    )
    common.add_common_args(p, health_timeout=120.0, request_timeout=300.0)
    args = p.parse_args()
    engine_args = json.loads(args.listener_args)
    with open("/proc/loadavg") as f:
        load = " ".join(f.read().split()[:3])
    print(f"{common.machine()}; load {load}; listener args {engine_args or 'defaults'}")
    common.exit_on_sigterm()
    port = free_port()
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        f.write(PIPELINE.format(engine_args=json.dumps(engine_args)))
    cmd = [sys.executable, "-m", "omnistage", "serve", f.name, "--host", HOST, "--port", str(port)]
    server = ServerProcess("asr-bench", [*cmd, "--log-level", "WARNING"], port)
    rows: list[dict[str, Any]] = []
    try:
        server.wait_ready(args.health_timeout)
        url = f"http://{HOST}:{port}"
        with httpx.Client(base_url=url, timeout=args.request_timeout) as c:
            for label, text in TEXTS.items():
                speech = {"input": text, "voice": "joe", "response_format": "wav"}
                wav = c.post("/v1/audio/speech", json=speech).content
                audio_s = (len(wav) - 44) / 2 / 24000
                transcribe(c, wav)  # warm-up
                for clients in args.concurrency:
                    lat, wall, heard = run(url, wav, clients, args.requests, args.request_timeout)
                    said = set(words(text))
                    rows.append(
                        {
                            "audio": label,
                            "audio_s": round(audio_s, 2),
                            "clients": clients,
                            "requests": len(lat),
                            "latency_median_s": statistics.median(lat),
                            "rtf_per_request": audio_s / statistics.median(lat),
                            "rtf_aggregate": audio_s * len(lat) / wall,
                            "words_missed": len(said - set(words(heard))),
                            "heard": heard,
                        }
                    )
            rss, peak = listener_rss_mb(c)
    finally:
        server.stop()
        Path(f.name).unlink(missing_ok=True)
    print(
        f"\n{'audio':>6} {'c':>2} {'reqs':>5} {'latency p50':>12} "
        f"{'RTF/request':>12} {'RTF all':>8} {'words missed':>13}"
    )
    for r in rows:
        print(
            f"{r['audio_s']:5.1f}s {r['clients']:>2} {r['requests']:>5} "
            f"{r['latency_median_s'] * 1000:9.0f} ms {r['rtf_per_request']:11.1f}x "
            f"{r['rtf_aggregate']:7.1f}x {r['words_missed']:>13}"
        )
    print(f"listener replica RSS {rss:.0f} MB now, {peak:.0f} MB at its peak")
    for label, text in TEXTS.items():
        heard = next(r["heard"] for r in rows if r["audio"] == label)
        print(f"{label} said: {text}\n{label} heard: {heard}")
    if args.json:
        common.write_json(args.json, args, {"rows": rows, "listener_rss_mb": [rss, peak]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
