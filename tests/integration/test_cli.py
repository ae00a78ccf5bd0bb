"""`omnistage serve` flag validation: exit code 2 and one line naming the flag."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from omnistage.cli.args import build_parser, validate

M = ["-oma", "127.0.0.1", "-omp", "1"]


def _serve(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "omnistage", "serve", *args],
        capture_output=True,
        text=True,
        timeout=30,
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--stage-id", "0"], "--stage-id requires both --omni-master-address"),
        (["--stage-id", "0", "-oma", "127.0.0.1"], "--stage-id requires both"),
        (["--stage-id", "0", "-omp", "1"], "--stage-id requires both"),
        (["--omni-replica-address", "10.0.0.2"], "--omni-replica-address requires --headless"),
        (["--omni-replica-binds-sockets"], "--omni-replica-binds-sockets requires --headless"),
        (["--replica-id", "3"], "--replica-id requires --headless"),
        (["--headless", "--stage-id", "1", *M, "--replica-id", "-2"], "--replica-id must be >= 0"),
        (
            ["--headless", "--stage-id", "1", *M, "--replica-id", "2", "--omni-dp-size-local", "2"],
            "--replica-id names one replica",
        ),
        (
            ["--headless", "--stage-id", "1", *M, "--stage-overrides", '{"1": {"x": 1}}'],
            "unknown stage field(s) x",
        ),
        (["--omni-dp-size-local", "-1"], "--omni-dp-size-local must be >= 0, got -1"),
        (["--omni-dp-size-local", "2"], "--omni-dp-size-local != 1 requires --stage-id"),
        (["--omni-heartbeat-timeout", "0"], "--omni-heartbeat-timeout must be > 0"),
        (["--omni-heartbeat-timeout", "-3"], "--omni-heartbeat-timeout must be > 0"),
        (["--omni-heartbeat-timeout", "1.5"], "at least twice the heartbeat interval"),
        (["--omni-lb-policy", "fastest"], "--omni-lb-policy='fastest' is not one of"),
        (["--headless"], "--headless requires --stage-id"),
        (["--headless", "--stage-id", "1"], "--headless requires both --omni-master-address"),
        (["--stage-id", "-1", *M], "--stage-id must be >= 0"),
        (["--stage-id", "7", *M], "--stage-id 7 is not a stage of 'voice'"),
        (["--worker-backend", "threads"], "--worker-backend='threads' is not one of"),
        (
            ["--worker-backend", "ray", "--headless", "--stage-id", "1", *M],
            "--worker-backend ray is for the head",
        ),
        (["--ray-address", "auto"], "--ray-address requires --worker-backend ray"),
        (["--worker-backend", "ray", "--ray-address", " "], "--ray-address must not be empty"),
        (["--stage-init-timeout", "0"], "--stage-init-timeout must be > 0"),
        (["--omni-max-queue", "-1"], "--omni-max-queue must be >= 0"),
        (["--omni-max-retries", "-1"], "--omni-max-retries must be >= 0, got -1"),
        (["--omni-stall-timeout", "-1"], "--omni-stall-timeout must be >= 0, got -1"),
        (
            ["--omni-stall-timeout", "3"],
            "--omni-stall-timeout (3s) must be 0 or at least --omni-heartbeat-timeout (5s)",
        ),
        (
            ["--omni-stall-timeout", "8", "--omni-heartbeat-timeout", "10"],
            "--omni-stall-timeout (8s) must be 0 or at least --omni-heartbeat-timeout (10s)",
        ),
        (["--max-request-bytes", "0"], "--max-request-bytes must be >= 1"),
        (["--realtime-max-sessions", "0"], "--realtime-max-sessions must be >= 1, got 0"),
        (["--realtime-idle-timeout", "0"], "--realtime-idle-timeout must be > 0, got 0"),
        (["--init-timeout", "-1"], "--init-timeout must be > 0"),
        (["--drain-timeout", "-1"], "--drain-timeout must be >= 0"),
        (["--omni-restart-policy", "maybe"], "--omni-restart-policy='maybe' is not one of"),
        (["--port", "70000"], "--port must be in 0..65535"),
        (["no-such-pipeline"], "is neither a deploy config file nor a built-in pipeline"),
        (["echo", "--deploy-config", "x.yaml"], "either MODEL_OR_CONFIG or --deploy-config"),
        (["--stage-overrides", "{nope"], "--stage-overrides: not valid JSON"),
        (["--stage-overrides", '{"9": {}}'], "no stage with stage_id 9"),
        (["--stage-overrides", '{"1": {"replicas": -2}}'], "stages[1].replicas"),
    ],
)
def test_invalid_flags_exit_2_with_one_line_naming_the_flag(args: list[str], message: str) -> None:
    result = _serve(*args)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert message in lines[0]
    assert lines[0].startswith("omnistage serve: error:")


@pytest.mark.parametrize(
    "args",
    [
        ["--omni-max-retries", "0"],  # fail a request at once when its replica fails
        ["--omni-max-retries", "5"],
        ["--omni-stall-timeout", "0"],  # stall detection off
        ["--omni-stall-timeout", "5"],  # equal to the default heartbeat timeout
        ["--omni-stall-timeout", "3", "--omni-heartbeat-timeout", "3"],
        ["--omni-stall-timeout", "0", "--omni-heartbeat-timeout", "30"],
    ],
)
def test_valid_retry_and_stall_flags_pass_validation(args: list[str]) -> None:
    # In-process: a valid command line would start serving, not exit.
    validate(build_parser().parse_args(["serve", *args]))


def test_retry_and_stall_defaults() -> None:
    args = build_parser().parse_args(["serve"])
    flags = validate(args)
    assert (flags.omni_max_retries, flags.omni_stall_timeout) == (2, 60.0)
    assert args.omni_stall_timeout is None  # validate returns a copy; args stay as parsed
    # A long heartbeat timeout alone is valid: the stall default follows it.
    args = build_parser().parse_args(["serve", "--omni-heartbeat-timeout", "90"])
    assert validate(args).omni_stall_timeout == 90.0


def test_bad_deploy_config_names_the_yaml_path(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "pipeline: p\nstages:\n"
        "  - {stage_id: 0, name: a, engine: echo}\n"
        "  - {stage_id: 1, name: b, engine: echo, inputs: [0], final_output: true,\n"
        "     engine_args: {num_chunks: -1}}\n"
    )
    result = _serve("--deploy-config", str(bad))
    assert result.returncode == 2
    assert "stages[1].engine_args.num_chunks" in result.stderr
    assert str(bad) in result.stderr


def test_version_flag() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "omnistage", "--version"], capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 0
    assert result.stdout.startswith("omnistage ")


def test_ray_backend_without_ray_installed_says_what_to_install(tmp_path: Path) -> None:
    # Ray is installed here: hide it with an import hook that refuses `ray`.
    hook = tmp_path / "sitecustomize.py"
    hook.write_text(
        "import importlib.abc, sys\n"
        "class _NoRay(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path, target=None):\n"
        "        if name == 'ray' or name.startswith('ray.'):\n"
        "            raise ModuleNotFoundError(name)\n"
        "sys.meta_path.insert(0, _NoRay())\n"
    )
    result = subprocess.run(
        [sys.executable, "-m", "omnistage", "serve", "echo", "--worker-backend", "ray"],
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
    )
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines[-1].endswith("--worker-backend ray needs Ray: pip install 'omnistage[ray]'")


def test_a_store_written_by_a_newer_omnistage_stops_the_head_with_a_clear_error(
    tmp_path: Path,
) -> None:
    import sqlite3

    from tests.integration.harness import free_port

    db = tmp_path / "newer.db"
    with sqlite3.connect(db) as conn:  # what a newer omnistage's migration leaves
        conn.execute("CREATE TABLE omnistage_alembic_version (version_num VARCHAR(32))")
        conn.execute("INSERT INTO omnistage_alembic_version VALUES ('9999_from_the_future')")
    result = _serve(
        "echo-1stage",
        *("--port", str(free_port()), "-oma", "127.0.0.1", "-omp", str(free_port())),
        *("--store-url", f"sqlite:///{db}"),
    )
    assert result.returncode == 1
    assert "--store-url: cannot open the store" in result.stderr
    assert "'9999_from_the_future', written by a newer omnistage" in result.stderr
