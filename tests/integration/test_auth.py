"""The authenticated control plane: --omni-auth-token on the head and its replicas."""

from __future__ import annotations

import time
from pathlib import Path

import msgspec
import zmq

from omnistage.protocol import codec
from omnistage.protocol.auth import Signer
from omnistage.protocol.messages import Heartbeat
from tests.integration.harness import HeadProc, headless

TOKEN = "correct horse battery staple"


def _register(port: int, body: bytes) -> dict:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(f"tcp://127.0.0.1:{port}")
        sock.send(body)
        assert sock.poll(5000)
        return msgspec.msgpack.decode(sock.recv())
    finally:
        sock.close()


def test_registrations_need_the_token(tmp_path: Path) -> None:
    head = HeadProc(tmp_path, "echo-1stage", "--omni-auth-token", TOKEN)
    try:
        head.wait_healthy()  # the head's own replica got the token and joined
        payload = {"stage_id": 0, "replica_id": -1}
        plain = _register(head.master_port, codec.encode_register_request(payload))
        assert "unauthenticated" in plain["error"]
        wrong = _register(head.master_port, codec.encode_register_request(payload, Signer("x")))
        assert "authentication failed" in wrong["error"]
        signed = codec.encode_register_request(payload, Signer(TOKEN))
        assert "handshake_address" in _register(head.master_port, signed)
        assert "replayed" in _register(head.master_port, signed)["error"]
        stale = Signer(TOKEN, clock=lambda: time.time() - 300)
        assert (
            "stale"
            in _register(head.master_port, codec.encode_register_request(payload, stale))["error"]
        )
    finally:
        head.stop()


def test_headless_replicas_join_with_the_token_and_fail_clearly_without(
    tmp_path: Path,
) -> None:
    head = HeadProc(tmp_path, "echo-1stage", "--stage-id", "0", "--omni-auth-token", TOKEN)
    try:
        head.wait_healthy()
        good = headless(tmp_path, head, 0, "--omni-auth-token", TOKEN, name="good")
        head.wait_up(0, 2, what="authenticated replica UP")
        bad = headless(tmp_path, head, 0, "--omni-auth-token", "wrong", name="bad")
        assert bad.wait(20) == 1
        assert "authentication failed" in bad.log()
        assert len(head.up_replicas(0)) == 2
        for i in range(4):
            assert head.chat(f"authenticated {i}").status_code == 200
        good.stop()
    finally:
        head.stop()


def test_forged_heartbeats_do_not_change_replica_state(tmp_path: Path) -> None:
    head = HeadProc(tmp_path, "echo-1stage", "--omni-auth-token", TOKEN)
    try:
        head.wait_healthy()
        (replica,) = head.up_replicas(0)
        reply = _register(
            head.master_port,
            codec.encode_register_request({"stage_id": 0, "replica_id": 5}, Signer(TOKEN)),
        )
        coord = zmq.Context.instance().socket(zmq.DEALER)
        coord.setsockopt(zmq.LINGER, 0)
        coord.connect(reply["coordinator_router_address"])
        down = Heartbeat(0, replica["replica_id"], replica["epoch"], "DOWN", 0, 0, 0, 10**9)
        coord.send_multipart(codec.encode(down))  # no stamp
        coord.send_multipart(codec.sign(codec.encode(down), Signer("guess")))  # wrong key
        time.sleep(1.5)
        coord.close()
        assert [r["state"] for r in head.replicas(0) if r["replica_id"] == 0] == ["UP"]
        assert "unauthenticated message" in head.log()
        assert head.chat("still here").status_code == 200
    finally:
        head.stop()
