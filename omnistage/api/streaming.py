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


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await ``work`` but cancel it if the client goes away first.

    Once the body is read, the ASGI server's next ``receive()`` only returns when the
    client disconnects, so one watcher task waits on that event (no polling); the work
    itself runs inline in the handler's task, which the watcher cancels.
    """
    current = asyncio.current_task()
    assert current is not None
    gone = False

    def on_disconnect(task: asyncio.Task[None]) -> None:
        nonlocal gone
        if not task.cancelled() and task.exception() is None:
            gone = True
            current.cancel()

    watcher = asyncio.ensure_future(_wait_disconnect(request))
    watcher.add_done_callback(on_disconnect)
    try:
        return await work
    except asyncio.CancelledError:
        if gone:
            current.uncancel()
            raise ClientDisconnectedError() from None
        raise
    finally:
        watcher.remove_done_callback(on_disconnect)
        watcher.cancel()


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
