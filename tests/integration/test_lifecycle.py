"""Aborts, stage errors, missing stages, shutdown and start-up timeouts."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import httpx
import pytest

from tests.integration.harness import HeadProc, Proc, free_port, headless, wait_for

# A long request: 40 chunks x 0.2 s = 8 s on the thinker (prompts of 40+ characters).
SLOW = json.dumps({"0": {"engine_args": {"num_chunks": 40, "chunk_delay_s": 0.2}}})
LONG_PROMPT = "a long story that goes on and on and on and on"


def _all_idle(head: HeadProc) -> bool:
    for stage in head.stages()["stages"]:
        for r in stage["replicas"]:
            if r["in_flight"] or r["reported_in_flight"]:
                return False
    return True


def _busy_anywhere(head: HeadProc) -> bool:
    return any(r["reported_in_flight"] for s in head.stages()["stages"] for r in s["replicas"])


@pytest.fixture(scope="module")
def slow_head(module_tmp: Path):  # type: ignore[no-untyped-def]
    head = HeadProc(module_tmp, "echo", "--stage-overrides", SLOW, name="slow-head")
    try:
        head.wait_healthy()
        yield head
    finally:
        head.stop()


def test_streaming_client_disconnect_aborts_every_stage(slow_head: HeadProc) -> None:
    body = {"messages": [{"role": "user", "content": LONG_PROMPT}], "stream": True}
    with (
        httpx.Client(base_url=slow_head.url, timeout=10) as client,
        client.stream("POST", "/v1/chat/completions", json=body) as r,
    ):
        # Keep a reference: a dropped line iterator closes the response (a disconnect).
        lines = r.iter_lines()
        for seen, line in enumerate(lines):
            if line.startswith("data: ") and '"content":"a' in line.replace(" ", ""):
                break
            assert seen < 50
        wait_for(lambda: _busy_anywhere(slow_head), 3, what="replicas report the request")
    left_at = time.monotonic()
    # The request would run ~7 s more; aborted, every stage is idle within a heartbeat.
    wait_for(lambda: _all_idle(slow_head), 2.5, what="every stage idle after disconnect")
    assert time.monotonic() - left_at < 2.5


def test_non_streaming_client_disconnect_aborts_every_stage(slow_head: HeadProc) -> None:
    with (
        httpx.Client(base_url=slow_head.url, timeout=1.0) as client,
        pytest.raises(httpx.ReadTimeout),
    ):
        client.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": LONG_PROMPT}]},
        )
    wait_for(lambda: _all_idle(slow_head), 2.5, what="every stage idle after the client left")


def test_stage_error_is_a_clear_500_and_the_server_stays_up(tmp_path: Path) -> None:
    overrides = json.dumps({"1": {"engine_args": {"fail_on": "BOOM"}}})
    head = HeadProc(tmp_path, "echo", "--stage-overrides", overrides)
    try:
        head.wait_healthy()
        r = head.chat("please BOOM")
        assert r.status_code == 500
        error = r.json()["error"]
        assert error["code"] == "stage_failed"
        assert "stage 1 (talker)" in error["message"]
        assert "fail" in error["message"]
        # A streamed request that fails before its first output gets the same status:
        # the response is held until the first output exists.
        body = {"messages": [{"role": "user", "content": "BOOM again"}], "stream": True}
        streamed = head.client.post("/v1/chat/completions", json=body)
        assert streamed.status_code == 500
        assert streamed.json()["error"]["code"] == "stage_failed"
        ok = head.chat("fine")
        assert ok.status_code == 200
        assert ok.json()["choices"][0]["message"]["content"].startswith("fine")
        assert _all_idle(head)
    finally:
        head.stop()


def test_missing_stage_is_a_bounded_503_not_a_hang(tmp_path: Path) -> None:
    head = HeadProc(tmp_path, "echo", "--stage-id", "0", "--omni-stage-wait-timeout", "0.5")
    try:
        head.wait_http()
        wait_for(lambda: head.up_replicas(0), 20, what="stage 0 UP")
        health = head.client.get("/health")
        assert health.status_code == 503
        assert "1 (talker)" in health.json()["error"]["message"]
        stages = {s["stage_id"]: s["status"] for s in head.stages()["stages"]}
        assert stages == {0: "ready", 1: "waiting", 2: "waiting"}
        started = time.monotonic()
        r = head.chat("anyone?")
        assert r.status_code == 503
        assert time.monotonic() - started < 3
        assert r.headers["retry-after"] == "1"
        assert r.json()["error"]["type"] == "service_unavailable"
        # Streaming requests learn it before the stream starts, too.
        body = {"messages": [{"role": "user", "content": "x"}], "stream": True}
        assert head.client.post("/v1/chat/completions", json=body).status_code == 503
    finally:
        head.stop()


@pytest.mark.parametrize(
    ("how", "binds"), [("sigterm", False), ("sigkill", False), ("sigterm", True)]
)
def test_headless_replicas_rejoin_a_restarted_head_without_restarting(
    tmp_path: Path, how: str, binds: bool
) -> None:
    # Heartbeat timeout 2 s: after a kill -9 the replicas give up on the head after
    # 2 x 2 s without an answer; after a SIGTERM the head tells them it is leaving.
    flags = ("echo-1stage", "--stage-id", "0", "--omni-heartbeat-timeout", "2")
    head = HeadProc(tmp_path, *flags)
    replica: Proc | None = None
    second: HeadProc | None = None
    try:
        head.wait_healthy()
        extra = ["--omni-replica-binds-sockets"] if binds else []
        replica = headless(tmp_path, head, 0, "--omni-dp-size-local", "2", *extra)
        wait_for(lambda: len(head.up_replicas(0)) == 3, 20, what="two headless replicas UP")
        pids = {r["pid"] for r in head.up_replicas(0) if not r["local"]}
        if how == "sigterm":
            assert head.stop() == 0
        else:
            head.signal(signal.SIGKILL)
            head.wait(5)
        wait_for(lambda: replica.log().count("registering again") >= 2, 15, what="replicas notice")
        assert replica.alive()

        second = HeadProc(
            tmp_path, *flags, "-oma", "127.0.0.1", "-omp", str(head.master_port), name="head2"
        )
        second.wait_healthy()
        wait_for(lambda: len(second.up_replicas(0)) == 3, 30, what="replicas rejoined")
        # The same processes, engines still loaded: nobody restarted them.
        assert {r["pid"] for r in second.up_replicas(0) if not r["local"]} == pids
        assert replica.log().count("rejoined the head") == 2
        for i in range(6):
            assert second.chat(f"after the restart {i}").status_code == 200
        assert sum(r["dispatched_total"] for r in second.up_replicas(0) if not r["local"]) > 0
    finally:
        if replica is not None:
            replica.stop()
        if second is not None:
            second.stop()
        head.stop()


def test_a_head_killed_and_started_again_at_once_gets_its_replicas_back_at_once(
    tmp_path: Path,
) -> None:
    # Heartbeat timeout 30 s: the replicas would give up on the dead head only after
    # 60 s of silence. They are back with the new head long before: they see the dead
    # head's connection close (or the new head answer their probe at the master).
    flags = ("echo-1stage", "--stage-id", "0", "--omni-heartbeat-timeout", "30")
    head = HeadProc(tmp_path, *flags)
    replica: Proc | None = None
    second: HeadProc | None = None
    try:
        head.wait_healthy()
        replica = headless(tmp_path, head, 0, "--omni-dp-size-local", "2")
        wait_for(lambda: len(head.up_replicas(0)) == 3, 20, what="two headless replicas UP")
        pids = {r["pid"] for r in head.up_replicas(0) if not r["local"]}
        head.signal(signal.SIGKILL)
        head.wait(5)
        killed = time.monotonic()
        second = HeadProc(
            tmp_path, *flags, "-oma", "127.0.0.1", "-omp", str(head.master_port), name="head2"
        )
        second.wait_healthy()
        wait_for(lambda: len(second.up_replicas(0)) == 3, 20, what="replicas rejoined")
        assert time.monotonic() - killed < 30, "the probe, not the 60 s silence, brought them"
        assert {r["pid"] for r in second.up_replicas(0) if not r["local"]} == pids
        # Each noticed the dead head by its closed connection, or, had the new head come
        # first, by the master's answer to its probe; never by the 60 s of silence.
        log = replica.log()
        noticed = log.count("closed its connection") + log.count("a new head answers")
        assert noticed == 2 and "no answer from the head" not in log
        assert second.chat("after the restart").status_code == 200
    finally:
        if replica is not None:
            replica.stop()
        if second is not None:
            second.stop()
        head.stop()


def test_sigterm_to_a_headless_replica_reports_down_and_exits_cleanly(tmp_path: Path) -> None:
    head = HeadProc(tmp_path, "echo-1stage", "--stage-id", "0")
    replica: Proc | None = None
    try:
        head.wait_healthy()
        replica = headless(tmp_path, head, 0)
        wait_for(lambda: len(head.up_replicas(0)) == 2, 20, what="headless replica UP")
        rid = next(r["replica_id"] for r in head.up_replicas(0) if r["pid"] == replica.pid)
        replica.signal(signal.SIGTERM)
        assert replica.wait(10) == 0
        states = {r["replica_id"]: r["state"] for r in head.replicas(0)}
        assert states[rid] == "DOWN"
        assert head.chat("still served").status_code == 200
    finally:
        if replica is not None:
            replica.stop()
        head.stop()


def test_replica_with_no_master_fails_naming_the_timeout_flag(tmp_path: Path) -> None:
    port = free_port()  # nothing listens here
    replica = Proc(
        [
            "serve",
            "--headless",
            "--stage-id",
            "0",
            "-oma",
            "127.0.0.1",
            "-omp",
            str(port),
            "--stage-init-timeout",
            "1",
        ],
        tmp_path / "orphan.log",
    )
    try:
        assert replica.wait(15) == 1
        assert "--stage-init-timeout" in replica.log()
    finally:
        replica.stop()


def test_head_gives_up_after_init_timeout_when_a_stage_never_joins(tmp_path: Path) -> None:
    head = HeadProc(tmp_path, "echo", "--stage-id", "0", "--init-timeout", "2")
    try:
        assert head.wait(20) == 1
        assert "--init-timeout" in head.log()
        assert "1 (talker)" in head.log()
    finally:
        head.stop()


def test_a_stage_failing_mid_stream_reports_in_band_then_done(tmp_path: Path) -> None:
    overrides = json.dumps(
        {
            "0": {"engine_args": {"num_chunks": 4, "chunk_delay_s": 0.05}},
            "2": {"engine_args": {"fail_on": "Z"}},
        }
    )
    head = HeadProc(tmp_path, "echo", "--stage-overrides", overrides)
    try:
        head.wait_healthy()
        body = {"messages": [{"role": "user", "content": "okay fine Z"}], "stream": True}
        with head.client.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200  # output had started when the stage failed
            lines = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert '"content":"oka' in lines[1]
        assert '"stage_failed"' in lines[-2] and "stage 2 (vocoder)" in lines[-2]
        assert lines[-1] == "data: [DONE]"
        assert head.chat("all good").status_code == 200
    finally:
        head.stop()


def test_head_fails_fast_when_a_local_replica_cannot_start(tmp_path: Path) -> None:
    # A listener whose model is nowhere: its engine fails to start.
    config = tmp_path / "listen.yaml"
    config.write_text(
        "pipeline: listen\nstages:\n"
        "  - {stage_id: 0, name: listener, engine: asr, final_output: true,\n"
        "     prompt_modalities: [audio], engine_args: {model: /nonexistent/whisper}}\n"
    )
    started = time.monotonic()
    head = HeadProc(tmp_path, str(config))
    try:
        assert head.wait(30) == 1
        assert time.monotonic() - started < 20  # not the 600 s --init-timeout
        log = head.log()
        assert "/nonexistent/whisper" in log and "downloads no weights" in log
        assert "stage 0 (listener) replica 0 exited with code 1 while starting" in log
    finally:
        head.stop()


def test_a_taken_http_port_fails_before_anything_starts(
    echo_head: HeadProc, tmp_path: Path
) -> None:
    second = Proc(["serve", "echo", "--port", str(echo_head.port)], tmp_path / "second.log")
    try:
        assert second.wait(30) == 1
        assert f"cannot listen on 127.0.0.1:{echo_head.port} (--host/--port)" in second.log()
        assert "started stage" not in second.log()  # no replica was launched
        assert echo_head.client.get("/health").status_code == 200
    finally:
        second.stop()


def test_a_long_start_shows_what_the_engine_is_doing(tmp_path: Path) -> None:
    # The engine's start takes 4 s; meanwhile its heartbeats say why it is STARTING.
    overrides = json.dumps({"0": {"engine_args": {"start_delay_s": 4}}})
    head = HeadProc(tmp_path, "echo-1stage", "--stage-overrides", overrides)
    try:

        def starting_detail() -> str | None:
            try:
                replicas = head.replicas(0)
            except (httpx.HTTPError, ValueError):
                return None
            starting = [r["reason"] for r in replicas if r["state"] == "STARTING"]
            return starting[0] if starting and starting[0] else None

        # First "loading the echo engine", then what the engine's start says.
        wait_for(
            lambda: starting_detail() == "warming up for 4s", 15, 0.1, what="a STARTING detail"
        )
        head.wait_healthy(timeout=30)
        (replica,) = head.up_replicas(0)
        assert replica["reason"] != "warming up for 4s"  # UP says why it is UP
        assert head.chat("after the long start").status_code == 200
    finally:
        head.stop()
