"""Ephemeral client secrets: expiry, tampering, keys; and how the API key middleware
takes them on WebSocket handshakes."""

from __future__ import annotations

import asyncio
import base64
from typing import Any

import msgspec
import pytest

from omnistage.api.auth import ApiKeyMiddleware
from omnistage.realtime.secrets import MAX_SESSION_BYTES, ClientSecrets
from tests.unit.fakes import FakeClock

SESSION = {"type": "realtime", "instructions": "Be brief."}


def test_a_secret_verifies_until_it_expires() -> None:
    clock = FakeClock(1_000_000.0)
    keys = ClientSecrets("K", clock)
    value, expires_at = keys.mint(SESSION, 60)
    assert value.startswith("ek_") and expires_at == 1_000_060
    payload = keys.verify(value)
    assert payload is not None and payload.session == SESSION
    assert payload.expires_at == expires_at
    clock.now = expires_at - 0.5
    assert keys.verify(value) is not None
    clock.now = expires_at
    assert keys.verify(value) is None


def test_another_process_with_the_same_key_verifies_it() -> None:
    clock = FakeClock(1_000_000.0)
    value, _ = ClientSecrets("K", clock).mint(None, 600)
    assert ClientSecrets("K", clock).verify(value) is not None
    assert ClientSecrets("other", clock).verify(value) is None
    assert ClientSecrets(None, clock).verify(value) is None
    # Without a key, secrets still verify (they carry a session config and an expiry).
    open_value, _ = ClientSecrets(None, clock).mint(SESSION, 600)
    assert ClientSecrets(None, clock).verify(open_value) is not None


def test_two_secrets_minted_at_once_differ() -> None:
    keys = ClientSecrets("K", FakeClock(5.0))
    assert keys.mint(None, 10)[0] != keys.mint(None, 10)[0]


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def test_tampered_and_malformed_tokens_are_refused() -> None:
    clock = FakeClock(1_000_000.0)
    keys = ClientSecrets("K", clock)
    value, _ = keys.mint(SESSION, 60)
    payload, signature = value.removeprefix("ek_").split(".")
    # A longer expiry, signed with the old signature.
    decoded = msgspec.json.decode(base64.urlsafe_b64decode(payload + "=="))
    forged = _b64(msgspec.json.encode({**decoded, "expires_at": decoded["expires_at"] + 9999}))
    assert keys.verify(f"ek_{forged}.{signature}") is None
    flipped = signature[:-2] + ("A" if signature[-2] != "A" else "B") + signature[-1]
    for bad in (
        f"ek_{payload}.{flipped}",
        f"ek_{payload}",
        f"ek_{payload}.",
        f"ek_{payload}.{signature}!",
        f"ek_{payload}.{signature}.x",
        value.removeprefix("ek_"),
        "ek_é." + signature,
        "",
        "ek_" + "A" * 10_000 + "." + signature,
    ):
        assert keys.verify(bad) is None, bad


def test_a_signed_payload_of_the_wrong_shape_is_refused() -> None:
    keys = ClientSecrets("K", FakeClock(0.0))
    payload = _b64(b'{"expires_at": "never", "nonce": "x"}')
    token = f"ek_{payload}.{_b64(keys._sign(payload))}"
    assert keys.verify(token) is None


def test_mint_checks_ttl_and_session_size() -> None:
    keys = ClientSecrets("K", FakeClock(0.0))
    for ttl in (9, 7201):
        with pytest.raises(ValueError, match="ttl_s"):
            keys.mint(None, ttl)
    with pytest.raises(ValueError, match="session config"):
        keys.mint({"instructions": "x" * MAX_SESSION_BYTES}, 600)
    # The largest session config still fits the 8 KiB header line a WebSocket allows.
    big = {"instructions": "x" * (MAX_SESSION_BYTES - len('{"instructions":""}'))}
    value, _ = keys.mint(big, 600)
    assert len(f"sec-websocket-protocol: realtime, openai-insecure-api-key.{value}") < 8000


