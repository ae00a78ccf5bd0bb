"""Kill -9 the talker of a staged Qwen2.5-Omni mid-answer: the answer completes on the
other talker replica, and the client's audio is exactly an undisturbed run's.

The thinker's tensors go replica to replica, never through the head (its text does go to
the head: the thinker is a final stage). Its replica keeps what it sent the talker, and
when the talker is lost the head points it at the new talker replica (Redirect): it sends
the kept tensors again and the rest there, and is not dispatched again itself. Greedy
talking repeats the same codes, and the token2wav stage (chunked, so audio is out before
the talker ends) starts over with it, its repeated chunks dropped before they reach the
client.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from tests.integration.harness import HeadProc
from tests.integration.test_metrics import Samples, scrape, value
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


def _dispatches(samples: Samples, stage_id: int) -> float:
    """How often the head dispatched a stage (its queue-wait histogram counts each)."""
    name = "omnistage_stage_queue_wait_seconds_count"
    (count,) = [
        v
        for (n, labels), v in samples.items()
        if n == name and ("stage_id", str(stage_id)) in labels
    ]
    return count


def _tensors_via_head(head: HeadProc) -> tuple[float, float, Samples]:
    _, samples = scrape(head.client)
    chunks = value(samples, "omnistage_forwarded_tensor_chunks_total")
    return chunks, value(samples, "omnistage_forwarded_tensor_bytes_total"), samples


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
        chunks, nbytes, samples = _tensors_via_head(head)
        # thinker -> talker -> token2wav, both edges direct; no tensor through the head.
        assert value(samples, "omnistage_direct_edges_total") == 2
        assert (chunks, nbytes) == (0, 0)
        killed: list[int] = []
        text, audio = _stream(head, body, kill=killed)
        assert killed, "the talker finished before it could be killed"
        assert text == want_text
        assert audio == want_audio
        assert len(want_audio) == CODES * 2 * 16 * 2
        chunks, nbytes, samples = _tensors_via_head(head)
        assert (chunks, nbytes) == (0, 0)
        assert value(samples, "omnistage_redirects_total") == 1
        # The thinker ran once per request: fed again from its replica, not run again.
        assert _dispatches(samples, 0) == 2
        assert _dispatches(samples, 1) == 3
        assert _dispatches(samples, 2) == 3
    finally:
        head.stop()
