"""`omnistage status` against real echo heads, run as a subprocess like an operator would."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.harness import HeadProc, free_port, wait_for

ECHO_REPLICAS = ("thinker/0", "talker/0", "vocoder/0")


def _status(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if k not in ("OMNISTAGE_API_KEY", "OMNISTAGE_URL")}
    return subprocess.run(
        [sys.executable, "-m", "omnistage", "status", *args],
        capture_output=True,
        text=True,
        timeout=30,
        env={**clean, **(env or {})},
    )


def _state_of(output: str, who: str) -> str:
    """The STATE cell of replica ``who`` ("stage/id") in a frame."""
    row = next(line for line in output.splitlines() if line.strip().startswith(who + " "))
    return row.split()[4]  # who, address, "(local)", pid, state


@pytest.fixture(scope="module")
def head(module_tmp: Path) -> Iterator[HeadProc]:
    # No restarts: a killed replica stays ERROR long enough to be seen.
    h = HeadProc(module_tmp, "echo", "--omni-restart-policy", "never", name="status-head")
    try:
        h.wait_healthy()
        yield h
    finally:
        h.stop()


def test_status_lists_every_stage_and_replica(head: HeadProc) -> None:
    result = _status("--url", head.url)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "\x1b[" not in out  # not a TTY: no colour
    assert f"pipeline echo  {head.url}" in out
    assert "health ok" in out
    for title in ("stage 0 thinker", "stage 1 talker <- thinker", "stage 2 vocoder <- talker"):
        assert title in out
    for who in ECHO_REPLICAS:
        assert _state_of(out, who) == "UP"


def test_url_comes_from_the_environment(head: HeadProc) -> None:
    result = _status(env={"OMNISTAGE_URL": head.url})
    assert result.returncode == 0, result.stderr
    assert f"pipeline echo  {head.url}" in result.stdout


def test_watch_prints_frames_separated_by_a_blank_line_until_ctrl_c(head: HeadProc) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "omnistage", "status", "--url", head.url, "--watch", "0.2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    # Ctrl-C once two frames are out (not after a fixed time: a loaded machine may take
    # seconds just to start the command).
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout or []), daemon=True)
    reader.start()
    wait_for(lambda: sum(ln.startswith("pipeline echo") for ln in lines) >= 2, 30, 0.05)
    time.sleep(0.3)  # into the next frame's wait, or midway through printing it
    proc.send_signal(signal.SIGINT)
    proc.wait(10)
    reader.join(5)
    err = proc.stderr.read() if proc.stderr else ""
    out = "".join(lines)
    assert proc.returncode == 0, err
    frames = out.split("\n\npipeline echo")
    assert len(frames) >= 2
    # Every frame is whole: each has the thinker's replica row.
    assert all("\n  thinker/0 " in "\n" + frame for frame in frames), frames


def test_a_killed_replica_shows_as_not_up_within_seconds(head: HeadProc) -> None:
    # Runs last in this module: the talker stays down afterwards.
    pid = head.up_replicas(1)[0]["pid"]
    os.kill(pid, signal.SIGKILL)

    def shown_down() -> str | None:
        out = _status("--url", head.url).stdout
        return out if _state_of(out, "talker/0") != "UP" else None

    out = wait_for(shown_down, timeout=8, interval=0.2, what="talker/0 not UP in status")
    assert _state_of(out, "talker/0") == "ERROR"
    assert "health unavailable (no live replica: talker)" in out
    assert _state_of(out, "thinker/0") == "UP"


def test_unreachable_head_is_one_line_and_exit_1_quickly() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    started = time.monotonic()
    result = _status("--url", url)
    assert time.monotonic() - started < 10
    assert result.returncode == 1
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith(f"omnistage status: error: cannot reach the head at {url}")


def test_api_key_is_required_when_the_head_has_one(module_tmp: Path) -> None:
    h = HeadProc(module_tmp, "echo-1stage", "--api-key", "sekret", name="status-key-head")
    try:
        h.wait_http()
        missing = _status("--url", h.url)
        assert missing.returncode == 1
        assert "401" in missing.stderr and "API key is missing" in missing.stderr
        wrong = _status("--url", h.url, "--api-key", "nope")
        assert wrong.returncode == 1
        assert "API key was refused" in wrong.stderr
        right = _status("--url", h.url, "--api-key", "sekret")
        assert right.returncode == 0, right.stderr
        assert "stage 0" in right.stdout
        from_env = _status("--url", h.url, env={"OMNISTAGE_API_KEY": "sekret"})
        assert from_env.returncode == 0, from_env.stderr
    finally:
        h.stop()
