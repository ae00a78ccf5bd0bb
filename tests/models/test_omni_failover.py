"""Kill -9 a replica of a staged Qwen2.5-Omni mid-answer, each stage in turn: the answer
completes on another replica, and the client's text and audio are exactly an undisturbed
run's.

The thinker's tensors go replica to replica, never through the head (its text does go to
the head: the thinker is a final stage). Its replica keeps what it sent the talker, and
when the talker is lost the head points it at the new talker replica (Redirect): it sends
the kept tensors again and the rest there, and is not dispatched again itself. Greedy
talking repeats the same codes, and the token2wav stage (chunked, so audio is out before
the talker ends) starts over with it, its repeated chunks dropped before they reach the
client. A token2wav lost takes the talker with it (its codes went with it); a thinker
lost runs again on its other replica, resuming after the text the client has, and the
talker and token2wav start over from all its tensors, sent again.

One head, two replicas of every stage, for the whole module: each test kills another
stage, and reads the head's counters as deltas.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.harness import HeadProc
from tests.integration.test_metrics import Samples, scrape, value
from tests.omni_tiny import one_thread_head, spoken_deltas

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

CODES = 400  # long enough to kill the talker or token2wav while they work
# The thinker's answer: long enough to kill it while it thinks (random weights never
# end it early).
THINKER_TOKENS = 160


class Undisturbed:
    def __init__(self, head: HeadProc, body: dict[str, Any]) -> None:
        self.head, self.body = head, body
        self.text, self.audio = _stream(head, body, None, None)


@pytest.fixture(scope="module")
def omni(omni_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Undisturbed]:
    """The head, two replicas a stage, and its undisturbed answer (the reference)."""
    overrides = {
        "0": {"replicas": 2},
        "1": {"replicas": 2, "engine_args": {"do_sample": False, "max_new_tokens": CODES}},
        "2": {
            "replicas": 2,
            "engine_args": {"chunk_codes": 8, "past_codes": 8, "future_codes": 4},
        },
    }
    head = one_thread_head(tmp_path_factory.mktemp("omni-kill"), omni_dir, overrides, "omni-kill")
    try:
        body = {
            "model": head.client.get("/v1/models").json()["data"][0]["id"],
            "messages": [{"role": "user", "content": "Tell me a long story."}],
            "modalities": ["text", "audio"],
            "audio": {"voice": "Chelsie", "format": "pcm16"},
            "temperature": 0,
            "max_tokens": THINKER_TOKENS,
            "stream": True,
        }
        undisturbed = Undisturbed(head, body)
        assert len(undisturbed.audio) == CODES * 2 * 16 * 2
        assert undisturbed.text
        yield undisturbed
    finally:
        head.stop()


def _stream(
    head: HeadProc, body: dict[str, Any], stage_id: int | None, kill: list[int] | None
) -> tuple[str, bytes]:
    """The streamed transcript and audio; with ``kill``, kill -9 the busy replica of
    ``stage_id`` once the first words (the thinker) or audio (the others) are out,
    recording its id."""
    text, audio = [], []
    for words, sound in spoken_deltas(head, body, timeout=240):
        text.append(words)
        if sound:
            audio.append(sound)
        started = text if stage_id == 0 else audio
        if kill is not None and not kill and any(started):
            busy = [r for r in head.up_replicas(stage_id or 0) if r["in_flight"] > 0]
            if busy:
                os.kill(busy[0]["pid"], signal.SIGKILL)
                kill.append(busy[0]["replica_id"])
    return "".join(text), b"".join(audio)


def _counts(head: HeadProc) -> dict[str, float]:
    """The head's counters these tests read: tensors it passed on, redirects, and how
    often it dispatched each stage (its queue-wait histogram counts each)."""
    _, samples = scrape(head.client)
    out = {
        "tensor_chunks": value(samples, "omnistage_forwarded_tensor_chunks_total"),
        "tensor_bytes": value(samples, "omnistage_forwarded_tensor_bytes_total"),
        "redirects": value(samples, "omnistage_redirects_total"),
        "direct_edges": value(samples, "omnistage_direct_edges_total"),
    }
    for sid in range(3):
        out[f"dispatched {sid}"] = _dispatches(samples, sid)
    return out


def _dispatches(samples: Samples, stage_id: int) -> float:
    name = "omnistage_stage_queue_wait_seconds_count"
    (count,) = [
        v
        for (n, labels), v in samples.items()
        if n == name and ("stage_id", str(stage_id)) in labels
    ]
    return count


def _killing(omni: Undisturbed, stage_id: int) -> dict[str, float]:
    """An answer with a replica of ``stage_id`` killed mid-way: exactly the undisturbed
    one. Returns the head's counters' changes over it."""
    omni.head.wait_up(stage_id, 2, timeout=240)  # the other replica takes the retry
    before = _counts(omni.head)
    killed: list[int] = []
    text, audio = _stream(omni.head, omni.body, stage_id, killed)
    assert killed, f"stage {stage_id} finished before it could be killed"
    assert text == omni.text
    assert audio == omni.audio
    after = _counts(omni.head)
    delta = {k: after[k] - before[k] for k in after}
    # No tensor went through the head, before or after the kill.
    assert (after["tensor_chunks"], after["tensor_bytes"]) == (0, 0)
    return delta


def test_a_killed_talker_is_replaced_and_the_audio_is_unchanged(omni: Undisturbed) -> None:
    delta = _killing(omni, 1)
    # thinker -> talker -> token2wav, both edges direct; the talker's replaced.
    assert delta["redirects"] == 1
    # The thinker ran once: fed again from its replica, not run again.
    assert [delta[f"dispatched {s}"] for s in range(3)] == [1, 2, 2]


def test_a_killed_token2wav_takes_the_talker_along_and_the_audio_is_unchanged(
    omni: Undisturbed,
) -> None:
    delta = _killing(omni, 2)
    # Its codes went with it: the talker runs again, fed again by the thinker's replica.
    assert delta["redirects"] == 1
    assert [delta[f"dispatched {s}"] for s in range(3)] == [1, 2, 2]


def test_a_killed_thinker_resumes_and_text_and_audio_are_unchanged(omni: Undisturbed) -> None:
    delta = _killing(omni, 0)
    # The thinker runs again on its other replica; talker and token2wav start over.
    assert delta["redirects"] == 0
    assert [delta[f"dispatched {s}"] for s in range(3)] == [2, 2, 2]
