"""--realtime-max-sessions and --realtime-idle-timeout, against real heads over real
WebSocket handshakes (the ``websockets`` client)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import ClientConnection, connect

from tests.integration.harness import HeadProc, wait_for


def _url(head: HeadProc) -> str:
    return head.url.replace("http://", "ws://") + "/v1/realtime"


def _open(head: HeadProc, sockets: contextlib.ExitStack) -> ClientConnection:
    """A session, open until ``sockets`` closes (or it is closed before)."""
    ws = sockets.enter_context(connect(_url(head), open_timeout=10))
    first = msgspec.json.decode(ws.recv(timeout=10))
    assert first["type"] == "session.created", first
    return ws


def _refusal(head: HeadProc) -> tuple[int, dict]:
    with pytest.raises(InvalidStatus) as caught, connect(_url(head), open_timeout=10):
        pass
    response = caught.value.response
    return response.status_code, msgspec.json.decode(response.body)


@pytest.fixture(scope="module")
def two_sessions(module_tmp: Path) -> Iterator[HeadProc]:
    head = HeadProc(module_tmp, "echo-1stage", "--realtime-max-sessions", "2", name="two")
    try:
        head.wait_healthy()
        yield head
    finally:
        head.stop()


def test_a_session_past_the_limit_is_refused_with_429_until_one_closes(
    two_sessions: HeadProc,
) -> None:
    with contextlib.ExitStack() as sockets:
        first, second = _open(two_sessions, sockets), _open(two_sessions, sockets)
        status, body = _refusal(two_sessions)
        assert status == 429
        assert body["error"]["code"] == "session_limit_reached"
        assert body["error"]["type"] == "invalid_request_error"
        assert "2" in body["error"]["message"]
        # The two held sessions still work.
        second.send('{"type": "session.update", "session": {"type": "realtime"}}')
        assert msgspec.json.decode(second.recv(timeout=10))["type"] == "session.updated"
        first.close()

        def third() -> ClientConnection | None:
            try:
                return _open(two_sessions, sockets)
            except InvalidStatus as exc:
                assert exc.response.status_code == 429
                return None

        # The head frees the slot once it has seen the close: shortly, not at once.
        wait_for(third, 10, 0.1, "a session after one closed")


@pytest.fixture(scope="module", params=[1, 2], ids=["head-serves-http", "2-api-servers"])
def idle_head(module_tmp: Path, request: pytest.FixtureRequest) -> Iterator[HeadProc]:
    # With --api-server-count 2 the limit travels to the API server processes.
    args = ("--realtime-idle-timeout", "1", "--api-server-count", str(request.param))
    head = HeadProc(module_tmp, "echo-1stage", *args, name=f"idle-{request.param}")
    try:
        head.wait_healthy()
        yield head
    finally:
        head.stop()


def test_a_silent_session_gets_session_idle_timeout_and_is_closed(idle_head: HeadProc) -> None:
    with contextlib.ExitStack() as sockets:
        ws = _open(idle_head, sockets)
        opened = time.monotonic()
        event = msgspec.json.decode(ws.recv(timeout=10))
        waited = time.monotonic() - opened
        assert event["type"] == "error", event
        assert event["error"]["code"] == "session_idle_timeout"
        assert 0.8 <= waited < 5, waited
        with pytest.raises(ConnectionClosed):
            ws.recv(timeout=5)


def test_a_session_that_keeps_talking_is_not_idle(idle_head: HeadProc) -> None:
    with contextlib.ExitStack() as sockets:
        ws = _open(idle_head, sockets)
        for _ in range(5):  # 2.5 s in all, each gap half the idle timeout
            time.sleep(0.5)
            ws.send('{"type": "input_audio_buffer.clear"}')
            event = msgspec.json.decode(ws.recv(timeout=10))
            assert event["type"] == "input_audio_buffer.cleared", event
