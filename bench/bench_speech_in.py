"""Speech in, speech out on the default ``voice`` pipeline: time to first audio for a
spoken question (listener -> thinker -> talker) side by side with the same question
typed (thinker -> talker), so the listener's share of the latency shows.

The question is spoken by the pipeline's own Piper voice first (``/v1/audio/speech``,
WAV); each run then streams a chat with ``modalities: ["text", "audio"]``. One request
at a time, alternating typed and spoken, after a warm-up of each. See README.md.
"""

import argparse
import base64
import json
import statistics
import sys
import time
from typing import Any

import common
import httpx
from common import HOST, ServerProcess, free_port

QUESTION = "What is the capital of France? Answer in one sentence."


def chat_body(question: str, audio: bytes | None) -> dict[str, Any]:
    content: Any = question
    if audio is not None:
        data = base64.b64encode(audio).decode()
        content = [{"type": "input_audio", "input_audio": {"data": data, "format": "wav"}}]
    return {
        "messages": [{"role": "user", "content": content}],
        "modalities": ["text", "audio"],
        "audio": {"voice": "joe", "format": "pcm16"},
        "stream": True,
        "temperature": 0,
        "max_tokens": 40,
    }


def first_audio(client: httpx.Client, body: dict[str, Any]) -> tuple[float, float, str]:
    """(seconds to the first transcript piece, to the first audio bytes, the words)."""
    t0 = time.perf_counter()
    words, first_word, first_sound = "", None, None
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            for choice in json.loads(line[6:])["choices"]:
                audio = choice["delta"].get("audio") or {}
                if audio.get("transcript"):
                    words += audio["transcript"]
                    first_word = first_word or time.perf_counter() - t0
                if audio.get("data") and first_sound is None:
                    first_sound = time.perf_counter() - t0
    if first_word is None or first_sound is None:
        raise RuntimeError(f"no words or no audio in the stream ({words!r})")
    return first_word, first_sound, words


def main() -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--requests", type=int, default=5, help="measured requests per mode")
    common.add_common_args(p, health_timeout=300.0, request_timeout=300.0)
    args = p.parse_args()
    print(f"{common.machine()}; {args.requests} requests per mode, c=1", flush=True)
    common.exit_on_sigterm()
    port = free_port()
    cmd = [sys.executable, "-m", "omnistage", "serve", "voice", "--host", HOST]
    server = ServerProcess("voice", [*cmd, "--port", str(port), "--log-level", "WARNING"], port)
    try:
        server.wait_ready(args.health_timeout)
        with httpx.Client(base_url=f"http://{HOST}:{port}", timeout=args.request_timeout) as c:
            speech = {"input": QUESTION, "voice": "joe", "response_format": "wav"}
            wav = c.post("/v1/audio/speech", json=speech).content
            spoken_s = (len(wav) - 44) / 2 / 24000
            bodies = {"typed": chat_body(QUESTION, None), "spoken": chat_body(QUESTION, wav)}
            times: dict[str, list[tuple[float, float]]] = {m: [] for m in bodies}
            said: dict[str, str] = {}
            for body in bodies.values():  # warm-up
                first_audio(c, body)
            for _ in range(args.requests):
                for mode, body in bodies.items():
                    word, sound, said[mode] = first_audio(c, body)
                    times[mode].append((word, sound))
    finally:
        server.stop()
    print(f"\nthe question as speech: {spoken_s:.2f} s of audio")
    print(f"{'input':8} {'first word (median)':>20} {'first audio (median)':>21}  answer")
    for mode, rows in times.items():
        word = statistics.median(r[0] for r in rows)
        sound = statistics.median(r[1] for r in rows)
        print(f"{mode:8} {word * 1000:17.0f} ms {sound * 1000:18.0f} ms  {said[mode].strip()!r}")
    extra = statistics.median(r[1] for r in times["spoken"]) - statistics.median(
        r[1] for r in times["typed"]
    )
    print(f"listening adds {extra * 1000:.0f} ms to the first audio")
    if args.json:
        rows = {
            m: [{"first_word_s": w, "first_audio_s": a} for w, a in r] for m, r in times.items()
        }
        common.write_json(args.json, args, {"spoken_s": spoken_s, "runs": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
