"""llama.cpp as the reference beside the thinker: build it once, run its own benchmarks.

The copy built is the one vendored in llama-cpp-python's sdist from PyPI (``pip download``
fetches it; a pinned version, so the figures name what they measured). Builds are cached
under ~/.cache/omnistage/llama.cpp/<kind> and reused. Two kinds: ``native`` (-march=native)
and ``native-noamx`` (the same without AMX). On an AMX Xeon the native build decodes one
sequence fastest but dies with SIGILL on any batch above one, so there both are built and
c=1 takes the faster build that runs, c=8 the one that batches; elsewhere ``native`` is
the only one (it has no AMX to drop).
"""

import json
import os
import re
import signal
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

VERSION = "0.3.36"  # llama-cpp-python, whose sdist vendors llama.cpp
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "omnistage" / "llama.cpp"
TOOLS = ("llama-bench", "llama-batched-bench")
NO_AMX = "-mno-amx-int8 -mno-amx-tile -mno-amx-bf16"
TARGET_C1 = 1.0  # thinker / llama.cpp decode tok/s, one sequence
TARGET_C8 = 2.5  # and eight at once


def has_amx() -> bool:
    with open("/proc/cpuinfo") as f:
        return any(line.startswith("flags") and " amx_" in line for line in f)


def kinds() -> list[str]:
    """The builds this CPU needs: the AMX-free one, and the plain one where AMX exists."""
    return ["native", "native-noamx"] if has_amx() else ["native"]


def binary(kind: str, tool: str) -> Path:
    return CACHE / kind / "build" / "bin" / tool


def built(kind: str) -> bool:
    return all(binary(kind, t).exists() for t in TOOLS)


