"""Holding back what an early answer says until its turn is certain.

The session starts answering when the user pauses (``turn.PAUSE_MS``), before the VAD
says the turn has ended. Everything that answer does that the client would see (its
events, and adding its items to the conversation) waits here, in order: ``open`` lets
it all through when the turn is committed; ``drop`` forgets it when the user goes on.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from omnistage.realtime.conversation import Item
from omnistage.realtime.events import ServerEvent


class Gate:
    def __init__(
        self, emit: Callable[[ServerEvent], None], add_item: Callable[[Item], None]
    ) -> None:
        self._emit = emit
        self._add_item = add_item
        self._held: list[Callable[[], None]] | None = []
        self.opened_at: float | None = None

    @property
    def is_open(self) -> bool:
        return self._held is None

    def emit(self, event: ServerEvent) -> None:
        if self._held is None:
            self._emit(event)
        else:
            self._held.append(lambda: self._emit(event))

    def add_item(self, item: Item) -> None:
        if self._held is None:
            self._add_item(item)
        else:
            self._held.append(lambda: self._add_item(item))

    def open(self) -> None:
        held, self._held = self._held or [], None
        self.opened_at = time.monotonic()
        for action in held:
            action()

    def drop(self) -> None:
        self._held = []