# The middleware on raw ASGI handshakes: what it lets through, and what it answers.


def _handshake(
    mw: ApiKeyMiddleware,
    path: str,
    *,
    bearer: str | None = None,
    subprotocols: tuple[str, ...] = (),
    extensions: dict[str, Any] | None = None,
) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
    """(the scope the route saw, or None if refused; what was sent)."""
    seen: list[dict[str, Any]] = []
    sent: list[dict[str, Any]] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        seen.append(scope)

    async def receive() -> dict[str, Any]:
        return {"type": "websocket.connect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    mw.app = app
    headers = [(b"authorization", f"Bearer {bearer}".encode())] if bearer else []
    scope = {
        "type": "websocket",
        "path": path,
        "headers": headers,
        "subprotocols": list(subprotocols),
        "query_string": b"",
        "extensions": extensions if extensions is not None else {"websocket.http.response": {}},
    }
    asyncio.run(mw(scope, receive, send))
    return (seen[0] if seen else None), sent


def _middleware(api_key: str | None, clock: FakeClock) -> ApiKeyMiddleware:
    return ApiKeyMiddleware(None, api_key, client_secrets=ClientSecrets(api_key, clock))  # type: ignore[arg-type]


def test_the_realtime_socket_takes_the_key_or_a_secret_in_either_place() -> None:
    clock = FakeClock(1_000_000.0)
    mw = _middleware("K", clock)
    ek, _ = ClientSecrets("K", clock).mint(SESSION, 60)
    scope, _ = _handshake(mw, "/v1/realtime", bearer="K")
    assert scope is not None and "realtime_session" not in scope.get("state", {})
    scope, _ = _handshake(
        mw, "/v1/realtime", subprotocols=("realtime", f"openai-insecure-api-key.{ek}")
    )
    assert scope is not None and scope["state"]["realtime_session"] == SESSION
    scope, _ = _handshake(mw, "/v1/realtime", bearer=ek)
    assert scope is not None and scope["state"]["realtime_session"] == SESSION
    assert _handshake(mw, "/v1/realtime", subprotocols=("openai-insecure-api-key.K",))[0]


def test_refusals_are_a_401_or_a_close_where_the_server_cannot_deny() -> None:
    clock = FakeClock(1_000_000.0)
    mw = _middleware("K", clock)
    ek, expires_at = ClientSecrets("K", clock).mint(None, 60)
    scope, sent = _handshake(mw, "/v1/realtime", bearer="wrong")
    assert scope is None and sent[0]["type"] == "websocket.http.response.start"
    assert sent[0]["status"] == 401
    assert b"invalid_api_key" in sent[1]["body"]
    # A secret opens only the Realtime socket.
    assert _handshake(mw, "/v1/other", bearer=ek)[0] is None
    assert _handshake(mw, "/v1/other", bearer="K")[0] is not None
    scope, sent = _handshake(mw, "/v1/realtime", extensions={})
    assert scope is None and sent == [{"type": "websocket.close", "code": 1008}]
    clock.now = expires_at
    assert _handshake(mw, "/v1/realtime", bearer=ek)[0] is None
    # Outside /v1 the key is not asked for (as over HTTP).
    assert _handshake(mw, "/elsewhere")[0] is not None


def test_without_a_key_nothing_is_refused_and_a_secret_still_carries_its_session() -> None:
    clock = FakeClock(1_000_000.0)
    mw = _middleware(None, clock)
    ek, _ = ClientSecrets(None, clock).mint(SESSION, 60)
    assert _handshake(mw, "/v1/realtime")[0] is not None
    assert _handshake(mw, "/v1/realtime", bearer="anything")[0] is not None
    scope, _ = _handshake(mw, "/v1/realtime", subprotocols=(f"openai-insecure-api-key.{ek}",))
    assert scope is not None and scope["state"]["realtime_session"] == SESSION
