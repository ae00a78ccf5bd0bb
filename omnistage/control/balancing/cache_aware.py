"""Cache-aware balancing: send a request where its prompt's longest prefix is cached,
unless that replica is loaded well past the others.

Each candidate (a live replica with room) scores

    cached share - load = (weight of the longest prefix of the prompt it holds / the
                           prompt's weight) - in_flight / capacity

and the best score wins; ties go to the least loaded (in flight, then the heartbeat's
queue length), then at random. The share is in [0, 1]; the load term moves a little
with each request, so between replicas that hold the same prefix the less loaded one
wins, and a small cache advantage does not outweigh a replica full of work.

The bound (``load_bound``): a candidate may take the request only if its in-flight count
after taking it is at most 1.5 x the mean over the stage's live replicas (this request
included; rounded up), or one more than the least loaded candidate. So one hot prefix (a
system prompt every conversation shares) cannot pile every request onto the replica that
holds it: it keeps about 1.5x its share, and the rest go where they are cheapest. The
least loaded candidate always passes.

Requests without prefix keys (no chat messages) are placed by least-queue-length, as is
everything when no replica holds any of the prompt's prefixes.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Protocol

from omnistage.control.balancing.base import ReplicaLoad, RouteReason
from omnistage.control.balancing.least_queue import LeastQueueLengthPolicy
from omnistage.protocol.enums import LbPolicy


class CachedLoad(ReplicaLoad, Protocol):
    @property
    def capacity(self) -> int: ...


def load_bound(live: int, in_flight: int, least_candidate: int) -> int:
    """The most requests one replica may hold after taking the next one: ceil(1.5 x the
    mean over the stage's ``live`` replicas, which hold ``in_flight`` requests, with the
    next request counted), and never below one more than ``least_candidate`` (the least
    loaded replica that can take it), so someone can."""
    n = max(1, live)
    total = in_flight + 1
    # ceil(3 * total / (2 * n)) in integers: no float rounding at the boundary.
    return max(-(-3 * total // (2 * n)), least_candidate + 1)


class CacheAwarePolicy:
    name = LbPolicy.CACHE_AWARE

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()
        self._fallback = LeastQueueLengthPolicy(self._rng)

    def choose(self, candidates: Sequence[ReplicaLoad]) -> int:
        """A request without prefix keys: least-queue-length."""
        return self._fallback.choose(candidates)

    def choose_cached(
        self,
        candidates: Sequence[CachedLoad],
        cached: Sequence[int],
        total: int,
        bound: int,
    ) -> tuple[int, RouteReason]:
        """The candidate for a request of weight ``total`` of which ``cached[i]`` is held
        by ``candidates[i]``; ``bound`` from ``load_bound``. The reason is CACHE when the
        cache decided (the pick holds more of the prompt than some other candidate),
        else LOAD."""
        total = max(1, total)
        best: tuple[float, int, int] | None = None
        tied: list[int] = []
        for i, c in enumerate(candidates):
            if c.in_flight + 1 > bound:
                continue
            key = (
                cached[i] / total - c.in_flight / max(1, c.capacity),
                -c.in_flight,
                -c.queue_length,
            )
            if best is None or key > best:
                best, tied = key, [i]
            elif key == best:
                tied.append(i)
        if not tied:  # only when the bound was computed without these candidates
            return self._fallback.choose(candidates), RouteReason.LOAD
        pick = tied[0] if len(tied) == 1 else self._rng.choice(tied)
        reason = RouteReason.CACHE if cached[pick] > min(cached) else RouteReason.LOAD
        return pick, reason
