"""Replica to replica: outputs of stages that are not final go straight to the next
stage's replica, and the head forwards nothing; with CURVE (no peer keys) or when the
head needs a stage's output itself, edges go through the head. Real processes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.integration.harness import HeadProc, headless
from tests.integration.test_metrics import scrape, value


def _counts(head: HeadProc) -> tuple[float, float]:
    _, samples = scrape(head.client)
    return (
        value(samples, "omnistage_direct_edges_total"),
        value(samples, "omnistage_forwarded_chunks_total"),
    )


def test_hidden_stages_hand_their_output_straight_to_the_next_replica(
    echo_head: HeadProc,
) -> None:
    direct0, forwarded0 = _counts(echo_head)
    for i in range(5):
        r = echo_head.chat(f"peer {i}")
        assert r.status_code == 200
        answer = r.json()["choices"][0]["message"]["content"]
        assert answer == f"peer {i} [thinker] [talker] [vocoder]"
    direct, forwarded = _counts(echo_head)
    # thinker -> talker and talker -> vocoder, for each request; nothing via the head.
    assert direct - direct0 == 10
    assert forwarded == forwarded0
    stages = echo_head.stages()["stages"]
    assert all(s["replicas"][0]["state"] == "UP" for s in stages)


def test_streamed_answers_arrive_whole_through_the_peer_path(echo_head: HeadProc) -> None:
    body = {"messages": [{"role": "user", "content": "stream me"}], "stream": True}
    with echo_head.client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        text = "".join(r.iter_text())
    pieces = [line for line in text.splitlines() if line.startswith("data: {")]
    assert pieces and "[vocoder]" in text and text.rstrip().endswith("data: [DONE]")


def test_with_curve_every_edge_goes_through_the_head(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    made = subprocess.run(
        [sys.executable, "-m", "omnistage", "curve-keys", str(keys)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert made.returncode == 0, made.stderr
    head = HeadProc(tmp_path, "echo", "--omni-curve-keys", str(keys))
    try:
        head.wait_healthy()
        r = head.chat("keyed")
        assert r.json()["choices"][0]["message"]["content"] == (
            "keyed [thinker] [talker] [vocoder]"
        )
        direct, forwarded = _counts(head)
        assert direct == 0
        assert forwarded >= 2  # at least the last chunk of thinker and of talker
    finally:
        head.stop()


def test_a_replica_that_cannot_listen_on_its_advertised_address_takes_inputs_via_the_head(
    tmp_path: Path,
) -> None:
    # The talker advertises an address that is not this host's (as behind NAT): it
    # cannot bind a peer socket there, so the thinker's output reaches it through the
    # head, and nothing is ever sent to that address (the replica dials the head).
    vocoder = None
    head = HeadProc(tmp_path, "echo", "--stage-id", "0")
    talker = None
    try:
        head.wait_http()
        vocoder = headless(tmp_path, head, 2, name="vocoder")
        talker = headless(tmp_path, head, 1, "-ora", "192.0.2.123", name="natted-talker")
        head.wait_healthy(timeout=30)
        r = head.chat("natted")
        assert r.json()["choices"][0]["message"]["content"] == (
            "natted [thinker] [talker] [vocoder]"
        )
        direct, forwarded = _counts(head)
        # thinker -> talker: the talker has no peer socket; talker -> vocoder: the
        # vocoder listens on loopback, which a replica on another address cannot reach.
        assert direct == 0
        assert forwarded >= 2
        assert "inputs will come through the head" in talker.log()
    finally:
        for proc in (talker, vocoder):
            if proc is not None:
                proc.stop()
        head.stop()
