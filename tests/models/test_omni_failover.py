"""Kill -9 the talker of a staged Qwen2.5-Omni mid-answer: the answer completes on the
other talker replica, and the client's audio is exactly an undisturbed run's.

The thinker is a final stage, so the head holds every tensor it sent the talker and sends
them again to the new talker replica; greedy talking repeats the same codes, and the
token2wav stage (chunked, so audio is out before the talker ends) starts over with it,
its repeated chunks dropped before they reach the client.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from tests.integration.harness import HeadProc
from tests.omni_tiny import build_tiny_omni, spoken_deltas

pytestmark = pytest.mark.slow

CODES = 400  # long enough to kill the talker while it talks


def _stream(head: HeadProc, body: dict[str, Any], kill: list[int] | None) -> tuple[str, bytes]:
    """The streamed transcript and audio; with ``kill``, kill -9 the busy talker replica
    once the first audio is out, recording its id."""
    text, audio = [], []
    for words, sound in spoken_deltas(head, body, timeout=180):
        text.append(words)
        if sound:
            audio.append(sound)
        if kill is not None and not kill and audio:
            busy = [r for r in head.up_replicas(1) if r["in_flight"] > 0]
            if busy:
                os.kill(busy[0]["pid"], signal.SIGKILL)
                kill.append(busy[0]["replica_id"])
    return "".join(text), b"".join(audio)


def test_a_killed_talker_is_replaced_and_the_audio_is_unchanged(tmp_path: Path) -> None:
    directory = build_tiny_omni(tmp_path / "qwen2.5-omni-tiny")
    overrides = {
        "1": {"replicas": 2, "engine_args": {"do_sample": False, "max_new_tokens": CODES}},
        "2": {"engine_args": {"chunk_codes": 8, "past_codes": 8, "future_codes": 4}},
    }
    mp = pytest.MonkeyPatch()
    mp.setenv("OMP_NUM_THREADS", "1")
    head = HeadProc(tmp_path, str(directory), "--stage-overrides", json.dumps(overrides))
    mp.undo()
    try:
        head.wait_healthy(timeout=240)
        head.wait_up(1, 2, timeout=120)
        body = {
            "model": head.client.get("/v1/models").json()["data"][0]["id"],
            "messages": [{"role": "user", "content": "Tell me a long story."}],
            "modalities": ["text", "audio"],
            "audio": {"voice": "Chelsie", "format": "pcm16"},
            "temperature": 0,
            "max_tokens": 8,
            "stream": True,
        }
        want_text, want_audio = _stream(head, body, kill=None)
        killed: list[int] = []
        text, audio = _stream(head, body, kill=killed)
        assert killed, "the talker finished before it could be killed"
        assert text == want_text
        assert audio == want_audio
        assert len(want_audio) == CODES * 2 * 16 * 2
    finally:
        head.stop()
