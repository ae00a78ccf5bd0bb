"""Each replica process sees only its share of its stage's devices (CUDA_VISIBLE_DEVICES),
on the head and under --headless: read from the environment the processes actually got."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from omnistage.config.devices import DEVICE_ENV_VAR
from omnistage.replica.options import decode_options
from tests.integration.harness import HeadProc, Proc, wait_for

pytestmark = pytest.mark.skipif(
    not Path("/proc/self/environ").exists(), reason="reads /proc/<pid>/environ"
)


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(e.split("=", 1) for e in raw.decode(errors="replace").split("\0") if "=" in e)


def _seen(head: HeadProc, stage_id: int, count: int) -> dict[int, str | None]:
    """replica id -> the CUDA_VISIBLE_DEVICES its process started with (None: unset)."""
    out = {}
    for replica in head.wait_up(stage_id, count, timeout=60):
        env = _environ(replica["pid"])
        assert decode_options(env["OMNISTAGE_REPLICA_OPTIONS"]).stage_id == stage_id
        out[replica["replica_id"]] = env.get(DEVICE_ENV_VAR)
    return out


def test_the_heads_replicas_each_see_their_own_devices(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(DEVICE_ENV_VAR, "")  # the head itself has no list to index into
    overrides = {
        "0": {"devices": "0,1,2,3", "replicas": 2},
        "1": {"devices": "0,1,2,3", "replicas": 2, "devices_per_replica": 2},
    }
    head = HeadProc(tmp_path, "echo", "--stage-overrides", json.dumps(overrides))
    try:
        head.wait_healthy(60)
        assert _seen(head, 0, 2) == {0: "0", 1: "1"}
        assert _seen(head, 1, 2) == {0: "0,1", 1: "2,3"}
        assert _seen(head, 2, 1) == {0: ""}  # devices: cpu -> inherited as it is
    finally:
        head.stop()


def test_headless_replicas_each_see_their_share_of_this_hosts_devices(tmp_path: Path) -> None:
    head = HeadProc(tmp_path, "echo", "--stage-id", "0")
    host = None
    try:
        head.wait_http(60)
        host = Proc(
            [
                "serve",
                "--headless",
                "--stage-id",
                "1",
                "-oma",
                "127.0.0.1",
                "-omp",
                str(head.master_port),
                "--omni-dp-size-local",
                "2",
                "--stage-overrides",
                '{"1": {"devices": "2,3"}}',
            ],
            tmp_path / "headless.log",
            # This host's own visible devices: the shares index into them.
            env={DEVICE_ENV_VAR: "10,11,12,13"},
        )
        seen = _seen(head, 1, 2)
        assert sorted(v or "" for v in seen.values()) == ["12", "13"]
        wait_for(lambda: "see CUDA_VISIBLE_DEVICES" in host.log(), 10, what="the split logged")
    finally:
        if host is not None:
            host.stop()
        head.stop()


def _serve(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "omnistage", "serve", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            [
                "echo",
                "--stage-overrides",
                '{"1": {"devices": "0,1,2", "replicas": 2, "devices_per_replica": 2}}',
            ],
            "stage 1 (talker): 2 replica(s) x 2 device(s) each need 4 devices",
        ),
        (
            ["echo", "--stage-overrides", '{"1": {"devices": "0,x"}}'],
            "stages[1].devices: must be 'cpu' or comma-separated device indices",
        ),
        (
            [
                "--headless",
                "--stage-id",
                "1",
                "-oma",
                "127.0.0.1",
                "-omp",
                "1",
                "--omni-dp-size-local",
                "3",
                "--stage-overrides",
                '{"1": {"devices": "2,3"}}',
            ],
            "--stage-overrides: stage 1: 3 replica(s) x 1 device(s) each need 3 devices",
        ),
    ],
)
def test_a_device_split_that_does_not_fit_stops_the_start_with_exit_2(
    args: list[str], message: str
) -> None:
    result = _serve(*args)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.stderr
