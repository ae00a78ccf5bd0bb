"""Real models, real failures: kill -9 the thinker and then the talker mid-stream.

The thinker's retry continues from the prompt plus the text already streamed (an LLM
continuation); the talker's retry speaks again from the replayed input, and the replica
drops the sentences the client already has. The client must see one coherent answer:
the audio transcript says exactly the streamed text, once.
"""

from __future__ import annotations

import base64
import json
import os
import signal
from pathlib import Path

import pytest

from tests.integration.harness import HeadProc, wait_for

pytestmark = pytest.mark.slow

TWO_OF_EACH = json.dumps({"0": {"replicas": 2}, "1": {"replicas": 2}})


def _busy_replica(head: HeadProc, stage_id: int) -> dict | None:
    busy = [r for r in head.up_replicas(stage_id) if r["in_flight"] > 0]
    return busy[0] if busy else None


def _words(text: str) -> list[str]:
    return text.split()


def test_killing_the_busy_thinker_then_the_busy_talker_mid_stream(tmp_path: Path) -> None:
    head = HeadProc(tmp_path, "voice", "--stage-overrides", TWO_OF_EACH, name="voice-2x2")
    try:
        head.wait_healthy(timeout=300)
        for sid in (0, 1):
            wait_for(lambda s=sid: len(head.up_replicas(s)) == 2, 300, what=f"stage {sid} x2")
        body = {
            "model": "voice",
            "messages": [{"role": "user", "content": "Describe Paris in four short sentences."}],
            "modalities": ["text", "audio"],
            "audio": {"voice": "joe", "format": "pcm16"},
            "stream": True,
            "temperature": 0,
            "max_tokens": 90,
        }
        text: list[str] = []
        transcript: list[str] = []
        audio_bytes = 0
        killed: dict[int, int] = {}
        finish = None
        with head.client.stream("POST", "/v1/chat/completions", json=body, timeout=300) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[len("data: ") :])
                assert "error" not in event, event
                for choice in event["choices"]:
                    delta = choice["delta"]
                    if delta.get("content"):
                        text.append(delta["content"])
                    if delta.get("audio"):
                        audio_bytes += len(base64.b64decode(delta["audio"]["data"]))
                        transcript.append(delta["audio"].get("transcript", ""))
                    finish = choice.get("finish_reason") or finish
                # Kill the thinker once it has streamed a few words, and the talker once
                # it has spoken its first piece.
                if 0 not in killed and len("".join(text).split()) >= 4:
                    victim = _busy_replica(head, 0)
                    if victim:
                        os.kill(victim["pid"], signal.SIGKILL)
                        killed[0] = victim["replica_id"]
                if 1 not in killed and transcript:
                    victim = _busy_replica(head, 1)
                    if victim:
                        os.kill(victim["pid"], signal.SIGKILL)
                        killed[1] = victim["replica_id"]
        assert set(killed) == {0, 1}, killed
        log = head.log()
        assert "stage 0 (thinker)" in log and "stage 1 (talker)" in log
        assert log.count("retry 1 of 2") >= 2
        said = "".join(text)
        assert len(_words(said)) > 8, said
        # The talker spoke the thinker's whole text exactly once: no sentence repeated
        # after the talker's retry, none lost, and no words doubled by the thinker's.
        assert _words(" ".join(transcript)) == _words(said), (transcript, said)
        assert audio_bytes > 22050 * 2  # over a second of 16-bit audio
        assert finish in ("stop", "length")
    finally:
        head.stop()
