"""A fixed number of slots, handed out by priority, then in order of asking.

An ``asyncio.Semaphore`` serves waiters first come, first served. A talker serving many
answers at once should not: a listener waits for an answer's *first* sentence, while a
later sentence only has to arrive before the one before it has finished playing. So
each waiter says how urgent it is (lower first) and a freed slot goes to the most
urgent, the earliest of equals. Urgency may change while a waiter waits (a later
sentence grows urgent as the audio before it plays out): a waiter may pass a function,
read when a slot frees. Waiters are few (a replica's answers), so a release scans them.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from typing import Any

Priority = Any  # anything comparable; or a function that reads it when a slot frees


class PrioritySlots:
    def __init__(self, slots: int) -> None:
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        self._free = slots
        self._waiters: list[tuple[Priority, int, asyncio.Future[None]]] = []
        self._order = itertools.count()

    def locked(self) -> bool:
        """No slot is free (as ``asyncio.Semaphore.locked``)."""
        return self._free == 0

    @property
    def waiting(self) -> int:
        return sum(1 for *_, f in self._waiters if not f.done())

    async def acquire(self, priority: Priority | Callable[[], Priority] = 0) -> None:
        if self._free > 0 and not self.waiting:
            self._free -= 1
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append((priority, next(self._order), future))
        try:
            await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                self.release()  # handed a slot as it was cancelled: pass it on
            raise

    def release(self) -> None:
        self._waiters = [w for w in self._waiters if not w[2].done()]
        if not self._waiters:
            self._free += 1
            return
        chosen = min(self._waiters, key=_urgency)
        self._waiters.remove(chosen)
        chosen[2].set_result(None)


def _urgency(waiter: tuple[Priority, int, asyncio.Future[None]]) -> tuple[Priority, int]:
    priority, order, _ = waiter
    return (priority() if callable(priority) else priority, order)
