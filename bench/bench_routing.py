"""Cache-aware routing: a multi-turn chat workload on several thinker replicas, per policy.

``--conversations`` chats of ``--turns`` turns each share one system prompt; each turn
sends the whole conversation so far (as chat clients do), ``--concurrency`` conversations
at a time, with a seeded random pause between a chat's turns (``--think-ms``: without it
closed-loop chats move in lockstep, and least-queue-length sends each turn back to the
replica that just finished its previous one, by accident). For each balancing policy
(cache-aware, least-queue-length, round-robin) and for one replica alone, a fresh head
serves the same workload, and the run reports:

- the cached share of the later turns' prompt tokens (usage ``cached_tokens`` over
  ``prompt_tokens``, turns 2 and on), as the replicas' prefix caches report it;
- time to first token p50/p90 over the later turns (``--long-from`` and on: the turns
  whose history is long enough for the cache to matter);
- the busiest replica's share of the requests against the mean (the 1.5x bound).

``--engine echo`` (the default) runs echo replicas with a simulated prefix cache
(``prefix_cache_entries``) whose prefill costs ``--prefill-ms-per-char`` per uncached
character: "echo-timed" replicas, so 4 replicas fit a 2-core machine. ``--engine llm``
runs the real SmolLM2 thinker of the default pipeline (text only), 2 replicas by
default; its usage reports the tokens its prefix cache served.
"""

import argparse
import json
import random
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import common
import httpx
from common import HOST, ServerProcess, free_port

SYSTEM = (
    "You are a patient assistant for a shop that sells bicycles, spare parts and "
    "repairs. Answer in one or two short sentences, politely, and never invent prices. "
    "The shop opens at nine and closes at six, every day but Sunday. "
) * 3
TOPICS = ("brakes", "tyres", "chains", "lights", "saddles", "gears", "pumps", "locks")


@dataclass
class Turn:
    conversation: int
    turn: int
    ttft_s: float
    prompt_tokens: int
    cached_tokens: int


@dataclass
class Run:
    label: str
    turns: list[Turn] = field(default_factory=list)
    dispatched: list[int] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    wall_s: float = 0.0


def _user(conversation: int, turn: int) -> str:
    topic = TOPICS[(conversation + turn) % len(TOPICS)]
    return (
        f"Conversation {conversation}, question {turn}: I ride to work every day and my "
        f"{topic} feel worn. What should I check first, and how often?"
    )


