"""GPU check of the staged Qwen2.5-Omni: thinker -> talker -> token2wav on one GPU.

Builds the tests' tiny random-weight Qwen2.5-Omni (tests/omni_tiny.py) in a temporary
directory, serves it with ``omnistage serve DIR`` (the pipeline the checkpoint picks)
with every stage's ``device`` set to ``--device``, and ``dtype`` left at ``auto``:
bfloat16 for the thinker and the talker on cuda (float32 on the CPU), token2wav always
float32. Then it checks where each stage's replica computes (its ``kernel`` in
/v1/omni/stages, read from its weights: e.g. ``cuda:0 bfloat16``), sends streamed spoken
chats one after another and a text-only chat, and prints the time to first audio.

Needs nothing from the network (the checkpoint and its tokenizer are built here; the
processes run with HF_HUB_OFFLINE=1). Exits 1 on any failure: no cuda, a stage on
another device or dtype, a request that fails or brings no audio.

    python bench/gpu_omni_check.py                  # on cuda
    python bench/gpu_omni_check.py --device cpu     # the same check on the CPU
    python bench/gpu_omni_check.py --device cpu --dtype bfloat16   # cuda's dtypes, on the CPU
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path
from typing import Any

import common
import httpx
from bench_omni import stream_chat
from common import HOST, ServerProcess, free_port

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # for tests.*

from tests.omni_tiny import build_tiny_omni


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu")
    p.add_argument(
        "--dtype",
        default="auto",
        help="the thinker's and the talker's (auto: bfloat16 on cuda, float32 on the CPU); "
        "--device cpu --dtype bfloat16 runs the cuda path's dtypes on the CPU",
    )
    p.add_argument("--width", type=int, default=64, help="LM hidden width (thinker, talker)")
    p.add_argument("--layers", type=int, default=2, help="LM layers (thinker, talker)")
    p.add_argument("--max-tokens", type=int, default=8, help="the thinker's answer")
    p.add_argument("--max-codes", type=int, default=48, help="the talker's codes")
    p.add_argument("--requests", type=int, default=4, help="spoken chats; the first warms up")
    common.add_common_args(p, health_timeout=300, request_timeout=120)
    return p.parse_args(argv)


def expected(device: str, dtype: str) -> dict[str, str]:
    """Each stage's ``kernel``: where its weights are and in which dtype."""
    where = "cuda:0" if device == "cuda" else device
    half = dtype if dtype != "auto" else "bfloat16" if where.startswith("cuda") else "float32"
    return {
        "thinker": f"{where} {half}",
        "talker": f"{where} {half}",
        "token2wav": f"{where} float32",
    }


def preflight(device: str) -> str:
    """torch's version and the device's name; SystemExit(1) if cuda is asked and absent."""
    import torch

    if not device.startswith("cuda"):
        return f"torch {torch.__version__}, device cpu"
    if not torch.cuda.is_available():
        raise SystemExit(f"FAIL: --device {device} but torch {torch.__version__} sees no cuda")
    index = torch.device(device).index or 0
    name = torch.cuda.get_device_name(index)
    return f"torch {torch.__version__} (cuda {torch.version.cuda}), {name}"


def start_head(args: argparse.Namespace, directory: Path) -> ServerProcess:
    on = {"device": args.device, "dtype": args.dtype}
    overrides = {
        "0": {"engine_args": on},
        "1": {"engine_args": {**on, "do_sample": False, "max_new_tokens": args.max_codes}},
        "2": {"engine_args": {"device": args.device}},
    }
    port = free_port()
    cmd = [sys.executable, "-m", "omnistage", "serve", str(directory), "--host", HOST]
    cmd += ["--port", str(port), "-oma", HOST, "-omp", str(free_port())]
    cmd += ["--stage-overrides", json.dumps(overrides)]
    return ServerProcess("omnistage", cmd, port, pdeathsig=True)


def _get(port: int, path: str) -> Any:
    with urllib.request.urlopen(f"http://{HOST}:{port}{path}", timeout=10) as resp:
        return json.loads(resp.read())


def placements(port: int) -> dict[str, list[tuple[int, str]]]:
    """Per stage name: (pid, kernel) of each replica."""
    stages = _get(port, "/v1/omni/stages")["stages"]
    return {
        s["name"]: [(int(r["pid"]), str(r.get("kernel", ""))) for r in s["replicas"]]
        for s in stages
    }


def text_chat(port: int, model: str, args: argparse.Namespace) -> str:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Hello"}],
        "temperature": 0,
        "max_tokens": args.max_tokens,
    }
    url = f"http://{HOST}:{port}/v1/chat/completions"
    response = httpx.post(url, json=body, timeout=args.request_timeout)
    if response.status_code != 200:
        raise RuntimeError(f"text chat: HTTP {response.status_code} {response.text}")
    return str(response.json()["choices"][0]["message"]["content"])


def gpu_memory() -> dict[int, str]:
    """nvidia-smi's used memory per compute process pid (empty without nvidia-smi)."""
    if not shutil.which("nvidia-smi"):
        return {}
    query = ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader"]
    out = subprocess.run(query, capture_output=True, text=True, timeout=30).stdout
    rows = (line.split(",") for line in out.splitlines() if "," in line)
    return {int(pid): used.strip() for pid, used in rows}


def check(server: ServerProcess, args: argparse.Namespace) -> list[str]:
    """The failures found (empty: all good); prints what ran where and the timings."""
    port, failures = server.port or 0, []
    want = expected(args.device, args.dtype)
    used = gpu_memory()
    for name, replicas in placements(port).items():
        for pid, kernel in replicas:
            memory = f", GPU memory {used[pid]}" if pid in used else ""
            print(f"{name}: replica pid {pid} computes on {kernel or '?'}{memory}")
            if kernel != want.get(name):
                failures.append(f"{name} on {kernel!r}, expected {want.get(name)!r}")
    model = _get(port, "/v1/models")["data"][0]["id"]
    timings = []
    with httpx.Client() as client:
        for i in range(args.requests):
            chat = stream_chat(client, port, model, "Tell me about the sea.", args)
            label = "warm-up" if i == 0 else f"request {i}"
            print(
                f"{label}: first audio {chat['ttfa'] * 1000:.0f} ms, "
                f"end {chat['end'] * 1000:.0f} ms, {chat['samples']} samples"
            )
            if i:
                timings.append(chat["ttfa"])
    if timings:
        print(
            f"time to first audio, median of {len(timings)}: "
            f"{statistics.median(timings) * 1000:.0f} ms"
        )
    print(f"text-only chat (thinker alone): {text_chat(port, model, args)!r}")
    return failures


def main() -> int:
    args = parse_args()
    common.exit_on_sigterm()
    os.environ.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")  # the replicas inherit it
    print(preflight(args.device))
    with tempfile.TemporaryDirectory(prefix="gpu-omni-") as tmp:
        directory = build_tiny_omni(
            Path(tmp) / "qwen2.5-omni-tiny", width=args.width, layers=args.layers
        )
        print(
            f"checkpoint: LM width {args.width}, {args.layers} layers; "
            f"{args.max_tokens} answer tokens, {args.max_codes} codes"
        )
        server = start_head(args, directory)
        try:
            server.wait_ready(args.health_timeout)
            failures = check(server, args)
        except Exception as exc:
            failures = [common.describe(exc)]
        finally:
            tail = server.log_tail(3000)
            server.stop()
    if failures:
        print("FAIL:\n  " + "\n  ".join(failures) + tail)
        return 1
    print(f"PASS: staged Qwen2.5-Omni on {args.device} (dtype {args.dtype})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
