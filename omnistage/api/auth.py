"""Bearer-key check for /v1/* (``--api-key``); /health and /metrics stay open.

A pure ASGI middleware: no per-request task or body buffering, so streaming responses
and disconnect detection behave exactly as without it.
"""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from omnistage.api.errors import error_response


class ApiKeyMiddleware:
    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self._expected):
                response = error_response(
                    401,
                    "missing or invalid API key: send 'Authorization: Bearer <key>'",
                    "invalid_request_error",
                    code="invalid_api_key",
                )
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
