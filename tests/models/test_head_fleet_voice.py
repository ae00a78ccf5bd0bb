"""Two heads of the real voice pipeline, one killed: the other speaks on, the killed one,
started again, is served again.

Each head runs its own listener (``--stage-id 2``: a head's own replicas serve that head
only), and one headless thinker and one headless talker, given the first head's address,
serve both heads.
"""

from __future__ import annotations

import base64
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.integration.harness import HeadProc, headless, wait_for

pytestmark = pytest.mark.slow

BODY = {
    "model": "voice",
    "messages": [{"role": "user", "content": "What is the capital of France?"}],
    "modalities": ["text", "audio"],
    "audio": {"voice": "joe", "format": "wav"},
    "temperature": 0,
    "max_tokens": 24,
}


def _head(tmp: Path, name: str, *extra: str, port: int | None = None) -> HeadProc:
    return HeadProc(tmp, "voice", "--stage-id", "2", *extra, name=name, port=port)


def _spoken(url: str) -> str | None:
    """An answer with audio through the head at ``url``: None, else what was wrong."""
    try:
        r = httpx.post(f"{url}/v1/chat/completions", json=BODY, timeout=120)
    except httpx.HTTPError as exc:
        return repr(exc)
    if r.status_code != 200:
        return f"{r.status_code} {r.text[:200]}"
    audio = r.json()["choices"][0]["message"].get("audio") or {}
    wav = base64.b64decode(audio.get("data", ""))
    if not wav.startswith(b"RIFF") or len(wav) < 16_000 or "Paris" not in audio["transcript"]:
        return f"no spoken answer: {audio.get('transcript')!r}, {len(wav)} bytes"
    return None


def test_a_voice_head_killed_costs_the_other_nothing_and_is_served_again(tmp_path: Path) -> None:
    a = _head(tmp_path, "a")
    b = again = thinker = talker = None
    try:
        a.wait_http(60)
        b = _head(tmp_path, "b", "--omni-join", f"127.0.0.1:{a.master_port}")
        thinker = headless(tmp_path, a, 0, name="thinker")
        talker = headless(tmp_path, a, 1, name="talker")
        a.wait_healthy(300)
        b.wait_healthy(300)
        for head in (a, b):
            for sid in (0, 1):
                wait_for(lambda h=head, s=sid: len(h.up_replicas(s)) == 1, 60, what=f"{sid} UP")
        problems: list[str] = []
        answered = [0]
        stop = threading.Event()

        def talk_to_b() -> None:
            while not stop.is_set():
                problem = _spoken(b.url)
                if problem:
                    problems.append(problem)
                answered[0] += 1

        client = threading.Thread(target=talk_to_b, daemon=True)
        client.start()
        # Kill a while it has an answer of its own in the works.
        on_a = threading.Thread(target=lambda: _spoken(a.url), daemon=True)
        on_a.start()
        wait_for(lambda: a.stages()["stages"][0]["replicas"][0]["in_flight"] > 0, 60)
        a.signal(signal.SIGKILL)
        a.wait(10)
        time.sleep(3.0)
        stop.set()
        client.join(180)
        assert problems == []
        assert answered[0] >= 2
        # The replicas gave up a's answer: b sees nothing held for another head.
        wait_for(
            lambda: all(r["other_heads_in_flight"] == 0 for r in b.up_replicas(0)),
            30,
            what="a's answer dropped by the thinker",
        )
        again = _head(tmp_path, "a2", "-oma", "127.0.0.1", "-omp", str(a.master_port), port=a.port)
        again.wait_healthy(300)
        assert _spoken(again.url) is None
        assert _spoken(b.url) is None
    finally:
        for proc in (thinker, talker, again, b, a):
            if proc is not None:
                proc.stop()
