"""Cache-aware routing with real processes: an echo head with two replicas of its one
stage, each faking an llm prefix cache (``prefix_cache_entries``, with a prefill cost
per uncached character), balanced with ``--omni-lb-policy cache-aware``.

A conversation's later turns land on the replica that holds their history (the echo
reports the cached share as ``usage.prompt_tokens_details.cached_tokens``, in
characters); when that replica dies its entries go and the conversation moves; and many
conversations opening with one long system prompt at once spread over both replicas
within 1.5x the mean instead of piling onto the replica that cached it first.

These pass whether or not replicas report their cache in heartbeats: the head's own
record of where it routed each prefix is enough.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from omnistage.protocol.messages import ChatMessage
from omnistage.protocol.prefix import prefix_weights
from tests.integration.harness import HeadProc, wait_for

# Each answer takes at least 2 x 0.1 s, so requests sent together are in flight together.
ENGINE_ARGS = {
    "prefix_cache_entries": 4096,
    "prefill_ms_per_char": 0.02,
    "num_chunks": 2,
    "chunk_delay_s": 0.1,
}
OVERRIDES = json.dumps({"0": {"replicas": 2, "engine_args": ENGINE_ARGS}})
SYSTEM = "You are a patient assistant who answers in one short sentence. " * 30


def _start(tmp: Path, name: str, *extra: str) -> HeadProc:
    head = HeadProc(
        tmp,
        "echo-1stage",
        "--stage-overrides",
        OVERRIDES,
        "--omni-lb-policy",
        "cache-aware",
        *extra,
        name=name,
    )
    head.wait_healthy()
    head.wait_up(0, 2)
    return head


@pytest.fixture(scope="module")
def head(module_tmp: Path) -> Iterator[HeadProc]:
    h = _start(module_tmp, "cache-head")
    try:
        yield h
    finally:
        h.stop()


class Conversation:
    """A chat whose every turn resends the history, as a client of a stateless API does."""

    def __init__(self, client: httpx.Client, name: str, system: str = "") -> None:
        self.client = client
        self.name = name
        self.messages: list[dict[str, str]] = []
        if system:
            self.messages.append({"role": "system", "content": system})
        self.turns = 0
        self.last_weight = 0  # of the last turn's prompt

    def weight(self) -> int:
        """The prompt's weight as the head and the echo count it (characters)."""
        return prefix_weights([ChatMessage(**m) for m in self.messages])[-1]

    def turn(self) -> dict[str, Any]:
        """One more user turn; returns the usage of its answer."""
        self.turns += 1
        self.messages.append({"role": "user", "content": f"{self.name} asks question {self.turns}"})
        self.last_weight = self.weight()
        r = self.client.post("/v1/chat/completions", json={"messages": self.messages})
        assert r.status_code == 200, r.text
        body = r.json()
        self.messages.append(
            {"role": "assistant", "content": body["choices"][0]["message"]["content"]}
        )
        return body["usage"]


def _stage(head: HeadProc) -> dict[str, Any]:
    return head.stages()["stages"][0]


def _by_replica(head: HeadProc, field: str) -> dict[int, int]:
    return {r["replica_id"]: r[field] for r in head.up_replicas(0)}


def _delta(before: dict[int, int], after: dict[int, int]) -> dict[int, int]:
    return {rid: n - before.get(rid, 0) for rid, n in after.items() if n != before.get(rid, 0)}


def test_a_conversations_turns_land_where_its_history_is_cached(head: HeadProc) -> None:
    stage = _stage(head)
    assert stage["lb_policy"] == "cache-aware"
    routing_before = stage["routing"]
    cached_before = _by_replica(head, "cached_tokens_total")
    expected_cached = 0
    for c in range(4):
        conv = Conversation(head.client, f"c{c}")
        placed: list[int] = []
        for t in range(4):
            before = _by_replica(head, "dispatched_total")
            prompt_before = conv.last_weight  # the last turn's prompt, now cached
            usage = conv.turn()
            assert usage["prompt_tokens"] == conv.last_weight  # characters, as the head counts
            if t:
                # The whole previous prompt came from the cache: the turn went back there.
                assert usage["prompt_tokens_details"]["cached_tokens"] == prompt_before
                expected_cached += prompt_before
            (rid,) = _delta(before, _by_replica(head, "dispatched_total"))
            placed.append(rid)
        assert placed == [placed[0]] * 4
    stage = _stage(head)
    routing = {k: stage["routing"][k] - routing_before[k] for k in routing_before}
    assert routing["cache"] == 4 * 3  # every later turn, placed for its cache
    assert routing["affinity"] == 0
    cached = _delta(cached_before, _by_replica(head, "cached_tokens_total"))
    assert sum(cached.values()) == expected_cached
    # Shown in /metrics too.
    text = head.client.get("/metrics").text
    assert 'omnistage_routing_decisions_total{stage_id="0",stage="echo",reason="cache"}' in text
    assert "omnistage_replica_cached_tokens_total{" in text
    assert "omnistage_replica_prompt_tokens_total{" in text


def test_a_hot_system_prompt_spreads_within_the_bound(head: HeadProc) -> None:
    # Each first turn is mostly the shared system prompt: the replica that prefilled it
    # first would take them all without the load bound.
    before = _by_replica(head, "dispatched_total")
    n = 12
    convs = [Conversation(head.client, f"hot{i}", SYSTEM) for i in range(n)]
    with ThreadPoolExecutor(n) as pool:
        usages = list(pool.map(lambda conv: conv.turn(), convs))
    assert all(u["prompt_tokens"] > 0 for u in usages)
    got = _delta(before, _by_replica(head, "dispatched_total"))
    assert sum(got.values()) == n
    assert len(got) == 2, got  # both replicas took some
    assert max(got.values()) <= 1.5 * n / 2, got
    # Once both replicas hold the system prompt, most first turns read it from cache.
    assert sum(1 for u in usages if u["prompt_tokens_details"]["cached_tokens"] > 0) >= n // 2


def test_a_dead_replicas_entries_go_and_its_conversations_move(tmp_path: Path) -> None:
    head = _start(tmp_path, "cache-kill", "--omni-restart-policy", "never")
    try:
        conv = Conversation(head.client, "k")
        conv.turn()
        before = _by_replica(head, "dispatched_total")
        usage = conv.turn()
        assert usage["prompt_tokens_details"]["cached_tokens"] > 0
        (victim,) = _delta(before, _by_replica(head, "dispatched_total"))
        entry = next(r for r in head.up_replicas(0) if r["replica_id"] == victim)
        # The head holds entries for it: routed ones, or (once a heartbeat has reported
        # its cache, which confirms and so drops the routed ones) reported ones.
        assert entry["routed_prefixes"] > 0 or (entry["cached_prefixes"] or 0) > 0, entry

        os.kill(entry["pid"], signal.SIGKILL)
        wait_for(lambda: len(head.up_replicas(0)) == 1, 10, what="the victim out of UP")
        dead = next(r for r in head.replicas(0) if r["replica_id"] == victim)
        assert dead["routed_prefixes"] == 0 and dead["cached_prefixes"] is None

        (survivor,) = [r["replica_id"] for r in head.up_replicas(0)]
        usage = conv.turn()  # moved: its history is prefilled again, once
        assert usage["prompt_tokens_details"]["cached_tokens"] == 0
        usage = conv.turn()  # and from then on read from the survivor's cache
        assert usage["prompt_tokens_details"]["cached_tokens"] > 0
        assert _by_replica(head, "dispatched_total")[survivor] == 2
    finally:
        head.stop()
