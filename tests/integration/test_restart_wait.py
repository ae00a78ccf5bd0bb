"""Nothing lost while a replica restarts, with real processes: the only replica of a
stage is SIGKILLed while requests arrive; they wait for the head's restart of it (far
past --omni-stage-wait-timeout) and complete. Only when nothing is coming back, or what
is coming does not come in time, is the answer a 503, saying which."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

from tests.integration.harness import HeadProc, SteadyLoad, wait_for

# The talker restarts slowly (a model's load) and works a little on each request, so
# requests are in flight when it dies and others arrive while it is down.
SLOW_TALKER = json.dumps({"1": {"engine_args": {"start_delay_s": 2.0, "chunk_delay_s": 0.02}}})
STAGE_WAIT = ("--omni-stage-wait-timeout", "0.5")


def _expected(text: str) -> str:
    return f"{text} [thinker] [talker] [vocoder]"


def _talker(head: HeadProc) -> dict:
    (stage,) = [s for s in head.stages()["stages"] if s["stage_id"] == 1]
    return stage


def _kill_talker(head: HeadProc) -> dict:
    (talker,) = head.wait_up(1, 1, 60)
    os.kill(talker["pid"], signal.SIGKILL)
    return talker


def _restarting_health(head: HeadProc) -> dict | None:
    r = head.client.get("/health")
    return r.json() if r.status_code == 200 and r.json()["status"] == "restarting" else None


def test_requests_wait_for_the_restart_of_a_stages_only_replica(tmp_path: Path) -> None:
    head = HeadProc(tmp_path, "echo", "--stage-overrides", SLOW_TALKER, *STAGE_WAIT)
    load = None
    try:
        head.wait_healthy(60)
        load = SteadyLoad(head.url, _expected, workers=4, timeout=60).start()
        wait_for(lambda: load.ok >= 10, 30, what="answers before the kill")
        first = _kill_talker(head)
        killed_at = time.monotonic()
        # While it is down: "restarting", and requests wait for it.
        health = wait_for(lambda: _restarting_health(head), 10, 0.02, "/health restarting")
        assert [s["name"] for s in health["restarting"]] == ["talker"]
        wait_for(lambda: _talker(head)["waiting"] > 0, 10, 0.02, "requests waiting")
        again = head.wait_up(1, 1, 60, "the talker back")[0]
        down_s = time.monotonic() - killed_at
        assert again["epoch"] > first["epoch"] and again["replica_id"] == first["replica_id"]
        # Its second run serves past the settling time: its next failure is bad luck,
        # and it is restarted at once.
        time.sleep(11)
        _kill_talker(head)
        wait_for(lambda: not head.up_replicas(1), 10, 0.02, what="the talker down")
        head.wait_up(1, 1, 60, "the talker back again")
        ok_after = load.ok
        wait_for(lambda: load.ok > ok_after + 10, 30, what="answers after the kills")
        load.stop()
        assert load.errors == [], load.errors[:5]
        assert load.hung == 0
        assert down_s > 2.0  # far past the 0.5 s stage wait: without waiting, 503s
        assert "restarting stage 1 replica 0 at once (it had served)" in head.log()
    finally:
        if load is not None:
            load.stop()
        head.stop()


def test_the_stages_view_shows_the_slot_restarting_until_it_is_due(tmp_path: Path) -> None:
    head = HeadProc(tmp_path, "echo", "--stage-overrides", SLOW_TALKER, *STAGE_WAIT)
    try:
        head.wait_healthy(60)
        # Within its settling time, so its restart backs off (1 s): the slot shows
        # "restarting" with the time it is due.
        _kill_talker(head)
        before = time.time()

        def restarting_row() -> dict | None:
            rows = [r for r in _talker(head)["replicas"] if r.get("restarting")]
            return rows[0] if rows else None

        row = wait_for(restarting_row, 5, 0.02, "a restarting row")
        assert row["state"] == "ERROR"
        assert before - 1 < row["restarting"]["due_at"] < before + 31
        assert _talker(head)["status"] == "restarting"
        head.wait_up(1, 1, 60, "the talker back")
        assert head.client.get("/health").json() == {"status": "ok"}
    finally:
        head.stop()


def test_with_restarts_off_a_request_gets_a_prompt_503_saying_nothing_is_coming(
    tmp_path: Path,
) -> None:
    head = HeadProc(tmp_path, "echo", "--omni-restart-policy", "never", *STAGE_WAIT)
    try:
        head.wait_healthy(60)
        _kill_talker(head)
        wait_for(lambda: not head.up_replicas(1), 5, 0.02, what="the talker down")
        started = time.monotonic()
        r = head.chat("anyone?")
        assert r.status_code == 503, r.text
        assert time.monotonic() - started < 3
        assert r.json()["error"]["message"].startswith(
            "stage 1 (talker) has no live replica and none is restarting"
        )
        health = head.client.get("/health")
        assert health.status_code == 503 and health.json()["status"] == "unavailable"
        assert _talker(head)["status"] == "waiting"
    finally:
        head.stop()


def test_a_restart_slower_than_the_restart_wait_is_a_503_naming_it(tmp_path: Path) -> None:
    slow = json.dumps({"1": {"engine_args": {"start_delay_s": 8.0}}})
    head = HeadProc(
        tmp_path,
        "echo",
        "--stage-overrides",
        slow,
        *STAGE_WAIT,
        "--omni-restart-wait-timeout",
        "1",
    )
    try:
        head.wait_healthy(60)
        _kill_talker(head)
        wait_for(lambda: _restarting_health(head), 5, 0.02, "/health restarting")
        started = time.monotonic()
        r = head.chat("too slow")
        waited = time.monotonic() - started
        assert r.status_code == 503, r.text
        assert 0.9 <= waited < 4
        message = r.json()["error"]["message"]
        assert message.startswith("stage 1 (talker) has no live replica: restarting replica 0")
        assert "did not come up within 1s (--omni-restart-wait-timeout)" in message
        # It does come back, and serves.
        head.wait_up(1, 1, 60, "the talker back")
        assert head.chat("back").status_code == 200
    finally:
        head.stop()
