"""Session affinity with real processes: a Realtime session's turns go to one replica of
the answering stage, and move to another, with the conversation intact, when it dies.

An echo head with two replicas of its one stage, balanced round-robin (so without
affinity consecutive turns would alternate), talking over the ``websockets`` client.
Which replica answered is read from ``dispatched_total`` in GET /v1/omni/stages.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from websockets.sync.client import ClientConnection, connect

from tests.integration.harness import HeadProc

TWO_REPLICAS = '{"0": {"replicas": 2}}'


@pytest.fixture
def head(tmp_path: Path) -> Iterator[HeadProc]:
    head = HeadProc(
        tmp_path,
        "echo-1stage",
        "--stage-overrides",
        TWO_REPLICAS,
        "--omni-lb-policy",
        "round-robin",
        "--omni-restart-policy",
        "never",  # a killed replica stays gone: the survivor must answer
        name="affinity-head",
    )
    try:
        head.wait_healthy()
        head.wait_up(0, 2)
        yield head
    finally:
        head.stop()


def _dispatched(head: HeadProc) -> dict[int, int]:
    """Requests each UP replica of the stage has been sent."""
    return {r["replica_id"]: r["dispatched_total"] for r in head.up_replicas(0)}


def _delta(before: dict[int, int], after: dict[int, int]) -> dict[int, int]:
    return {rid: n - before.get(rid, 0) for rid, n in after.items() if n != before.get(rid, 0)}


class Session:
    """One Realtime session: typed turns, each answered in text."""

    def __init__(self, head: HeadProc, sockets: contextlib.ExitStack) -> None:
        url = head.url.replace("http://", "ws://") + "/v1/realtime"
        self.ws: ClientConnection = sockets.enter_context(connect(url, open_timeout=10))
        assert self._recv()["type"] == "session.created"
        self.items: dict[str, str] = {}  # item id -> its text, as the session reported it

    def _recv(self) -> dict[str, Any]:
        """The next event, past the ``rate_limits.updated`` that follows each answer."""
        while True:
            event = msgspec.json.decode(self.ws.recv(timeout=15))
            if event["type"] != "rate_limits.updated":
                return event

    def _send(self, event: dict[str, Any]) -> None:
        self.ws.send(msgspec.json.encode(event).decode())

    def turn(self, text: str) -> str:
        """Say ``text``; the answer's text once ``response.done`` reports it completed."""
        content = [{"type": "input_text", "text": text}]
        item = {"type": "message", "role": "user", "content": content}
        self._send({"type": "conversation.item.create", "item": item})
        self._send({"type": "response.create", "response": {"output_modalities": ["text"]}})
        while True:
            event = self._recv()
            assert event["type"] != "error", event
            if event["type"] == "conversation.item.done":
                done = event["item"]
                self.items[done["id"]] = _text_of(done)
            if event["type"] == "response.done":
                response = event["response"]
                assert response["status"] == "completed", response
                (output,) = response["output"]
                return _text_of(output)

    def retrieve(self, item_id: str) -> dict[str, Any]:
        self._send({"type": "conversation.item.retrieve", "item_id": item_id})
        event = self._recv()
        assert event["type"] == "conversation.item.retrieved", event
        return event["item"]


def _text_of(item: dict[str, Any]) -> str:
    return "".join(part.get("text") or "" for part in item["content"])


def test_each_sessions_turns_stick_to_one_replica(head: HeadProc) -> None:
    with contextlib.ExitStack() as sockets:
        a = Session(head, sockets)
        before = _dispatched(head)
        for i in range(6):
            assert a.turn(f"alpha {i}") == f"alpha {i} [echo]"
        (a_replica, n) = _delta(before, _dispatched(head)).popitem()
        assert n == 6  # all six on one replica: round-robin alone would have alternated

        b = Session(head, sockets)
        before = _dispatched(head)
        for i in range(4):  # interleaved: each keeps to its own
            assert b.turn(f"beta {i}") == f"beta {i} [echo]"
            assert a.turn(f"alpha {6 + i}") == f"alpha {6 + i} [echo]"
        moved = _delta(before, _dispatched(head))
        # The second session's first turn went by the policy: to the other replica
        # (round-robin's next); both then stuck.
        (other,) = set(_dispatched(head)) - {a_replica}
        assert moved == {a_replica: 4, other: 4}, moved


def test_a_session_moves_to_another_replica_when_its_replica_dies(head: HeadProc) -> None:
    pids = {r["replica_id"]: r["pid"] for r in head.up_replicas(0)}
    with contextlib.ExitStack() as sockets:
        s = Session(head, sockets)
        before = _dispatched(head)
        for i in range(3):
            s.turn(f"before {i}")
        ((victim, n),) = _delta(before, _dispatched(head)).items()
        assert n == 3
        (survivor,) = set(pids) - {victim}

        earlier = dict(s.items)
        assert len(earlier) == 6  # three questions, three answers
        before = _dispatched(head)
        # At once, before the head may have noticed: a turn sent to the dead replica is
        # dispatched again to the survivor (a retry), and the key moves with it.
        os.kill(pids[victim], signal.SIGKILL)
        assert s.turn("after the kill") == "after the kill [echo]"
        assert s.turn("and again") == "and again [echo]"
        after = _dispatched(head)
        assert set(after) == {survivor}  # the victim is no longer UP
        assert _delta(before, after) == {survivor: 2}
        # The conversation is the session's, not the replica's: every earlier item is
        # still there, as it was.
        for item_id, text in earlier.items():
            assert _text_of(s.retrieve(item_id)) == text
        assert sorted(earlier.values()) == sorted(
            [f"before {i}" for i in range(3)] + [f"before {i} [echo]" for i in range(3)]
        )
