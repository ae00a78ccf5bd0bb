"""Running an omnistage process's event loop (uvloop when installed, else asyncio), a
small queue for the hot path, and ``Changes``, a change tasks wait for."""

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


class Changes:
    """Something tasks wait for to change (a stage pool's room): ``wait`` until the next
    change or a timeout. A change with nobody waiting costs a compare, not an Event's
    wake-ups (the pool changes per request)."""

    def __init__(self) -> None:
        self._event = asyncio.Event()
        self._sleepers = 0  # tasks waiting: only they need waking

    async def wait(self, timeout: float) -> None:
        """Until the next change, or ``timeout`` (seconds)."""
        self._event.clear()
        self._sleepers += 1
        try:
            await asyncio.wait_for(self._event.wait(), timeout)
        except TimeoutError:
            pass
        finally:
            self._sleepers -= 1

    def happened(self) -> None:
        if self._sleepers:
            self._event.set()
