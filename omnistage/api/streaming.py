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
    client disconnects, so this waits on an event rather than polling.
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        try:
            await task
        except (asyncio.CancelledError, Exception):
            pass
        raise ClientDisconnectedError()
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
