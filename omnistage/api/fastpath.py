"""The generation routes without FastAPI's per-request machinery.

FastAPI wraps every request in several layers (its error and exit-stack middleware,
routing, dependency solving) that the generation handlers do not use: they take the raw
request, parse and validate the body themselves, and map errors to OpenAI's shape. On
the hot path those layers cost more than the handler's own bookkeeping, so POSTs to
these paths go straight to their handlers, behind the same middleware the app has (API
key, body limit, response counts) and with the same error answers; every other request,
and /openapi.json's description of these routes, is FastAPI's.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from fastapi import FastAPI
from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from omnistage import tracing
from omnistage.api.errors import answer_error
from omnistage.api.limits import BodyTooLargeError

log = logging.getLogger(__name__)

Handler = Callable[[Request], Awaitable[Response]]


@dataclass(frozen=True)
class FastRoute:
    """A generation route: POSTs to ``path`` go to ``handler``, which reads a ``body``
    (what /openapi.json documents it takes)."""

    path: str
    handler: Handler
    body: type[BaseModel]


class _Handlers:
    """The innermost app of the fast path: call the route's handler, answer errors."""

    def __init__(self, app: FastAPI, routes: Sequence[FastRoute]) -> None:
        self._app = app
        self._routes = {route.path: route.handler for route in routes}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        scope["app"] = self._app  # handlers find the service on request.app.state
        request = Request(scope, receive)
        if tracing.enabled():
            # A caller's trace context: the request's root span becomes its child.
            tracing.incoming_parent.set(request.headers.get("traceparent", ""))
        try:
            response = await self._routes[scope["path"]](request)
        except BodyTooLargeError:
            raise  # the body limit middleware answers it
        except Exception as exc:
            response = answer_error(exc)
            if response.status_code == 500:
                log.exception("request to %s failed", scope["path"])
        await response(scope, receive, send)


class FastPaths:
    """ASGI entry: ``fast`` for POSTs to the generation paths, ``app`` for the rest."""

    def __init__(
        self, app: FastAPI, routes: Sequence[FastRoute], wrap: Callable[[ASGIApp], ASGIApp]
    ) -> None:
        self.app = app
        self.state = app.state  # as FastAPI's, for callers that read app.state
        self._paths = frozenset(route.path for route in routes)
        self._fast = wrap(_Handlers(app, routes))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"] in self._paths:
            await self._fast(scope, receive, send)
        else:
            await self.app(scope, receive, send)
