"""What each replica of a stage holds in its prefix cache, as the head knows it.

Two sources, per replica:

- **reported**: the keys (``protocol/prefix.py``) the replica's engine said its cache
  holds, in its last heartbeat that carried them. Each report replaces the last
  wholesale: it is the engine's word, evictions included.
- **routed**: keys of requests the head itself just sent there. An engine caches a
  prompt's prefixes as it prefills it, but reports them only with a later heartbeat; until
  then the head assumes they are there (the next turn of a conversation often comes first).
  They are optimistic, so they expire: after ``ttl_s`` at most, and sooner once a report
  taken ``confirm_s`` after the routing left them out (the engine has had time to cache
  them; it did not, or evicted them). For an engine that reports nothing, routed keys are
  all the head knows: cache-aware routing still works from them.

A replica that goes DOWN or ERROR, or comes back as a new incarnation, loses its entries
(its cache is gone). Memory is bounded: at most ``MAX_REPORTED`` reported and
``max_routed`` routed keys per replica, and only replicas of the pool.

Pure state with an injected clock, on the head's event loop (no locks).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from itertools import islice

from omnistage.protocol.messages import ChatMessage
from omnistage.protocol.prefix import MAX_REPORTED, prefix_keys, prefix_weights

# Routed keys last this long without a report saying otherwise: about a conversation's
# pause between turns, for engines that never report.
ROUTED_TTL_S = 120.0
# A report this long after a routing is trusted to show its keys if the engine kept them:
# a few heartbeats (1 s each by default), plus the time the request may queue first.
CONFIRM_S = 5.0
MAX_ROUTED = 4096  # routed keys kept per replica, the most recent

_NOTHING: frozenset[int] = frozenset()


@dataclass(frozen=True, slots=True)
class RequestPrefix:
    """A request's prefix keys and their weights (characters, the head's stand-in for
    tokens), computed once per request from its chat messages."""

    keys: list[int]
    weights: list[int]

    @classmethod
    def of(cls, messages: Sequence[ChatMessage]) -> RequestPrefix | None:
        """None for a prompt without chat messages: nothing to match."""
        if not messages:
            return None
        return cls(prefix_keys(messages), prefix_weights(messages))

    @property
    def total(self) -> int:
        """The whole prompt's weight."""
        return self.weights[-1]


class PrefixIndex:
    def __init__(
        self,
        clock: Callable[[], float],
        ttl_s: float = ROUTED_TTL_S,
        confirm_s: float = CONFIRM_S,
        max_routed: int = MAX_ROUTED,
    ) -> None:
        self._clock = clock
        self.ttl_s = ttl_s
        self.confirm_s = confirm_s
        self.max_routed = max_routed
        self._reported: dict[int, frozenset[int]] = {}
        # replica -> key -> when the head routed it there; oldest first (a re-routed key
        # moves to the end), so expiry pops from the front.
        self._routed: dict[int, OrderedDict[int, float]] = {}

    def report(self, replica_id: int, keys: Iterable[int]) -> None:
        """The replica's cache holds ``keys`` (and nothing else) now."""
        held = frozenset(islice(keys, MAX_REPORTED))
        self._reported[replica_id] = held
        routed = self._routed.get(replica_id)
        if not routed:
            return
        # Keys the report has are its to keep now (its next report may drop them); keys
        # routed long enough ago that the report would show them are gone.
        for key in held.intersection(routed):
            del routed[key]
        _expire(routed, self._clock() - self.confirm_s)

    def routed(self, replica_id: int, keys: Sequence[int]) -> None:
        """The head sent a request with these prefix keys to the replica."""
        now = self._clock()
        routed = self._routed.get(replica_id)
        if routed is None:
            routed = self._routed[replica_id] = OrderedDict()
        for key in keys:
            routed[key] = now
            routed.move_to_end(key)
        while len(routed) > self.max_routed:
            routed.popitem(last=False)
        _expire(routed, now - self.ttl_s)

    def drop(self, replica_id: int) -> None:
        """The replica's cache is gone (it went down, or restarted)."""
        self._reported.pop(replica_id, None)
        self._routed.pop(replica_id, None)

    def match(self, keys: Sequence[int], weights: Sequence[int]) -> dict[int, int]:
        """Replica id -> the weight of the longest of ``keys`` (``weights[i]`` for key
        ``i``) it holds; replicas that hold none are left out."""
        cutoff = self._clock() - self.ttl_s
        out: dict[int, int] = {}
        for rid in self._reported.keys() | self._routed.keys():
            reported = self._reported.get(rid, _NOTHING)
            routed = self._routed.get(rid)
            if routed:
                _expire(routed, cutoff)
            for i in range(len(keys) - 1, -1, -1):
                key = keys[i]
                if key in reported or (routed and key in routed):
                    out[rid] = weights[i]
                    break
        return out

    def reported_count(self, replica_id: int) -> int | None:
        """Keys the replica last reported; None if it never reported."""
        held = self._reported.get(replica_id)
        return None if held is None else len(held)

    def routed_count(self, replica_id: int) -> int:
        """Routed keys not yet expired (as of the last expiry pass)."""
        routed = self._routed.get(replica_id)
        if routed:
            _expire(routed, self._clock() - self.ttl_s)
        return len(routed) if routed else 0

    def replicas(self) -> set[int]:
        return self._reported.keys() | self._routed.keys()


def _expire(routed: OrderedDict[int, float], cutoff: float) -> None:
    """Drop entries routed at or before ``cutoff`` (they are oldest first)."""
    while routed:
        key, at = next(iter(routed.items()))
        if at > cutoff:
            return
        del routed[key]
