"""The authenticated control plane: --omni-auth-token on the head and its replicas."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import msgspec
import zmq
from websockets.sync.client import connect

from omnistage.protocol import codec
from omnistage.protocol.auth import Signer
from omnistage.protocol.messages import Heartbeat
from tests.integration.harness import HeadProc, headless, wait_for

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


def _first_stages_event(
    client: httpx.Client,
    params: dict[str, str] | None = None,
    headers: dict[str, str] | None = None,
) -> dict:
    """The first ``stages`` event of /v1/omni/events; the stream is then closed."""
    with client.stream("GET", "/v1/omni/events", params=params, headers=headers) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = r.iter_lines()
        for line in lines:
            if line == "event: stages":
                return msgspec.json.decode(next(lines).removeprefix("data: "))
    raise AssertionError("the stream ended before a stages event")


def test_the_event_stream_alone_takes_the_api_key_as_a_query_parameter(tmp_path: Path) -> None:
    head = HeadProc(tmp_path, "echo-1stage", "--api-key", "K&=y")
    try:
        head.wait_healthy()
        c = head.client
        assert c.get("/v1/omni/events").status_code == 401
        assert c.get("/v1/omni/events", params={"api_key": "wrong"}).status_code == 401
        both = "/v1/omni/events?api_key=K%26%3Dy&api_key=K%26%3Dy"
        assert c.get(both).status_code == 401  # exactly one key, or none
        # Only on the event stream: a key in a URL is refused everywhere else.
        assert c.get("/v1/omni/stages", params={"api_key": "K&=y"}).status_code == 401
        by_query = _first_stages_event(c, params={"api_key": "K&=y"})
        by_header = _first_stages_event(c, headers={"Authorization": "Bearer K&=y"})
        assert by_query["stages"][0]["name"] == by_header["stages"][0]["name"] == "echo"
        # Streams that were left end in the head: it keeps answering.
        assert c.get("/health").status_code == 200
    finally:
        head.stop()


def test_debug_logs_name_no_api_key_and_no_frames(tmp_path: Path) -> None:
    # At --log-level DEBUG the websockets library logs each handshake header and each
    # frame; the key must not reach the log by either way a client sends it.
    key = "sk-not-for-logs"
    head = HeadProc(tmp_path, "echo-1stage", "--api-key", key, "--log-level", "DEBUG")
    url = head.url.replace("http://", "ws://") + "/v1/realtime"
    try:
        head.wait_healthy()
        by_header = connect(url, additional_headers={"Authorization": f"Bearer {key}"})
        by_subprotocol = connect(
            url,
            subprotocols=["realtime", f"openai-insecure-api-key.{key}"],  # type: ignore[list-item]
        )
        for ws in (by_header, by_subprotocol):
            with ws:
                created = msgspec.json.decode(ws.recv(timeout=10))
                assert created["type"] == "session.created"
                ws.send(msgspec.json.encode({"type": "session.update", "session": {}}).decode())
                assert msgspec.json.decode(ws.recv(timeout=10))["type"] == "session.updated"
        wait_for(lambda: "< authorization: [redacted]" in head.log().lower(), 10, what="header")
        log = head.log()
    finally:
        head.stop()
    assert key not in log
    assert "sec-websocket-protocol: [redacted]" in log.lower()
    assert "session.created" not in log  # no line per frame
