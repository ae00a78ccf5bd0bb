"""POST /v1/realtime/calls against a real head with --api-key (the echo pipeline), called
by a real aiortc peer over loopback (``tests.webrtc_client``): who may call, and the
``oai-events`` data channel carrying the WebSocket's events both ways. Audio both ways is
tested on the voice pipeline (tests/models/test_realtime_webrtc.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.integration.harness import HeadProc, wait_for
from tests.webrtc_client import Caller

KEY = "rtc key"
WAIT_S = 30.0


@pytest.fixture(scope="module")
def keyed(module_tmp: Path) -> Iterator[HeadProc]:
    head = HeadProc(module_tmp, "echo", "--api-key", KEY, name="rtc-head")
    try:
        head.wait_healthy()
        yield head
    finally:
        head.stop()


async def _refused(head: HeadProc, token: str | None) -> httpx.Response:
    caller = Caller()
    try:
        return await caller.call(head.url, token)
    finally:
        await caller.close()


def test_a_call_without_the_key_or_a_live_secret_is_refused(keyed: HeadProc) -> None:
    for token in (None, "wrong", "ek_forged.secret"):
        r = asyncio.run(_refused(keyed, token))
        assert r.status_code == 401, (token, r.text)
        assert r.json()["error"]["type"] == "invalid_request_error"


def test_a_body_that_is_no_offer_is_a_400(keyed: HeadProc) -> None:
    auth = {"Authorization": f"Bearer {KEY}"}
    r = keyed.client.post(
        "/v1/realtime/calls", content=b"hello", headers={**auth, "Content-Type": "application/sdp"}
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "sdp", r.text
    r = keyed.client.post("/v1/realtime/calls", json={"sdp": "v=0"}, headers=auth)
    assert r.status_code == 400, r.text


async def _text_turn(head: HeadProc, token: str, session: dict | None) -> dict:
    """Call, check session.created, ask for a text answer over the data channel, hang up;
    the session.created event."""
    caller = Caller()
    try:
        r = await caller.call(head.url, token, session)
        assert r.status_code == 201, r.text
        assert r.headers["content-type"].startswith("application/sdp")
        assert r.headers["location"].startswith("/v1/realtime/calls/rtc_")
        created = await caller.next("session.created", WAIT_S)
        text_in = [{"type": "input_text", "text": "hi"}]
        item = {"type": "message", "role": "user", "content": text_in}
        caller.send({"type": "conversation.item.create", "item": item})
        caller.send({"type": "response.create", "response": {"output_modalities": ["text"]}})
        done = await caller.next("response.done", WAIT_S)
        assert done["response"]["status"] == "completed", done
        text = done["response"]["output"][0]["content"][0]["text"]
        assert text, done
        # A client error is an error event on the channel, and the call goes on.
        caller.send({"type": "conversation.item.delete", "item_id": "nope"})
        error = await caller.next("error", WAIT_S)
        assert error["error"]["param"] == "item_id", error
        bye = await httpx.AsyncClient(base_url=head.url).post(
            r.headers["location"] + "/hangup", headers={"Authorization": f"Bearer {KEY}"}
        )
        assert bye.status_code == 200, bye.text
        return created
    finally:
        await caller.close()


def test_the_data_channel_carries_the_sessions_events(keyed: HeadProc) -> None:
    created = asyncio.run(_text_turn(keyed, KEY, None))
    assert created["session"]["type"] == "realtime"


def test_a_client_secret_calls_with_its_session_config(keyed: HeadProc) -> None:
    minted = keyed.client.post(
        "/v1/realtime/client_secrets",
        json={"session": {"instructions": "Be brief."}},
        headers={"Authorization": f"Bearer {KEY}"},
    ).json()
    # The form's own session config applies after the secret's.
    session = {"type": "realtime", "output_modalities": ["text"]}
    created = asyncio.run(_text_turn(keyed, minted["value"], session))
    assert created["session"]["instructions"] == "Be brief."
    assert created["session"]["output_modalities"] == ["text"]


def _live_sessions(head: HeadProc) -> float:
    text = head.client.get("/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    line = next(x for x in text.splitlines() if x.startswith("omnistage_realtime_live_sessions "))
    return float(line.split()[1])


def test_a_caller_that_goes_away_frees_its_session(keyed: HeadProc) -> None:
    async def call_and_leave() -> None:
        caller = Caller()
        r = await caller.call(keyed.url, KEY)
        assert r.status_code == 201, r.text
        await caller.next("session.created", WAIT_S)
        assert _live_sessions(keyed) == 1
        await caller.close()  # no hangup: the peer connection just closes

    asyncio.run(call_and_leave())
    wait_for(lambda: _live_sessions(keyed) == 0, timeout=15, what="the session to be freed")
