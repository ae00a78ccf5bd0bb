"""A stage's live replicas and their load, kept as requests come and go, so that routing
one request does not walk every replica.

``LivePool.replicas`` lists the live (UP) replicas, kept as each comes or goes (a
registration storm of 5,000 replicas must not rebuild it 5,000 times).
Their in-flight counts are kept as totals and as how many replicas hold each count, so
the mean and the least loaded (what the cache-aware bound needs) cost nothing per
request.

``LivePool.sample`` is what a request chooses among. A stage of up to ``SAMPLE_ABOVE``
live replicas offers every one, so every policy sees them all, as before. A larger one
offers ``SAMPLE`` drawn at random plus the replicas named (those holding the request's
prefix): the least loaded of 32 random replicas is, for spreading load, as good as the
least loaded of all (the power of d choices; two are already close), and 1,000 live
replicas cost one request ~170 us of the head's loop to walk. Where the sample has no
room, the caller walks them all: a request never waits while a replica has room.

Pure state, on the head's event loop.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from typing import Generic, Protocol, TypeVar

SAMPLE_ABOVE = 64
SAMPLE = 32


class Loaded(Protocol):
    replica_id: int
    in_flight: int


H = TypeVar("H", bound=Loaded)


class LivePool(Generic[H]):
    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()
        self._live: dict[int, H] = {}  # replica id -> its handle, in the order they came UP
        # Replica id -> its in-flight count as counted here: a replica leaving is taken
        # out by that, whatever its handle says by then (a failed one's is zeroed first).
        self._counted: dict[int, int] = {}
        self._list: list[H] | None = []  # the same as a list, rebuilt after a change
        self.in_flight = 0  # requests the live replicas hold, all together
        self._holding: dict[int, int] = {}  # in-flight count -> live replicas at it

    def __len__(self) -> int:
        return len(self._live)

    @property
    def replicas(self) -> list[H]:
        """The live replicas (do not change the list)."""
        if self._list is None:
            self._list = list(self._live.values())
        return self._list

    def sync(self, replica_id: int, handle: H | None, up: bool) -> None:
        """Replica ``replica_id`` is now ``handle`` (None: gone), live if ``up``: after a
        state change, which may also be a new incarnation taking the id over."""
        current = self._live.get(replica_id)
        wanted = handle if up else None
        if current is wanted:
            return
        if current is not None:
            del self._live[replica_id]
            self._count(self._counted.pop(replica_id), -1)
        if wanted is not None:
            self._live[replica_id] = wanted
            self._counted[replica_id] = wanted.in_flight
            self._count(wanted.in_flight, 1)
        self._list = None

    def moved(self, replica: H) -> None:
        """``replica``'s in-flight count changed (ignored unless it is one of the live
        ones: a replica no longer live, or an old incarnation)."""
        rid = replica.replica_id
        if self._live.get(rid) is not replica:
            return
        self._count(self._counted[rid], -1)
        self._counted[rid] = replica.in_flight
        self._count(replica.in_flight, 1)

    def least(self) -> int:
        """The fewest requests any live replica holds (0 with none live)."""
        return min(self._holding) if self._holding else 0

    def sample(self, also: Iterable[H] = ()) -> list[H]:
        """What a request chooses among: every live replica, or, above ``SAMPLE_ABOVE``,
        ``SAMPLE`` of them at random plus those of ``also`` (live ones) not drawn."""
        if len(self._live) <= SAMPLE_ABOVE:
            return self.replicas
        drawn = self._rng.sample(self.replicas, SAMPLE)
        ids = {r.replica_id for r in drawn}
        drawn += [r for r in also if r.replica_id not in ids]
        return drawn

    def _count(self, in_flight: int, change: int) -> None:
        holding = self._holding
        left = holding.get(in_flight, 0) + change
        if left:
            holding[in_flight] = left
        else:
            del holding[in_flight]
        self.in_flight += in_flight * change
