"""--omni-curve-keys: every socket encrypted, only replicas with an admitted key join."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
from pathlib import Path

from tests.integration.harness import HeadProc, Proc, headless


def _keys(tmp_path: Path, name: str) -> Path:
    directory = tmp_path / name
    out = subprocess.run(
        [sys.executable, "-m", "omnistage", "curve-keys", str(directory)],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "server.key_secret" in out.stdout
    return directory


def _greeting_mechanism(port: int) -> bytes:
    """The security mechanism a ZMTP 3 peer announces in its greeting."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        # Only the signature and major version: the peer answers with its whole
        # greeting, before it could see (and reject) a mechanism of ours.
        s.sendall(b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03")
        data = b""
        while len(data) < 64:
            chunk = s.recv(64 - len(data))
            if not chunk:
                break
            data += chunk
    return data[12:32].rstrip(b"\x00")


def test_curve_encrypted_head_serves_replicas_holding_its_keys(tmp_path: Path) -> None:
    keys = _keys(tmp_path, "keys")
    head = HeadProc(tmp_path, "echo-1stage", "--stage-id", "0", "--omni-curve-keys", str(keys))
    procs: list[Proc] = []
    try:
        head.wait_healthy()  # its local replica joined over CURVE
        good = headless(tmp_path, head, 0, "--omni-curve-keys", str(keys), name="good")
        procs.append(good)
        head.wait_up(0, 2, what="keyed replica UP")
        for i in range(4):
            assert head.chat(f"secret {i}").status_code == 200
        assert _greeting_mechanism(head.master_port) == b"CURVE"

        # The head's public key but a client key it never admitted: refused.
        stranger_keys = _keys(tmp_path, "stranger")
        shutil.copy(keys / "server.key", stranger_keys / "server.key")
        stranger = headless(
            tmp_path,
            head,
            0,
            "--omni-curve-keys",
            str(stranger_keys),
            "--stage-init-timeout",
            "3",
            name="stranger",
        )
        plain = headless(tmp_path, head, 0, "--stage-init-timeout", "3", name="plain")
        procs += [stranger, plain]
        assert stranger.wait(20) == 1
        assert plain.wait(20) == 1
        assert "no answer from the master" in stranger.log()
        assert "--omni-curve-keys" in plain.log()
        assert len(head.replicas(0)) == 2  # neither got as far as registering
    finally:
        for p in procs:
            p.stop()
        head.stop()


def test_missing_curve_keys_are_a_usage_error(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "omnistage", "serve", "echo", "--omni-curve-keys", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 2
    assert "server.key_secret not found" in out.stderr
    assert "omnistage curve-keys" in out.stderr
