"""A stage's live replicas and their load, kept as requests come and go, so that routing
one request does not walk every replica.

``LivePool.replicas`` lists the live (UP) replicas, kept as each comes or goes: an
indexed set (a list and each member's place in it), so a replica joins or leaves in
O(1) and a random sample needs no copy (a crash storm at 5,000 replicas must not
rebuild a list per state change).
Their in-flight counts are kept as totals and as how many replicas hold each count, so
the mean and the least loaded (what the cache-aware bound needs) cost nothing per
request. Two more indexed sets hold the live replicas with room: by this head's count
(``in_flight < capacity``) and counting the fleet's other heads' requests too
(``in_flight + others < capacity``), kept as each count moves.

``LivePool.sample`` is what a request chooses among. A stage of up to ``SAMPLE_ABOVE``
live replicas offers every one, so every policy sees them all, as before. A larger one
offers ``SAMPLE`` drawn at random plus the replicas named (those holding the request's
prefix): the least loaded of 32 random replicas is, for spreading load, as good as the
least loaded of all (the power of d choices; two are already close), and 1,000 live
replicas cost one request ~170 us of the head's loop to walk. Where the sample has no
room, ``with_room`` offers a sample of the replicas that have some: a request never
waits while a replica has room, and never walks the stage to find it.

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
    capacity: int
    others: int


H = TypeVar("H", bound=Loaded)


class Members(Generic[H]):
    """Replicas by id as a list and each one's place in it: add, discard and a random
    sample in O(1) (a member leaving takes the last one's place)."""

    def __init__(self) -> None:
        self.items: list[H] = []  # read, never changed, by callers
        self._at: dict[int, int] = {}  # replica id -> its index in ``items``

    def __len__(self) -> int:
        return len(self.items)

    def __contains__(self, replica_id: int) -> bool:
        return replica_id in self._at

    def get(self, replica_id: int) -> H | None:
        i = self._at.get(replica_id)
        return self.items[i] if i is not None else None

    def add(self, replica_id: int, item: H) -> None:
        i = self._at.get(replica_id)
        if i is not None:
            self.items[i] = item
            return
        self._at[replica_id] = len(self.items)
        self.items.append(item)

    def discard(self, replica_id: int) -> None:
        i = self._at.pop(replica_id, None)
        if i is None:
            return
        last = self.items.pop()
        if i < len(self.items):
            self.items[i] = last
            self._at[last.replica_id] = i

    def sample(self, rng: random.Random, k: int) -> list[H]:
        """``k`` members at random (all of them, in their order, when there are no more)."""
        if len(self.items) <= k:
            return list(self.items)
        return rng.sample(self.items, k)


class LivePool(Generic[H]):
    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()
        self._live: Members[H] = Members()
        # Replica id -> its in-flight count as counted here: a replica leaving is taken
        # out by that, whatever its handle says by then (a failed one's is zeroed first).
        self._counted: dict[int, int] = {}
        self.in_flight = 0  # requests the live replicas hold, all together
        self.capacity = 0  # the live replicas' slots, all together
        self._holding: dict[int, int] = {}  # in-flight count -> live replicas at it
        self._free: Members[H] = Members()  # room by this head's count
        self._open: Members[H] = Members()  # room counting the other heads' requests

    def __len__(self) -> int:
        return len(self._live)

    @property
    def replicas(self) -> list[H]:
        """The live replicas (do not change the list)."""
        return self._live.items

    def sync(self, replica_id: int, handle: H | None, up: bool) -> None:
        """Replica ``replica_id`` is now ``handle`` (None: gone), live if ``up``: after a
        state change, which may also be a new incarnation taking the id over."""
        current = self._live.get(replica_id)
        wanted = handle if up else None
        if current is wanted:
            return
        if current is not None:
            self._live.discard(replica_id)
            self._count(self._counted.pop(replica_id), -1)
            self.capacity -= current.capacity
        if wanted is not None:
            self._live.add(replica_id, wanted)
            self._counted[replica_id] = wanted.in_flight
            self._count(wanted.in_flight, 1)
            self.capacity += wanted.capacity
        self._file(replica_id, wanted)

    def moved(self, replica: H) -> None:
        """``replica``'s in-flight count, or what the other heads hold of it, changed
        (ignored unless it is one of the live ones: a replica no longer live, or an old
        incarnation)."""
        rid = replica.replica_id
        if self._live.get(rid) is not replica:
            return
        self._count(self._counted[rid], -1)
        self._counted[rid] = replica.in_flight
        self._count(replica.in_flight, 1)
        self._file(rid, replica)

    def set_others(self, replica: H, others: int) -> bool:
        """What the other heads hold of ``replica`` is now ``others``; whether that
        left it more room."""
        freed = others < replica.others
        if others != replica.others:
            replica.others = others
            self.moved(replica)
        return freed

    def least(self) -> int:
        """The fewest requests any live replica holds (0 with none live)."""
        return min(self._holding) if self._holding else 0

    def sample(self, also: Iterable[H] = ()) -> list[H]:
        """What a request chooses among: every live replica, or, above ``SAMPLE_ABOVE``,
        ``SAMPLE`` of them at random plus those of ``also`` (live ones) not drawn."""
        if len(self._live) <= SAMPLE_ABOVE:
            return self.replicas
        drawn = self._live.sample(self._rng, SAMPLE)
        ids = {r.replica_id for r in drawn}
        drawn += [r for r in also if r.replica_id not in ids]
        return drawn

    def with_room(self) -> tuple[list[H], list[H]]:
        """Up to ``SAMPLE`` live replicas at random with room counting the other heads'
        requests, and up to ``SAMPLE`` with room by this head's count."""
        return self._open.sample(self._rng, SAMPLE), self._free.sample(self._rng, SAMPLE)

    def _file(self, replica_id: int, replica: H | None) -> None:
        """Put ``replica`` (None: not live) in the sets of replicas with room, or not."""
        free = replica is not None and replica.in_flight < replica.capacity
        _put(self._free, replica_id, replica if free else None)
        if replica is not None and replica.in_flight + replica.others >= replica.capacity:
            free = False
        _put(self._open, replica_id, replica if free else None)

    def _count(self, in_flight: int, change: int) -> None:
        holding = self._holding
        left = holding.get(in_flight, 0) + change
        if left:
            holding[in_flight] = left
        else:
            del holding[in_flight]
        self.in_flight += in_flight * change


def _put(members: Members[H], replica_id: int, replica: H | None) -> None:
    if replica is not None:
        members.add(replica_id, replica)
    else:
        members.discard(replica_id)
