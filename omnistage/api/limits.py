"""Request body size limit (413), as a pure ASGI middleware.

A declared Content-Length over the limit is refused before any byte is read; a chunked
body is counted as it arrives and refused once it passes the limit, so a client cannot
make the server buffer an unbounded body. A path may have a limit of its own (an audio
upload is larger than any JSON body).
"""

from __future__ import annotations

from collections.abc import Mapping

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from omnistage.api.errors import error_response


class BodyTooLargeError(Exception):
    """Raised from ``receive`` once a chunked body passes the limit; this middleware
    answers it with a 413 (whoever sits between must let it through)."""


class BodyLimitMiddleware:
    def __init__(
        self, app: ASGIApp, max_bytes: int, path_limits: Mapping[str, int] | None = None
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.path_limits = dict(path_limits or {})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.path_limits.get(scope["path"], self.max_bytes)
        declared = _content_length(scope["headers"])
        if declared is not None:
            # The server reads exactly the declared length: nothing to count.
            if declared > limit:
                await self._refuse(scope, receive, send, limit)
            else:
                await self.app(scope, receive, send)
            return
        seen = 0
        started = False

        async def counting_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise BodyTooLargeError()
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counting_receive, tracking_send)
        except BodyTooLargeError:
            if not started:
                await self._refuse(scope, receive, send, limit)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, limit: int) -> None:
        response = error_response(
            413,
            f"request body larger than {limit} bytes",
            "invalid_request_error",
            code="request_too_large",
        )
        await response(scope, receive, send)


def _content_length(headers: list[tuple[bytes, bytes]]) -> int | None:
    for name, value in headers:
        if name == b"content-length":
            return int(value) if value.isdigit() else None
    return None
