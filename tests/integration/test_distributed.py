"""A head serving one stage plus --headless processes for the others."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.harness import HeadProc, Proc, headless


@pytest.fixture(scope="module")
def cluster(module_tmp: Path) -> Iterator[tuple[HeadProc, list[Proc]]]:
    head = HeadProc(
        module_tmp, "echo", "--stage-id", "0", "--omni-lb-policy", "round-robin", name="rr-head"
    )
    procs: list[Proc] = []
    try:
        head.wait_http()
        procs.append(headless(module_tmp, head, 1, name="hl-stage1"))
        procs.append(headless(module_tmp, head, 2, "--omni-dp-size-local", "2", name="hl-stage2"))
        head.wait_healthy(timeout=30)
        head.wait_up(2, 2)
        yield head, procs
    finally:
        for p in procs:
            p.stop()
        head.stop()


def test_headless_replicas_get_auto_assigned_ids(cluster: tuple[HeadProc, list[Proc]]) -> None:
    head, _ = cluster
    assert [r["replica_id"] for r in head.up_replicas(0)] == [0]
    assert [r["local"] for r in head.up_replicas(0)] == [True]
    assert [r["replica_id"] for r in head.up_replicas(1)] == [0]
    assert sorted(r["replica_id"] for r in head.up_replicas(2)) == [0, 1]
    assert all(not r["local"] for r in head.up_replicas(2))


def test_requests_flow_through_headless_stages(cluster: tuple[HeadProc, list[Proc]]) -> None:
    head, _ = cluster
    r = head.chat("across hosts")
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == (
        "across hosts [thinker] [talker] [vocoder]"
    )


def test_round_robin_spreads_requests_over_every_replica(
    cluster: tuple[HeadProc, list[Proc]],
) -> None:
    head, _ = cluster
    before = {r["replica_id"]: r["dispatched_total"] for r in head.up_replicas(2)}
    for i in range(10):
        assert head.chat(f"request {i}").status_code == 200
    after = {r["replica_id"]: r["dispatched_total"] for r in head.up_replicas(2)}
    assert {rid: after[rid] - before[rid] for rid in after} == {0: 5, 1: 5}


def test_headless_replica_advertises_its_address(cluster: tuple[HeadProc, list[Proc]]) -> None:
    head, _ = cluster
    for replica in head.up_replicas(1) + head.up_replicas(2):
        assert replica["address"] == "127.0.0.1"  # the UDP routing probe toward the master
