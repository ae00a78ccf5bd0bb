"""Bearer-key check for /v1/* (``--api-key``); /health and /metrics stay open.

A pure ASGI middleware: no per-request task or body buffering, so streaming responses
and disconnect detection behave exactly as without it.

The paths in ``query_paths`` (the dashboard's event stream: a browser's EventSource
cannot send headers) also take the key as ``?api_key=``; no other path does, so a key in
a URL is never needed, nor accepted, anywhere else.

WebSockets under /v1 take the key as a bearer token too, or, since a browser cannot set
headers on a WebSocket either, as OpenAI's subprotocol ``openai-insecure-api-key.<key>``.
The Realtime socket (``REALTIME_PATH``) alone also takes an ephemeral client secret
(``ek_...``, see ``realtime.secrets``) in either place, and passes the session config
the secret carries on to its route as ``scope["state"]["realtime_session"]``. Without
``--api-key`` (``api_key=None``) nothing is refused; a valid secret's session config is
still passed on, so a page behaves the same with or without a key. The Realtime API over
WebRTC (``CALLS_PATH``, an HTTP POST) takes a client secret as its bearer token the same
way.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable
from urllib.parse import parse_qs

from starlette.types import ASGIApp, Receive, Scope, Send

from omnistage.api.errors import error_response
from omnistage.api.owner import OWNER, fingerprint, split_keys
from omnistage.realtime.secrets import PREFIX, ClientSecrets

REALTIME_PATH = "/v1/realtime"
CALLS_PATH = "/v1/realtime/calls"
SUBPROTOCOL_PREFIX = "openai-insecure-api-key."


class ApiKeyMiddleware:
    def __init__(
        self,
        app: ASGIApp,
        api_key: str | None,
        query_paths: Iterable[str] = (),
        client_secrets: ClientSecrets | None = None,
    ) -> None:
        self.app = app
        keys = split_keys(api_key)
        self._keys = [k.encode() for k in keys] or None
        self._bearers = [b"Bearer " + k for k in self._keys or ()]
        self._owners = [fingerprint(k) for k in keys]
        self._query_paths = frozenset(query_paths)
        self._secrets = client_secrets

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]  # a lifespan scope has no path
        if kind == "http" and self._keys is None and scope["path"] == CALLS_PATH:
            self._http_allowed(scope)  # lets a client secret's session config through
        if (
            kind == "http"
            and self._keys is not None
            and scope["path"].startswith("/v1/")
            and not self._http_allowed(scope)
        ) or (
            kind == "websocket"
            and scope["path"].startswith("/v1/")
            and not self._websocket_allowed(scope)
        ):
            await _refuse(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _http_allowed(self, scope: Scope) -> bool:
        given = dict(scope["headers"]).get(b"authorization", b"")
        for i, bearer in enumerate(self._bearers):
            if hmac.compare_digest(given, bearer):
                scope.setdefault("state", {})[OWNER] = self._owners[i]
                return True
        if scope["path"] == CALLS_PATH and given.startswith(b"Bearer " + PREFIX.encode()):
            return self._secret_allowed(scope, given[len(b"Bearer ") :].decode("latin-1"))
        return self._query_key(scope)

    def _secret_allowed(self, scope: Scope, token: str) -> bool:
        """Whether ``token`` is a live client secret; its session config goes on to the
        route as ``scope["state"]["realtime_session"]``."""
        payload = self._secrets.verify(token) if self._secrets is not None else None
        if payload is None:
            return False
        if payload.session is not None:
            scope.setdefault("state", {})["realtime_session"] = payload.session
        return True

    def _query_key(self, scope: Scope) -> bool:
        """Whether this is a ``query_paths`` request with exactly one right ``api_key``."""
        if self._keys is None:
            return False
        if scope["path"] not in self._query_paths or not scope["query_string"]:
            return False
        given = parse_qs(scope["query_string"].decode("latin-1")).get("api_key", [])
        return len(given) == 1 and self._match(given[0].encode()) is not None

    def _match(self, token: bytes) -> int | None:
        """The index of the key ``token`` is, if any (each compared in constant time)."""
        found = None
        for i, key in enumerate(self._keys or ()):
            if hmac.compare_digest(token, key):
                found = i
        return found

    def _websocket_allowed(self, scope: Scope) -> bool:
        """Whether one of the handshake's credentials opens this socket; a client secret
        that does leaves its session config in the scope's state."""
        realtime = scope["path"] == REALTIME_PATH and self._secrets is not None
        allowed = self._keys is None
        for token in _websocket_tokens(scope):
            if self._keys is not None and (i := self._match(token.encode())) is not None:
                # The key's owner, as an HTTP request gets: a saved session is its.
                scope.setdefault("state", {})[OWNER] = self._owners[i]
                allowed = True
            elif realtime and token.startswith(PREFIX) and self._secret_allowed(scope, token):
                return True
        return allowed


def _websocket_tokens(scope: Scope) -> list[str]:
    """The credentials a WebSocket handshake offers: a bearer token, then any
    ``openai-insecure-api-key.`` subprotocols."""
    tokens = []
    for name, value in scope["headers"]:
        if name == b"authorization" and value.startswith(b"Bearer "):
            tokens.append(value[len(b"Bearer ") :].decode("latin-1"))
    for proto in scope.get("subprotocols", ()):
        if proto.startswith(SUBPROTOCOL_PREFIX):
            tokens.append(proto[len(SUBPROTOCOL_PREFIX) :])
    return tokens


async def _refuse(scope: Scope, receive: Receive, send: Send) -> None:
    """A 401 in OpenAI's error shape; a WebSocket gets it as the handshake's answer where
    the server can deny with a response (uvicorn can), else a close before accepting
    (which the server turns into a 403)."""
    extensions = scope.get("extensions") or {}
    if scope["type"] == "websocket" and "websocket.http.response" not in extensions:
        await send({"type": "websocket.close", "code": 1008})
        return
    response = error_response(
        401,
        "missing or invalid API key: send 'Authorization: Bearer <key>'",
        "invalid_request_error",
        code="invalid_api_key",
    )
    await response(scope, receive, send)
