"""Session resume (our Realtime extension) with real processes: a session's config and
conversation are saved as they change, the process holding it is killed with SIGKILL,
and the client resumes it elsewhere with ``?session_id=`` and its token. WebRTC calls
(``tests.webrtc_client``) are saved the same way: a new call resumes one, and so does
the WebSocket.

An echo head with two API server processes (``--api-server-count 2``) sharing a SQLite
store; and two heads behind haproxy sharing a PostgreSQL store. The echo stage answers
with every message it was sent (``echo_messages``), so an answer shows the instructions
and the conversation the thinker read.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import psutil
import pytest
import sqlalchemy as sa
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import ClientConnection, connect

from omnistage.store.engine import engine_url
from tests.integration.harness import HeadProc, free_port, headless, wait_for
from tests.integration.test_api_servers import _api_servers
from tests.integration.test_head_fleet import (
    _haproxy,
    _proxy_up,
    echo_config,
    fleet_head,
    stop_all,
    wait_up,
)
from tests.webrtc_client import Caller

ECHO = {"0": {"engine_args": {"echo_messages": True, "num_chunks": 2, "suffix": ""}}}


@pytest.fixture(scope="module")
def fronted(module_tmp: Path) -> Iterator[HeadProc]:
    head = HeadProc(
        module_tmp,
        "echo-1stage",
        "--api-server-count",
        "2",
        "--stage-overrides",
        json.dumps(ECHO),
        "--store-url",
        f"sqlite:///{module_tmp / 'resume.db'}",
        "--media-url",
        str(module_tmp / "resume-media"),
        "--api-key",
        "key-a,key-b",
        name="resume-head",
    )
    try:
        head.wait_healthy()
        wait_for(lambda: len(_api_servers(head)) == 2, 20, what="two API servers")
        yield head
    finally:
        head.stop()


class Client:
    """One WebSocket of a Realtime session, typed turns answered in text."""

    def __init__(self, head: HeadProc | str, key: str = "key-a", query: str = "") -> None:
        base = head if isinstance(head, str) else head.url
        url = base.replace("http://", "ws://") + "/v1/realtime" + query
        headers = {"Authorization": f"Bearer {key}"}
        opened = connect(url, additional_headers=headers, open_timeout=10)
        self.ws: ClientConnection = opened.__enter__()  # as a with block would
        self.created = self.recv()
        assert self.created["type"] == "session.created", self.created

    def recv(self) -> dict[str, Any]:
        while True:  # past the rate_limits.updated that follows each answer
            event = msgspec.json.decode(self.ws.recv(timeout=15))
            if event["type"] != "rate_limits.updated":
                return event

    def send(self, event: dict[str, Any]) -> None:
        self.ws.send(msgspec.json.encode(event).decode())

    def until(self, kind: str) -> dict[str, Any]:
        while (event := self.recv())["type"] != kind:
            assert event["type"] != "error", event
        return event

    def turn(self, text: str) -> str:
        item = {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": text}],
        }
        self.send({"type": "conversation.item.create", "item": item})
        self.send({"type": "response.create", "response": {"output_modalities": ["text"]}})
        response = self.until("response.done")["response"]
        assert response["status"] == "completed", response
        return "".join(p["text"] for p in response["output"][0]["content"])

    def server_pid(self, head: HeadProc) -> int:
        """The API server process at the other end of this socket."""
        port = self.ws.socket.getsockname()[1]
        for pid in _api_servers(head):
            conns = psutil.Process(pid).net_connections(kind="tcp")
            if any(c.raddr and c.raddr.port == port for c in conns):
                return pid
        raise AssertionError("no API server holds the socket")


def _resume(head: HeadProc | str, session_id: str, token: str, key: str = "key-a") -> Client:
    return Client(head, key, f"?session_id={session_id}&resume_token={token}")


def _refused(head: HeadProc, query: str, key: str = "key-a") -> int:
    with pytest.raises(InvalidStatus) as refused:
        Client(head, key, query)
    return refused.value.response.status_code


def _begin(url: HeadProc | str) -> tuple[Client, str, str]:
    """A session with instructions and one turn: the client, the token, the answer."""
    first = Client(url)
    assert first.created["resume"]["resumed"] is False
    first.send({"type": "session.update", "session": {"instructions": "Be brief."}})
    first.until("session.updated")
    said = first.turn("my name is Ada")
    assert said == "system: Be brief.\nuser: my name is Ada"
    return first, first.created["resume"]["token"], said


def _wait_saved(store_url: str, client: Client | str) -> None:
    """Until the store holds the turn of ``client``'s session (or the session of that
    id): a save follows its event by one write (a kill before it loses that change, as
    the docs say)."""
    engine = sa.create_engine(engine_url(store_url))
    table = sa.table("realtime_sessions", sa.column("id"), sa.column("items", sa.JSON))
    sid = client if isinstance(client, str) else client.created["session"]["id"]
    query = sa.select(table.c["items"]).where(table.c.id == sid)

    def saved() -> bool:
        with engine.connect() as conn:
            items = conn.execute(query).scalar_one()
        return [row["item"]["status"] for row in items] == ["completed"] * 2

    try:
        wait_for(saved, 30, what="the turn saved")
    finally:
        engine.dispose()


def _goes_on(again: Client, session_id: str, token: str, said: str) -> None:
    """The resumed session: its id, config and conversation, and an answer that reads
    them."""
    assert again.created["session"]["id"] == session_id
    assert again.created["session"]["instructions"] == "Be brief."
    assert again.created["resume"] == {"token": token, "resumed": True, "expires_in": 600.0}
    # The conversation is replayed in order, as conversation.item.done events.
    replayed = [again.recv() for _ in range(2)]
    assert [e["type"] for e in replayed] == ["conversation.item.done"] * 2
    user, answer = (e["item"] for e in replayed)
    assert replayed[1]["previous_item_id"] == user["id"]
    assert user["content"][0]["text"] == "my name is Ada"
    assert (answer["role"], answer["status"]) == ("assistant", "completed")
    assert answer["content"][0]["text"] == said
    # The next answer reads the instructions and the whole conversation.
    assert again.turn("what is my name?") == (
        f"system: Be brief.\nuser: my name is Ada\nassistant: {said}\nuser: what is my name?"
    )
    again.ws.close()


def test_a_session_resumes_on_the_other_api_server_after_a_kill(
    fronted: HeadProc, module_tmp: Path
) -> None:
    first, token, said = _begin(fronted)
    sid = first.created["session"]["id"]
    _wait_saved(f"sqlite:///{module_tmp / 'resume.db'}", first)
    victim = first.server_pid(fronted)
    os.kill(victim, signal.SIGKILL)
    with pytest.raises(ConnectionClosed):
        first.recv()

    # Neither another key with the token nor the key without it takes the session over.
    assert _refused(fronted, f"?session_id={sid}&resume_token={token}", "key-b") == 404
    assert _refused(fronted, f"?session_id={sid}&resume_token=guess") == 404

    again = _resume(fronted, sid, token)
    assert again.server_pid(fronted) != victim
    _goes_on(again, sid, token, said)


def test_a_resume_closes_the_connection_that_held_the_session(fronted: HeadProc) -> None:
    held = Client(fronted)
    sid, token = held.created["session"]["id"], held.created["resume"]["token"]
    taken = _resume(fronted, sid, token)
    # The old connection's next change is not saved over the new one's: it is told, and
    # closed.
    held.send({"type": "session.update", "session": {"instructions": "mine"}})
    held.until("session.updated")
    assert held.recv()["error"]["code"] == "session_resumed_elsewhere"
    with pytest.raises(ConnectionClosed):
        held.recv()
    assert taken.turn("still here") == "user: still here"
    taken.ws.close()


def test_an_unknown_session_is_a_404(fronted: HeadProc) -> None:
    assert _refused(fronted, "?session_id=sess_nope&resume_token=x") == 404


# ------------------------------------------------------------------ WebRTC calls


async def _webrtc(head: HeadProc, query: str = "") -> tuple[Caller, dict[str, Any]]:
    """A call (``query``: a resume's) and its ``session.created``."""
    caller = Caller()
    r = await caller.call(head.url, "key-a", {"type": "realtime"}, query)
    assert r.status_code == 201, r.text
    return caller, await caller.next("session.created", 20)


async def _call_turn(caller: Caller, text: str) -> str:
    """A typed turn over the call's data channel, answered in text."""
    content = [{"type": "input_text", "text": text}]
    item = {"type": "message", "role": "user", "content": content}
    caller.send({"type": "conversation.item.create", "item": item})
    caller.send({"type": "response.create", "response": {"output_modalities": ["text"]}})
    response = (await caller.next("response.done", 20))["response"]
    assert response["status"] == "completed", response
    return "".join(p["text"] for p in response["output"][0]["content"])


async def _began_call(head: HeadProc) -> tuple[Caller, str, str, str]:
    """A call with instructions and one turn: the caller, session id, token, answer."""
    caller, created = await _webrtc(head)
    assert created["resume"]["resumed"] is False
    caller.send({"type": "session.update", "session": {"instructions": "Be brief."}})
    await caller.next("session.updated", 20)
    said = await _call_turn(caller, "my name is Ada")
    assert said == "system: Be brief.\nuser: my name is Ada"
    return caller, created["session"]["id"], created["resume"]["token"], said


def _call_holder(head: HeadProc, caller: Caller) -> int:
    """The API server process holding the call: the one bound to the UDP port of the
    server's ICE candidate in its SDP answer."""
    ports = {
        int(line.split()[5]) for line in caller.answer_sdp.splitlines() if "candidate:" in line
    }
    for pid in _api_servers(head):
        conns = psutil.Process(pid).net_connections(kind="udp")
        if any(c.laddr and c.laddr.port in ports for c in conns):
            return pid
    raise AssertionError("no API server holds the call")


async def test_a_webrtc_call_resumes_in_a_new_call_after_its_api_server_is_killed(
    fronted: HeadProc, module_tmp: Path
) -> None:
    first, sid, token, said = await _began_call(fronted)
    _wait_saved(f"sqlite:///{module_tmp / 'resume.db'}", sid)
    victim = _call_holder(fronted, first)
    os.kill(victim, signal.SIGKILL)
    await first.close()
    # The token is needed, as the WebSocket's resume needs it.
    probe = Caller()
    refused = await probe.call(fronted.url, "key-a", None, f"?session_id={sid}&resume_token=x")
    await probe.close()
    assert refused.status_code == 404 and "session_not_found" in refused.text

    again, created = await _webrtc(fronted, f"?session_id={sid}&resume_token={token}")
    try:
        assert _call_holder(fronted, again) != victim
        assert created["session"]["id"] == sid
        assert created["session"]["instructions"] == "Be brief."
        assert created["resume"] == {"token": token, "resumed": True, "expires_in": 600.0}
        replayed = [await again.next("conversation.item.done", 20) for _ in range(2)]
        user, answer = (e["item"] for e in replayed)
        assert user["content"][0]["text"] == "my name is Ada"
        assert answer["content"][0]["text"] == said
        assert await _call_turn(again, "what is my name?") == (
            f"system: Be brief.\nuser: my name is Ada\nassistant: {said}\nuser: what is my name?"
        )
    finally:
        await again.close()


async def test_a_dropped_webrtc_call_resumes_over_the_websocket(
    fronted: HeadProc, module_tmp: Path
) -> None:
    first, sid, token, said = await _began_call(fronted)
    await first.close()  # the caller's peer connection goes away without a hang-up
    _wait_saved(f"sqlite:///{module_tmp / 'resume.db'}", sid)
    again = await asyncio.to_thread(_resume, fronted, sid, token)
    await asyncio.to_thread(_goes_on, again, sid, token, said)


@pytest.mark.skipif(shutil.which("haproxy") is None, reason="needs haproxy (Debian's package)")
def test_a_session_resumes_on_the_other_head_behind_haproxy(tmp_path: Path, postgres: Any) -> None:
    """Two heads of one fleet on one PostgreSQL store, behind haproxy: the head holding
    the session is killed, and the client resumes it, through the proxy, on the other."""
    config = echo_config(tmp_path, engine_args=ECHO["0"]["engine_args"])
    store = ("--store-url", postgres.new_database(), "--media-url", str(tmp_path / "media"))
    a = fleet_head(tmp_path, "a", *store, config=config)
    b = replicas = None
    proxy: subprocess.Popen[bytes] | None = None
    try:
        a.wait_http()
        b = fleet_head(tmp_path, "b", *store, join=a, config=config)
        replicas = headless(tmp_path, a, 0)
        wait_up(1, a, b)
        port = free_port()
        proxy = _haproxy(tmp_path, port, [a, b])
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: _proxy_up(f"{url}/v1"), 10, what="haproxy serving")
        first, token, said = _begin(url)
        _wait_saved(store[1], first)
        (holder,) = [h for h in (a, b) if h.stages()["realtime"]["live_sessions"] == 1]
        holder.signal(signal.SIGKILL)
        holder.wait(5)
        with pytest.raises(ConnectionClosed):
            first.recv()
        survivor = b if holder is a else a
        again = _resume(url, first.created["session"]["id"], token)
        assert survivor.stages()["realtime"]["live_sessions"] == 1
        _goes_on(again, first.created["session"]["id"], token, said)
    finally:
        if proxy is not None:
            proxy.terminate()
            proxy.wait(5)
        stop_all(replicas, b, a)
