"""Chaos: kill -9 replicas of every stage under steady load; no request may suffer.

Three echo stages, two local replicas each, requests that each take a few hundred
milliseconds to stream through. A killer SIGKILLs a random replica of a stage that has
two UP (so one always survives) about every second; the head restarts it. Every
request, streamed or not, must end with exactly the output of a run without failures:
nothing missing, nothing twice.
"""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from tests.integration.harness import HeadProc

SHAPE = json.dumps(
    {
        "0": {"replicas": 2, "engine_args": {"num_chunks": 8, "chunk_delay_s": 0.02}},
        "1": {"replicas": 2, "engine_args": {"chunk_delay_s": 0.01}},
        "2": {"replicas": 2, "engine_args": {"chunk_delay_s": 0.01}},
    }
)


@dataclass
class Tally:
    ok: int = 0
    streamed_ok: int = 0
    wrong: list[str] = field(default_factory=list)


def _expected(text: str) -> str:
    return f"{text} [thinker] [talker] [vocoder]"


def _one_plain(client: httpx.Client, text: str, tally: Tally) -> None:
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": text}]})
    if r.status_code != 200:
        tally.wrong.append(f"{text}: {r.status_code} {r.text[:300]}")
        return
    content = r.json()["choices"][0]["message"]["content"]
    if content != _expected(text):
        tally.wrong.append(f"{text}: got {content!r}")
        return
    tally.ok += 1


def _one_streamed(client: httpx.Client, text: str, tally: Tally) -> None:
    body = {"messages": [{"role": "user", "content": text}], "stream": True}
    pieces: list[str] = []
    done = False
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            tally.wrong.append(f"{text}: {r.status_code} {r.read()[:300]!r}")
            return
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            payload = line[len("data: ") :]
            if payload == "[DONE]":
                done = True
                break
            event = json.loads(payload)
            if "error" in event:
                tally.wrong.append(f"{text}: in-stream error {event['error']}")
                return
            for choice in event.get("choices", []):
                pieces.append(choice.get("delta", {}).get("content") or "")
    got = "".join(pieces)
    if not done or got != _expected(text):
        tally.wrong.append(f"{text}: streamed {got!r} (done={done})")
        return
    tally.streamed_ok += 1


def _load(url: str, stop: threading.Event, tally: Tally, worker: int) -> None:
    with httpx.Client(base_url=url, timeout=30) as client:
        i = 0
        while not stop.is_set():
            i += 1
            text = f"worker {worker} request {i} " + "lorem ipsum " * (i % 4)
            if i % 2:
                _one_streamed(client, text, tally)
            else:
                _one_plain(client, text, tally)


def _kill_one(head: HeadProc, rng: random.Random) -> tuple[int, int] | None:
    """SIGKILL one UP replica of a random stage that has two UP; None if none has."""
    stages = [0, 1, 2]
    rng.shuffle(stages)
    for sid in stages:
        up = head.up_replicas(sid)
        if len(up) >= 2:
            victim = rng.choice(up)
            os.kill(victim["pid"], signal.SIGKILL)
            return sid, victim["replica_id"]
    return None


def test_kill_9_replicas_of_every_stage_under_load_loses_nothing(tmp_path: Path) -> None:
    head = HeadProc(tmp_path, "echo", "--stage-overrides", SHAPE, "--omni-stage-wait-timeout", "10")
    try:
        head.wait_healthy(60)
        for sid in (0, 1, 2):
            head.wait_up(sid, 2, 60)
        stop = threading.Event()
        tally = Tally()
        workers = [
            threading.Thread(target=_load, args=(head.url, stop, tally, n)) for n in range(4)
        ]
        for w in workers:
            w.start()
        rng = random.Random(7)
        kills: list[tuple[int, int]] = []
        deadline = time.monotonic() + 14
        while time.monotonic() < deadline:
            time.sleep(1.0)
            killed = _kill_one(head, rng)
            if killed:
                kills.append(killed)
        stop.set()
        for w in workers:
            w.join(60)
        assert not any(w.is_alive() for w in workers), "a request hung"

        assert tally.wrong == [], tally.wrong[:5]
        assert tally.ok > 20 and tally.streamed_ok > 20, tally
        assert {sid for sid, _ in kills} == {0, 1, 2}, kills  # every stage lost replicas
        assert len(kills) >= 8, kills
        # Requests really were moved off the dead replicas, not merely lucky.
        assert head.log().count("retry 1 of 2") >= 3
    finally:
        head.stop()
