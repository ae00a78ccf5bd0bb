"""Real models, real failures: kill -9 the thinker and then the talker mid-stream.

The thinker's retry continues from the prompt plus the text already streamed (an LLM
continuation); the talker's retry reads the replayed input again and speaks from the
first sentence the client does not have yet. The client must see one coherent answer:
the same transcript as a run without failures, and about as much audio (a sentence lost
or spoken twice would change it by a quarter).
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
        baseline_text, baseline_audio, _ = _stream(head, body, kill=None)
        killed: dict[int, int] = {}
        text, audio_bytes, finish = _stream(head, body, kill=killed)
        assert set(killed) == {0, 1}, killed
        log = head.log()
        assert "stage 0 (thinker)" in log and "stage 1 (talker)" in log
        assert log.count("retry 1 of 2") >= 2
        assert len(_words(text)) > 8, text
        # The thinker's continuation is exact (greedy), so the words are the same, once.
        assert _words(text) == _words(baseline_text), (text, baseline_text)
        # The talker spoke each sentence once: no sentence repeated after its retry, none
        # lost (sentence cuts may differ a little with the text's arrival, hence 10%).
        assert abs(audio_bytes - baseline_audio) <= 0.1 * baseline_audio, (
            audio_bytes,
            baseline_audio,
        )
        assert audio_bytes > 24000 * 2  # over a second of 16-bit audio
        assert finish in ("stop", "length")
    finally:
        head.stop()


def _stream(head: HeadProc, body: dict, kill: dict[int, int] | None) -> tuple[str, int, str]:
    """One streamed chat with audio: (transcript, audio bytes, finish reason). With
    ``kill``, kill -9 the busy thinker once a few words are out and the busy talker once
    it has spoken, recording their replica ids in ``kill``."""
    transcript: list[str] = []
    audio_bytes = 0
    finish = None
    with head.client.stream("POST", "/v1/chat/completions", json=body, timeout=300) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: ") :])
            assert "error" not in event, event
            for choice in event["choices"]:
                audio = choice["delta"].get("audio") or {}
                assert not choice["delta"].get("content"), "with audio, text is the transcript"
                transcript.append(audio.get("transcript", ""))
                audio_bytes += len(base64.b64decode(audio.get("data", "")))
                finish = choice.get("finish_reason") or finish
            if kill is None:
                continue
            if 0 not in kill and len("".join(transcript).split()) >= 4:
                victim = _busy_replica(head, 0)
                if victim:
                    os.kill(victim["pid"], signal.SIGKILL)
                    kill[0] = victim["replica_id"]
            if 1 not in kill and audio_bytes:
                victim = _busy_replica(head, 1)
                if victim:
                    os.kill(victim["pid"], signal.SIGKILL)
                    kill[1] = victim["replica_id"]
    return "".join(transcript), audio_bytes, str(finish)
