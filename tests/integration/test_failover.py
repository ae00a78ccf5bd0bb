"""Replica failure, detection, re-attach and replacement, with real processes."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import httpx

from tests.integration.harness import HeadProc, Proc, SteadyLoad, headless, wait_for

SLOW_STAGE_2 = '{"2": {"engine_args": {"chunk_delay_s": 0.05}}}'


def _state_of(head: HeadProc, stage_id: int, replica_id: int) -> str | None:
    for r in head.replicas(stage_id):
        if r["replica_id"] == replica_id:
            return r["state"]
    return None


def test_kill_9_of_a_headless_replica_under_load_loses_no_request(tmp_path: Path) -> None:
    head = HeadProc(
        tmp_path,
        "echo",
        "--stage-id",
        "0",
        "--omni-heartbeat-timeout",
        "2",
        "--stage-overrides",
        SLOW_STAGE_2,
    )
    procs: list[Proc] = []
    load: SteadyLoad | None = None
    try:
        head.wait_http()
        procs.append(headless(tmp_path, head, 1))
        victim = headless(tmp_path, head, 2, name="victim")
        procs.append(victim)
        head.wait_healthy()
        procs.append(headless(tmp_path, head, 2, name="survivor"))
        head.wait_up(2, 2)
        victim_id = head.up_replica_of(2, victim)["replica_id"]

        load = SteadyLoad(head.url, lambda text: f"{text} [thinker] [talker] [vocoder]").start()
        time.sleep(1.0)
        # Kill it while it holds requests, so the retry path is what is tested.
        wait_for(
            lambda: any(r["in_flight"] for r in head.up_replicas(2) if r["pid"] == victim.pid),
            10,
            0.01,
            what="victim busy",
        )
        killed_at = time.monotonic()
        victim.signal(signal.SIGKILL)
        wait_for(lambda: _state_of(head, 2, victim_id) == "ERROR", 5, what="victim ERROR")
        detected_after = time.monotonic() - killed_at
        time.sleep(1.5)
        ok_before_replacement = load.ok

        # A replacement joins with a fresh auto-assigned id and takes traffic.
        newcomer = headless(tmp_path, head, 2, name="newcomer")
        procs.append(newcomer)
        wait_for(
            lambda: any(r["pid"] == newcomer.pid for r in head.up_replicas(2)),
            20,
            what="newcomer UP",
        )
        time.sleep(1.5)
        load.stop()

        assert detected_after <= 2.0 + 1.0, f"detected after {detected_after:.2f}s"
        assert load.hung == 0  # no request timed out, none was still running after 30 s
        assert load.ok > ok_before_replacement > 0
        # Requests the victim held were retried on the survivor: none failed, and each
        # answer was checked to be exactly the no-failure output.
        assert load.errors == [], load.errors[:5]
        assert "retry 1 of 2" in head.log()
        newcomer_entry = head.up_replica_of(2, newcomer)
        assert newcomer_entry["replica_id"] not in (victim_id,)
        assert newcomer_entry["dispatched_total"] > 0
    finally:
        if load is not None:
            load.stop()
        for p in procs:
            p.stop()
        head.stop()


def test_frozen_replica_goes_error_then_back_up_when_it_resumes(tmp_path: Path) -> None:
    head = HeadProc(tmp_path, "echo-1stage", "--stage-id", "0", "--omni-heartbeat-timeout", "2")
    replica: Proc | None = None
    try:
        head.wait_healthy()
        replica = headless(tmp_path, head, 0)
        head.wait_up(0, 2)
        rid = head.up_replica_of(0, replica)["replica_id"]
        replica.signal(signal.SIGSTOP)  # freezes the heartbeat thread too
        frozen_at = time.monotonic()
        wait_for(lambda: _state_of(head, 0, rid) == "ERROR", 5, what="ERROR after silence")
        assert time.monotonic() - frozen_at >= 1.5  # not before the timeout
        # While it is ERROR, traffic goes to the other replica only.
        for _ in range(4):
            assert head.chat("while frozen").status_code == 200
        replica.signal(signal.SIGCONT)
        wait_for(lambda: _state_of(head, 0, rid) == "UP", 5, what="UP after resuming")
        before = next(r["dispatched_total"] for r in head.up_replicas(0) if r["replica_id"] == rid)
        for _ in range(8):
            assert head.chat("after resume").status_code == 200
        after = next(r["dispatched_total"] for r in head.up_replicas(0) if r["replica_id"] == rid)
        assert after > before  # re-attached: it gets traffic again
    finally:
        if replica is not None:
            replica.signal(signal.SIGCONT)
            replica.stop()
        head.stop()


def test_local_replica_exit_is_noticed_at_once(tmp_path: Path) -> None:
    head = HeadProc(
        tmp_path, "echo", "--omni-heartbeat-timeout", "30", "--omni-restart-policy", "never"
    )
    try:
        head.wait_healthy()
        (talker,) = head.up_replicas(1)
        import os

        os.kill(talker["pid"], signal.SIGKILL)
        killed_at = time.monotonic()
        wait_for(lambda: _state_of(head, 1, 0) == "ERROR", 5, 0.02, what="talker ERROR")
        assert time.monotonic() - killed_at < 1.0  # far inside the 30 s heartbeat timeout
        # The kill seen by the launcher's death watch, the process exit and the closed
        # data connection race; each is noticed at once, which wins is the scheduler's.
        reason = next(r["reason"] for r in head.replicas(1))
        assert any(
            why in reason for why in ("killed, still exiting", "exit code -9", "connection closed")
        ), reason
        r = head.chat(
            "no talker",
        )
        assert r.status_code == 503
        assert "stage 1 (talker)" in r.json()["error"]["message"]
        assert head.client.get("/health").status_code == 503
    finally:
        head.stop()


def test_a_crashed_local_replica_is_restarted_and_serves_again(tmp_path: Path) -> None:
    import os

    head = HeadProc(tmp_path, "echo")
    try:
        head.wait_healthy()
        (talker,) = head.up_replicas(1)
        os.kill(talker["pid"], signal.SIGKILL)
        wait_for(
            lambda: any(r["state"] == "UP" and r["pid"] != talker["pid"] for r in head.replicas(1)),
            15,
            what="a new talker process UP",
        )
        (again,) = head.up_replicas(1)
        assert again["replica_id"] == talker["replica_id"]  # the same head-local slot
        assert again["epoch"] > talker["epoch"]
        # At once if it had been UP for 10 s (a slow start of the other stages can
        # take that long), else after the first backoff step.
        log = head.log()
        assert (
            "restarting stage 1 replica 0 in 1s" in log
            or "restarting stage 1 replica 0 at once" in log
        ), log[-2000:]
        # /v1/omni/stages keeps the count and the story: UP -> ERROR (exit) -> ... -> UP.
        assert again["restarts"] == 1
        changes = head.client.get("/v1/omni/stages").json()["recent_state_changes"]
        talker_changes = [c for c in changes if c["stage"] == "talker"]
        assert talker_changes[0]["state"] == "UP"  # newest first
        crash = next(c for c in talker_changes if c["state"] == "ERROR")
        # The kill, the process exit and the closed data connection race (as above).
        assert any(
            why in crash["reason"]
            for why in ("killed, still exiting", "exit code -9", "connection closed")
        ), crash["reason"]
        assert crash["epoch"] == talker["epoch"]
        r = head.chat("after the crash")
        assert r.status_code == 200
        assert r.json()["choices"][0]["message"]["content"].endswith("[vocoder]")
    finally:
        head.stop()


def test_an_idle_remote_replica_that_crashes_is_noticed_within_a_second(tmp_path: Path) -> None:
    # A 30 s heartbeat timeout: only the closed connection can explain a fast detection.
    head = HeadProc(tmp_path, "echo-1stage", "--stage-id", "0", "--omni-heartbeat-timeout", "30")
    replica: Proc | None = None
    try:
        head.wait_healthy()
        replica = headless(tmp_path, head, 0)
        head.wait_up(0, 2)
        rid = head.up_replica_of(0, replica)["replica_id"]
        replica.signal(signal.SIGKILL)
        killed_at = time.monotonic()
        wait_for(lambda: _state_of(head, 0, rid) == "ERROR", 5, 0.02, what="ERROR")
        assert time.monotonic() - killed_at < 1.0
        reason = next(r["reason"] for r in head.replicas(0) if r["replica_id"] == rid)
        assert "connection closed" in reason
        assert head.chat("the other one serves").status_code == 200
    finally:
        if replica is not None:
            replica.stop()
        head.stop()


def test_a_stalled_replica_is_failed_and_its_request_moves(tmp_path: Path) -> None:
    # Replica 0 wedges on "WEDGE" (its heartbeat thread keeps beating); the stall
    # timeout must fail it and move the request, which then wedges replica 1 too: after
    # --omni-max-retries 1 the client gets a clear error instead of a hang.
    shape = '{"0": {"replicas": 2, "engine_args": {"hang_on": "WEDGE"}}}'
    head = HeadProc(
        tmp_path,
        "echo-1stage",
        "--stage-overrides",
        shape,
        "--omni-heartbeat-timeout",
        "2",
        "--omni-stall-timeout",
        "2",
        "--omni-max-retries",
        "1",
        "--omni-restart-policy",
        "never",
    )
    try:
        head.wait_healthy()
        head.wait_up(0, 2)
        # Busy but progressing replicas are never taken for stalled.
        for i in range(3):
            assert head.chat(f"fine {i}").status_code == 200
        started = time.monotonic()
        r = head.chat("please WEDGE now")
        took = time.monotonic() - started
        assert r.status_code == 500, r.text
        message = r.json()["error"]["message"]
        assert "no progress" in message and "--omni-max-retries" in message, message
        # Two stall timeouts, each counted from the replica's last heartbeat that reported
        # no work, which may come up to one heartbeat interval (1 s) before the dispatch.
        assert 2.0 <= took < 12.0, took
        # Both were failed for the stall (a failed local replica then exits, so its
        # last state may already be DOWN).
        assert head.log().count("UP -> ERROR (engine made no progress") == 2
    finally:
        head.stop()


def test_an_explicit_replica_id_waits_for_its_live_holder_to_die_then_takes_the_slot(
    tmp_path: Path,
) -> None:
    """Two processes started with the same --replica-id: the second is refused while the
    first lives (one id, one process), says why in its log, and takes the slot once the
    head has seen the first die."""
    head = HeadProc(tmp_path, "echo", "--stage-id", "0", "--omni-heartbeat-timeout", "2")
    procs: list[Proc] = []
    try:
        head.wait_http()
        procs += [headless(tmp_path, head, 1), headless(tmp_path, head, 2)]
        first = headless(tmp_path, head, 2, "--replica-id", "7", name="first")
        procs.append(first)
        head.wait_healthy()
        wait_for(lambda: any(r["pid"] == first.pid for r in head.up_replicas(2)), 20)
        second = headless(tmp_path, head, 2, "--replica-id", "7", name="second")
        procs.append(second)
        wait_for(lambda: "held here by another live replica" in second.log(), 20)
        mine = [r for r in head.replicas(2) if r["replica_id"] == 7]
        assert [r["pid"] for r in mine] == [first.pid] and second.alive()
        first.signal(signal.SIGKILL)
        wait_for(
            lambda: [r["pid"] for r in head.up_replicas(2) if r["replica_id"] == 7] == [second.pid],
            20,
            what="the second process UP as replica 7",
        )
        assert head.chat("after").json()["choices"][0]["message"]["content"]
    finally:
        for p in procs:
            p.stop()
        head.stop()


def test_a_replica_killed_mid_answer_beside_its_busy_niced_threads_fails_over_once(
    tmp_path: Path,
) -> None:
    # A TTS replica's later chunks run on niced threads: killed, such a process is gone
    # only seconds later on busy cores. The head's death watch fails it at the kill
    # (launch/death_watch.py); either way the answer completes on the other replica and
    # the victim is restarted once, after its process is gone.
    shape = (
        '{"0": {"replicas": 2, "engine_args": {"num_chunks": 20, "chunk_delay_s": 0.05, '
        '"busy_threads": 1, "busy_nice": 19, "ballast_mb": 64}}}'
    )
    head = HeadProc(tmp_path, "echo-1stage", "--stage-overrides", shape)
    try:
        head.wait_healthy()
        head.wait_up(0, 2)
        answer: list[httpx.Response] = []
        asking = threading.Thread(target=lambda: answer.append(head.chat("one two three four")))
        asking.start()
        busy = wait_for(
            lambda: [r for r in head.up_replicas(0) if r["in_flight"]], 10, 0.01, "a busy replica"
        )
        victim = busy[0]
        os.kill(victim["pid"], signal.SIGKILL)
        asking.join(30)
        assert answer and answer[0].status_code == 200, answer
        assert answer[0].json()["choices"][0]["message"]["content"] == "one two three four [echo]"
        back = wait_for(
            lambda: [
                r
                for r in head.up_replicas(0)
                if r["replica_id"] == victim["replica_id"] and r["epoch"] != victim["epoch"]
            ],
            20,
            what="the victim restarted",
        )
        assert back[0]["restarts"] == 1 and back[0]["pid"] != victim["pid"]
        changes = head.client.get("/v1/omni/stages").json()["recent_state_changes"]
        crash = next(c for c in changes if c["state"] == "ERROR" and c["epoch"] == victim["epoch"])
        assert any(
            why in crash["reason"]
            for why in ("killed, still exiting", "exit code -9", "connection closed")
        ), crash["reason"]
    finally:
        head.stop()
