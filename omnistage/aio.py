"""Running an omnistage process's event loop (uvloop when installed, else asyncio), and a
small queue for the hot path."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Coroutine
from typing import Any, Generic, TypeVar

T = TypeVar("T")


def run(main: Coroutine[Any, Any, T]) -> T:
    try:
        import uvloop
    except ImportError:  # uvloop is optional: the code is plain asyncio
        return asyncio.run(main)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main)


class Mailbox(Generic[T]):
    """A queue with one consumer: ``put_nowait`` from anywhere on the loop, ``get`` from
    one task. It does per item only what that case needs (``asyncio.Queue`` also keeps a
    putter queue, a task counter and an Event, per instance), and requests make one each.
    """

    __slots__ = ("_items", "_waiter")

    def __init__(self) -> None:
        self._items: deque[T] = deque()
        self._waiter: asyncio.Future[None] | None = None

    def put_nowait(self, item: T) -> None:
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def get(self) -> T:
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._items.popleft()