def _ask(client: httpx.Client, model: str, messages: list[dict], max_tokens: int) -> tuple:
    """One streamed chat turn: (answer, ttft_s, prompt_tokens, cached_tokens)."""
    body = {
        "model": model,
        "messages": messages,
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    started, first, text, usage = time.perf_counter(), None, [], {}
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            for choice in event.get("choices") or []:
                delta = choice.get("delta", {}).get("content")
                if delta:
                    if first is None:
                        first = time.perf_counter() - started
                    text.append(delta)
            if event.get("usage"):
                usage = event["usage"]
    details = usage.get("prompt_tokens_details") or {}
    ttft = first if first is not None else time.perf_counter() - started
    return "".join(text), ttft, usage.get("prompt_tokens", 0), details.get("cached_tokens", 0)


def _conversation(
    client: httpx.Client, model: str, n: int, args: argparse.Namespace, run: Run
) -> None:
    messages: list[dict] = [{"role": "system", "content": SYSTEM}]
    # A user reads and types between turns: seeded, so every policy sees the same pauses.
    pauses = random.Random(n)
    for turn in range(1, args.turns + 1):
        if turn > 1 and args.think_ms:
            time.sleep(pauses.uniform(0, 2 * args.think_ms) / 1000)
        messages.append({"role": "user", "content": _user(n, turn)})
        try:
            answer, ttft, prompt, cached = _ask(client, model, messages, args.max_tokens)
        except (httpx.HTTPError, OSError) as exc:
            run.errors.append(common.describe(exc))
            return
        run.turns.append(Turn(n, turn, ttft, prompt, cached))
        messages.append({"role": "assistant", "content": answer})


def _workload(port: int, model: str, args: argparse.Namespace, run: Run) -> None:
    todo = list(range(args.conversations))
    lock = threading.Lock()

    def worker() -> None:
        with httpx.Client(base_url=f"http://{HOST}:{port}", timeout=args.request_timeout) as c:
            while True:
                with lock:
                    if not todo:
                        return
                    n = todo.pop(0)
                _conversation(c, model, n, args, run)

    started = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(args.concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    run.wall_s = time.perf_counter() - started


def _serve(args: argparse.Namespace, replicas: int, policy: str) -> tuple[ServerProcess, int]:
    port = free_port()
    if args.engine == "echo":
        engine_args = {
            "num_chunks": 4,
            "suffix": "",
            "prefix_cache_entries": args.cache_entries,
            "prefill_ms_per_char": args.prefill_ms_per_char,
            "chunk_delay_s": args.chunk_delay,
        }
        overrides = {"0": {"replicas": replicas, "engine_args": engine_args}}
        pipeline = "echo-1stage"
    else:
        # The thinker; text-only turns.
        overrides = {"0": {"replicas": replicas}}
        if args.cache_tokens is not None:
            overrides["0"]["engine_args"] = {"prefix_cache_tokens": args.cache_tokens}
        pipeline = "voice"
    cmd = [sys.executable, "-m", "omnistage", "serve", pipeline, "--host", HOST]
    cmd += ["--port", str(port), "--omni-lb-policy", policy]
    cmd += ["--stage-overrides", json.dumps(overrides)]
    server = ServerProcess(f"{pipeline} x{replicas} {policy}", cmd, port)
    server.wait_ready(args.health_timeout)
    return server, port


def _dispatched(port: int) -> list[int]:
    stages = httpx.get(f"http://{HOST}:{port}/v1/omni/stages", timeout=10).json()["stages"]
    return [r["dispatched_total"] for r in stages[0]["replicas"] if r["state"] == "UP"]


def measure(args: argparse.Namespace, label: str, replicas: int, policy: str) -> Run:
    run = Run(label)
    server, port = _serve(args, replicas, policy)
    try:
        model = "echo-1stage" if args.engine == "echo" else "voice"
        _workload(port, model, args, run)
        run.dispatched = _dispatched(port)
    finally:
        server.stop()
    return run


def summary(run: Run, long_from: int) -> dict[str, Any]:
    later = [t for t in run.turns if t.turn >= 2]
    long = sorted(t.ttft_s for t in run.turns if t.turn >= long_from)
    prompt = sum(t.prompt_tokens for t in later)
    cached = sum(t.cached_tokens for t in later)
    mean = statistics.mean(run.dispatched) if run.dispatched else 0
    return {
        "label": run.label,
        "cached_share": cached / prompt if prompt else 0.0,
        "ttft_p50_ms": 1000 * common.pct(long, 50) if long else None,
        "ttft_p90_ms": 1000 * common.pct(long, 90) if long else None,
        "max_over_mean": max(run.dispatched) / mean if mean else None,
        "dispatched": run.dispatched,
        "turns": len(run.turns),
        "errors": len(run.errors),
        "wall_s": run.wall_s,
    }


def _print(rows: list[dict[str, Any]]) -> None:
    print(
        f"{'':28} {'cached share':>12} {'TTFT p50':>9} {'TTFT p90':>9} "
        f"{'max/mean':>8} {'turns':>5} {'err':>3}  requests per replica"
    )
    for r in rows:
        p50 = f"{r['ttft_p50_ms']:.0f}ms" if r["ttft_p50_ms"] is not None else "-"
        p90 = f"{r['ttft_p90_ms']:.0f}ms" if r["ttft_p90_ms"] is not None else "-"
        ratio = f"{r['max_over_mean']:.2f}" if r["max_over_mean"] is not None else "-"
        print(
            f"{r['label']:28} {r['cached_share']:12.2f} {p50:>9} {p90:>9} {ratio:>8} "
            f"{r['turns']:5d} {r['errors']:3d}  {r['dispatched']}"
        )


def _verdict(rows: list[dict[str, Any]]) -> None:
    by = {r["label"].split(" ")[0]: r for r in rows}
    aware = by.get("cache-aware")
    others = [r for k, r in by.items() if k != "cache-aware"]
    if aware is None or not others:
        return
    best = max(r["cached_share"] for r in others)
    lql = by.get("least-queue-length")
    print(
        f"cache-aware cached share / best other: {aware['cached_share'] / best:.2f}x "
        f"(target >= 1.2x)"
        if best
        else "no other policy cached anything"
    )
    if lql and lql["ttft_p50_ms"] and aware["ttft_p50_ms"]:
        cut = 1 - aware["ttft_p50_ms"] / lql["ttft_p50_ms"]
        print(f"TTFT p50 vs least-queue-length: {cut:+.0%} lower (target >= 30%)")
    if aware["max_over_mean"] is not None:
        print(f"busiest replica: {aware['max_over_mean']:.2f}x the mean (target <= 1.5x)")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", choices=("echo", "llm"), default="echo")
    p.add_argument(
        "--replicas", type=int, nargs="+", default=None, help="default: 2 4 (echo), 2 (llm)"
    )
    p.add_argument("--conversations", type=int, default=16)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--concurrency", type=int, default=8, help="conversations at a time")
    p.add_argument("--long-from", type=int, default=4, help="TTFT over turns from this one on")
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument(
        "--think-ms", type=float, default=100.0, help="mean pause between a chat's turns"
    )
    p.add_argument("--cache-entries", type=int, default=64, help="echo: prefixes kept")
    p.add_argument(
        "--cache-tokens",
        type=int,
        default=None,
        help="llm: prefix_cache_tokens per replica (default: the engine's)",
    )
    p.add_argument("--prefill-ms-per-char", type=float, default=0.05)
    p.add_argument("--chunk-delay", type=float, default=0.005, help="echo: s per chunk")
    p.add_argument(
        "--policies",
        nargs="+",
        default=["cache-aware", "least-queue-length", "round-robin"],
    )
    common.add_common_args(p, health_timeout=300.0, request_timeout=120.0)
    args = p.parse_args()
    common.exit_on_sigterm()
    replicas = args.replicas or ([2, 4] if args.engine == "echo" else [2])
    print(
        f"{common.machine()}; {args.engine} replicas; {args.conversations} conversations x "
        f"{args.turns} turns, {args.concurrency} at a time, one shared system prompt",
        flush=True,
    )
    sections: dict[str, Any] = {}
    for n in replicas:
        rows = [summary(measure(args, "one replica", 1, "round-robin"), args.long_from)]
        for policy in args.policies:
            rows.append(summary(measure(args, f"{policy} x{n}", n, policy), args.long_from))
        print(f"\n{n} replicas:")
        _print(rows)
        _verdict(rows)
        sections[f"replicas_{n}"] = rows
    if args.json:
        common.write_json(args.json, args, sections)
    # A conversation whose turn failed stops there: its policy's figures lack its turns.
    if errors := sum(r["errors"] for rows in sections.values() for r in rows):
        print(f"! {errors} conversation(s) stopped by a failed turn")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
