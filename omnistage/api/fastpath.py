"""Routes whose POSTs skip FastAPI's per-request machinery.

FastAPI wraps every request in several layers (its exception and exit-stack middleware,
routing, dependency solving) that the generation handlers do not use: they take the raw
request, parse and validate the body themselves, and map errors to OpenAI's shape. On
the hot path those layers cost more than the handler's own bookkeeping. A ``FastRoute``
is an ordinary route of the app's table (FastAPI documents it and answers its other
methods), and ``FastPathMiddleware``, the innermost of the app's middleware, hands its
POSTs straight to its handler: they pass the app's middleware (response counts, API key,
body limit) once, as every other request does, and get the same error answers.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable

from fastapi.routing import APIRoute
from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute
from starlette.types import ASGIApp, Receive, Scope, Send

from omnistage import tracing
from omnistage.api.body import body_schema
from omnistage.api.errors import answer_error
from omnistage.api.limits import BodyTooLargeError

log = logging.getLogger(__name__)

Handler = Callable[[Request], Awaitable[Response]]


class FastRoute(APIRoute):
    """A POST route whose handler takes the raw request and reads a ``body`` (what
    /openapi.json documents it takes) with ``api.body.parse_body``."""

    def __init__(self, path: str, handler: Handler, body: type[BaseModel]) -> None:
        super().__init__(path, handler, methods=["POST"], openapi_extra=body_schema(body))
        self.body = body


class FastPathMiddleware:
    """POSTs to a ``FastRoute``'s path go to its handler; every other request on to
    FastAPI's exception handling and routing (``app``). Built when the app first serves,
    from its route table (``routes``) as it is then."""

    def __init__(self, app: ASGIApp, routes: Iterable[BaseRoute]) -> None:
        self.app = app
        self._handlers = {r.path: r.endpoint for r in routes if isinstance(r, FastRoute)}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            handler = self._handlers.get(scope["path"])
            if handler is not None:
                await _serve(handler, scope, receive, send)
                return
        await self.app(scope, receive, send)


async def _serve(handler: Handler, scope: Scope, receive: Receive, send: Send) -> None:
    """Call the handler; answer its errors (as the app's exception handlers would)."""
    request = Request(scope, receive)
    if tracing.enabled():
        # A caller's trace context: the request's root span becomes its child.
        tracing.incoming_parent.set(request.headers.get("traceparent", ""))
    try:
        response = await handler(request)
    except BodyTooLargeError:
        raise  # the body limit middleware answers it
    except Exception as exc:
        response = answer_error(exc)
        if response.status_code == 500:
            log.exception("request to %s failed", scope["path"])
    await response(scope, receive, send)
