"""Inputs pushed by an upstream replica before the head's ``AddRequest`` for them (they
travel on another connection, and can overtake it): kept a while for the request.

Pure, with an injected clock: expiry is testable without sleeping.
"""

from __future__ import annotations

from collections.abc import Callable

from omnistage.protocol.messages import OutputChunk

# They wait this long, at most this many requests' worth.
EARLY_TTL_S = 60.0
EARLY_MAX_REQUESTS = 10_000


class EarlyInputs:
    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._kept: dict[str, list[tuple[float, OutputChunk]]] = {}
        self._swept = clock()

    def keep(self, chunk: OutputChunk) -> None:
        now = self._clock()
        full = chunk.request_id not in self._kept and len(self._kept) >= EARLY_MAX_REQUESTS
        if full or now - self._swept > EARLY_TTL_S:
            self._sweep(now)
        self._kept.setdefault(chunk.request_id, []).append((now, chunk))

    def take(self, request_id: str) -> list[OutputChunk]:
        """What came for a request, oldest first; forgotten here."""
        return [chunk for _, chunk in self._kept.pop(request_id, ())]

    def clear(self) -> None:
        self._kept.clear()

    def _sweep(self, now: float) -> None:
        self._swept = now
        stale = [rid for rid, kept in self._kept.items() if now - kept[-1][0] > EARLY_TTL_S]
        for rid in stale:
            del self._kept[rid]
        while len(self._kept) >= EARLY_MAX_REQUESTS:  # still full: oldest first
            del self._kept[next(iter(self._kept))]
