"""Server-sent events and client-disconnect handling."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any, TypeVar

import msgspec
from starlette.requests import Request

T = TypeVar("T")

_json = msgspec.json.Encoder()


def sse(obj: Any) -> bytes:
    return b"data: " + _json.encode(obj) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


class ClientDisconnectedError(Exception):
    pass


# Requests that finish sooner never start a watcher: most fast requests, at no cost.
WATCH_AFTER_S = 0.05


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await ``work`` but cancel it if the client goes away first.

    Once the body is read, the ASGI server's next ``receive()`` only returns when the
    client disconnects, so a watcher task waits on that event (no polling) and cancels
    the handler's task, in which the work runs inline. The watcher starts only once the
    work has run for WATCH_AFTER_S: a task per request costs more than the fast
    requests it would guard.
    """
    current = asyncio.current_task()
    assert current is not None
    loop = asyncio.get_running_loop()
    gone = False
    watcher: asyncio.Task[None] | None = None

    def on_disconnect(task: asyncio.Task[None]) -> None:
        nonlocal gone
        if not task.cancelled() and task.exception() is None:
            gone = True
            current.cancel()

    def start_watching() -> None:
        nonlocal watcher
        watcher = loop.create_task(_wait_disconnect(request))
        watcher.add_done_callback(on_disconnect)

    timer = loop.call_later(WATCH_AFTER_S, start_watching)
    try:
        return await work
    except asyncio.CancelledError:
        if gone:
            current.uncancel()
            raise ClientDisconnectedError() from None
        raise
    finally:
        timer.cancel()
        if watcher is not None:
            watcher.remove_done_callback(on_disconnect)
            watcher.cancel()


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
