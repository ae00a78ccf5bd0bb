"""Bearer-key check for /v1/* (``--api-key``); /health and /metrics stay open.

A pure ASGI middleware: no per-request task or body buffering, so streaming responses
and disconnect detection behave exactly as without it.

The paths in ``query_paths`` (the dashboard's event stream: a browser's EventSource
cannot send headers) also take the key as ``?api_key=``; no other path does, so a key in
a URL is never needed, nor accepted, anywhere else.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable
from urllib.parse import parse_qs

from starlette.types import ASGIApp, Receive, Scope, Send

from omnistage.api.errors import error_response


class ApiKeyMiddleware:
    def __init__(self, app: ASGIApp, api_key: str, query_paths: Iterable[str] = ()) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode()
        self._key = api_key.encode()
        self._query_paths = frozenset(query_paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self._expected) and not self._query_key(scope):
                response = error_response(
                    401,
                    "missing or invalid API key: send 'Authorization: Bearer <key>'",
                    "invalid_request_error",
                    code="invalid_api_key",
                )
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _query_key(self, scope: Scope) -> bool:
        """Whether this is a ``query_paths`` request with exactly one right ``api_key``."""
        if scope["path"] not in self._query_paths or not scope["query_string"]:
            return False
        given = parse_qs(scope["query_string"].decode("latin-1")).get("api_key", [])
        return len(given) == 1 and hmac.compare_digest(given[0].encode(), self._key)