def source(log: Path) -> Path:
    """vendor/llama.cpp of the sdist, unpacked once into the cache."""
    src = CACHE / "src" / f"llama_cpp_python-{VERSION}" / "vendor" / "llama.cpp"
    if (src / "CMakeLists.txt").exists():
        return src
    (CACHE / "src").mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp, log.open("a") as out:
        cmd = [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps"]
        cmd += [f"llama-cpp-python=={VERSION}", "-d", tmp]
        subprocess.run(cmd, check=True, stdout=out, stderr=subprocess.STDOUT)
        (sdist,) = Path(tmp).glob("*.tar.gz")
        with tarfile.open(sdist) as tar:
            tar.extractall(CACHE / "src", filter="data")
    return src


def build(kind: str) -> None:
    """Build the two tools of ``kind`` unless cached; ~6 min on 2 cores. The log is
    <cache>/<kind>/build.log."""
    if built(kind):
        return
    root = CACHE / kind
    root.mkdir(parents=True, exist_ok=True)
    log = root / "build.log"
    src = source(log)
    flags = NO_AMX if kind == "native-noamx" else ""
    configure = ["cmake", "-S", str(src), "-B", str(root / "build"), "-DCMAKE_BUILD_TYPE=Release"]
    configure += ["-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF"]
    configure += [f"-DCMAKE_C_FLAGS={flags}", f"-DCMAKE_CXX_FLAGS={flags}"]
    make = ["cmake", "--build", str(root / "build"), "--config", "Release"]
    make += ["-j", str(os.cpu_count() or 1), "--target", *TOOLS]
    print(f"building llama.cpp ({kind}) into {root} (log: {log}) ...", flush=True)
    with log.open("a") as out:
        for cmd in (configure, make):
            subprocess.run(cmd, check=True, stdout=out, stderr=subprocess.STDOUT)


@dataclass
class Figure:
    kind: str  # the build that gave it
    tok_s: float | None
    error: str | None = None


def run(cmd: list[str], timeout: float) -> tuple[str, str]:
    """Run a tool: its stdout and stderr, or an error naming a signal (SIGILL: the AMX
    build at a batch above one)."""
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if done.returncode < 0:
        name = signal.Signals(-done.returncode).name
        raise RuntimeError(f"{Path(cmd[0]).name} died with {name}")
    if done.returncode != 0:
        tail = done.stderr.strip()[-300:]
        raise RuntimeError(f"{Path(cmd[0]).name}: rc {done.returncode}: {tail}")
    return done.stdout, done.stderr


def decode_c1(kind: str, gguf: str, threads: int, tokens: int, timeout: float) -> Figure:
    """llama-bench tg: one sequence's decode tokens/s."""
    cmd = [str(binary(kind, "llama-bench")), "-m", gguf, "-t", str(threads), "-p", "0"]
    cmd += ["-n", str(tokens), "-r", "3", "-o", "json"]
    try:
        rows = json.loads(run(cmd, timeout)[0])
        return Figure(kind, float(rows[0]["avg_ts"]))
    except Exception as exc:
        return Figure(kind, None, str(exc))


def decode_batched(
    kind: str, gguf: str, threads: int, batch: int, prompt: int, tokens: int, timeout: float
) -> Figure:
    """llama-batched-bench: ``batch`` sequences decoding together, total tokens/s of the
    generation phase (S_TG)."""
    cmd = [str(binary(kind, "llama-batched-bench")), "-m", gguf, "-t", str(threads)]
    cmd += ["-c", str(batch * (prompt + tokens) + 64), "-b", "2048", "-ub", "512"]
    cmd += [
        "-npp",
        str(prompt),
        "-ntg",
        str(tokens),
        "-npl",
        str(batch),
        "--output-format",
        "jsonl",
    ]
    try:
        out = "\n".join(run(cmd, timeout))
        rows = [json.loads(ln) for ln in out.splitlines() if ln.startswith("{")]
        if rows:
            return Figure(kind, float(rows[-1]["speed_tg"]))
        # Older text table: | PP | TG | B | N_KV | T_PP s | S_PP t/s | T_TG s | S_TG t/s | ...
        cells = [ln.split("|") for ln in out.splitlines() if re.match(r"\|\s+\d", ln)]
        return Figure(kind, float(cells[-1][8]))
    except Exception as exc:
        return Figure(kind, None, str(exc))


@dataclass
class Reference:
    """llama.cpp on the thinker's GGUF: c=1 from the fastest build that runs one
    sequence, c=8 from the fastest that batches; ``tried``: every build's figures."""

    gguf: str
    threads: int
    c1: Figure | None = None
    c8: Figure | None = None
    tried: list[tuple[str, Figure]] = field(default_factory=list)  # ("c=1" / "c=8", figure)
    error: str | None = None


def measure(
    gguf: str, threads: int, batch: int, prompt: int, tokens: int, timeout: float = 600.0
) -> Reference:
    """Build what this CPU needs (cached), then both figures with each build."""
    ref = Reference(gguf, threads)
    try:
        for kind in kinds():
            build(kind)
    except Exception as exc:
        ref.error = f"build failed: {exc} (log: {CACHE}/<kind>/build.log)"
        return ref
    for kind in kinds():
        ref.tried.append(("c=1", decode_c1(kind, gguf, threads, tokens, timeout)))
        batched = decode_batched(kind, gguf, threads, batch, prompt, tokens, timeout)
        ref.tried.append((f"c={batch}", batched))
    ok = [(level, f) for level, f in ref.tried if f.tok_s]
    ref.c1 = max((f for level, f in ok if level == "c=1"), key=_speed, default=None)
    ref.c8 = max((f for level, f in ok if level != "c=1"), key=_speed, default=None)
    return ref


def _speed(f: Figure) -> float:
    return f.tok_s or 0.0


def report(
    ref: Reference, thinker: str, c1: float | None, c8: float | None, batch: int
) -> list[tuple[str, float | None, float]]:
    """Print llama.cpp beside the thinker's decode tok/s (``c1``, ``c8``: None where not
    measured); the goals (name, thinker/llama.cpp, bound)."""
    print(f"\n=== llama.cpp {VERSION} (llama-cpp-python's vendored copy) on {Path(ref.gguf).name}")
    print(f"    {ref.threads} threads, as the thinker; builds in {CACHE}")
    if ref.error:
        print(f"  ! {ref.error}")
    for level, f in ref.tried:
        shown = f"{f.tok_s:8.1f} tok/s" if f.tok_s else f"! {(f.error or '')[:120]}"
        tool = "llama-bench tg" if level == "c=1" else "llama-batched-bench S_TG"
        print(f"  {f.kind:<13} {level:<4} {tool:<25} {shown}")
    out = []
    for level, mine, theirs, bound in (
        ("c=1", c1, ref.c1, TARGET_C1),
        (f"c={batch}", c8, ref.c8, TARGET_C8),
    ):
        ratio = mine / theirs.tok_s if mine and theirs and theirs.tok_s else None
        build = theirs.kind if theirs else "no build ran"
        print(
            f"  {level}: {thinker} {mine or 0:.1f} tok/s, llama.cpp ({build}) "
            f"{theirs.tok_s if theirs and theirs.tok_s else 0:.1f} tok/s: "
            f"{'n/a' if ratio is None else f'{ratio:.2f}x'}"
        )
        out.append((f"{thinker} / llama.cpp decode tok/s at {level} >= {bound}", ratio, bound))
    return out
