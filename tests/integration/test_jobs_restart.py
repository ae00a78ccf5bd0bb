"""Nothing is lost to a restart: a head SIGKILLed while background responses are
queued and running, started again on the same store, runs them all; a job is never
left in progress, and another head takes over a dead head's jobs once their leases
expire. On SQLite and on a real PostgreSQL server (tests/postgres.py)."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from tests.integration.harness import HeadProc, free_port, wait_for

# Each answer takes ~1 s (5 chunks, 0.2 s apart) and a replica takes 2 at once, so of 6
# jobs some run and the rest wait queued in the database when the head is killed.
SLOW = {
    "0": {
        "engine_args": {"num_chunks": 5, "chunk_delay_s": 0.2},
        "max_inflight_per_replica": 2,
    }
}
JOBS = 6


@pytest.fixture(params=["sqlite", "postgres"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'jobs.db'}"
    return str(request.getfixturevalue("postgres").new_database())


def _head(tmp: Path, store_url: str, name: str, *extra: str, port: int | None = None) -> HeadProc:
    return HeadProc(
        tmp,
        "echo-1stage",
        "--stage-overrides",
        json.dumps(SLOW),
        "--store-url",
        store_url,
        "--media-url",
        str(tmp / "media"),
        *extra,
        name=name,
        port=port,
    )


def _statuses(head: HeadProc, ids: list[str]) -> dict[str, str]:
    return {rid: head.client.get(f"/v1/responses/{rid}").json()["status"] for rid in ids}


def _kill_group(head: HeadProc) -> None:
    os.killpg(head.pid, signal.SIGKILL)  # the head and its replicas, as a lost machine
    head.wait(10)


def _create(head: HeadProc) -> list[str]:
    ids = []
    for n in range(JOBS):
        r = head.client.post("/v1/responses", json={"input": f"job {n}", "background": True})
        assert r.status_code == 200, r.text
        assert r.json()["status"] == "queued"
        ids.append(r.json()["id"])
    return ids


def _expect_all_completed(head: HeadProc, ids: list[str]) -> None:
    wait_for(
        lambda: set(_statuses(head, ids).values()) == {"completed"},
        60,
        0.2,
        "every job completed",
    )
    for n, rid in enumerate(ids):
        body = head.client.get(f"/v1/responses/{rid}").json()
        text = body["output"][0]["content"][0]["text"]
        assert text == f"job {n} [echo]", body


def test_a_head_killed_with_jobs_queued_and_running_runs_them_all_when_restarted(
    tmp_path: Path, store_url: str
) -> None:
    port = free_port()
    first = _head(tmp_path, store_url, "first", port=port)
    try:
        first.wait_healthy()
        ids = _create(first)
        wait_for(lambda: "in_progress" in _statuses(first, ids).values(), 10, what="a job running")
        before = _statuses(first, ids)
        assert "queued" in before.values(), before  # some still wait in the database
    finally:
        _kill_group(first)
        first.stop()
    again = _head(tmp_path, store_url, "again", port=port)
    try:
        again.wait_healthy()
        _expect_all_completed(again, ids)
        assert "released" in again.log()  # it freed its dead run's leases at once
    finally:
        again.stop()


def test_another_head_takes_over_a_dead_heads_jobs_once_their_leases_expire(
    tmp_path: Path, store_url: str
) -> None:
    lease = ("--job-lease", "2")
    first = _head(tmp_path, store_url, "first", *lease)
    try:
        first.wait_healthy()
        ids = _create(first)
        wait_for(lambda: "in_progress" in _statuses(first, ids).values(), 10, what="a job running")
    finally:
        _kill_group(first)
        first.stop()
    other = _head(tmp_path, store_url, "other", *lease)
    try:
        other.wait_healthy()
        _expect_all_completed(other, ids)
    finally:
        other.stop()
