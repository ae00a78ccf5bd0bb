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

Both sources are kept by key too (key -> replicas), so ``match`` costs the request's
few keys and their holders, not a visit to every replica that holds anything.

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
        # The same two sources by key (key -> replicas), kept in step with the two maps
        # above: ``match`` looks up a request's few keys instead of visiting every
        # replica that holds anything (a stage of 1,000 replicas all hold something).
        self._reported_by: dict[int, set[int]] = {}
        self._routed_by: dict[int, set[int]] = {}

    def report(self, replica_id: int, keys: Iterable[int]) -> None:
        """The replica's cache holds ``keys`` (and nothing else) now."""
        held = frozenset(islice(keys, MAX_REPORTED))
        before = self._reported.get(replica_id, _NOTHING)
        self._reported[replica_id] = held
        if held != before:  # a full report every few beats usually repeats the last
            _unindex(self._reported_by, replica_id, before - held)
            _index(self._reported_by, replica_id, held - before)
        routed = self._routed.get(replica_id)
        if not routed:
            return
        # Keys the report has are its to keep now (its next report may drop them); keys
        # routed long enough ago that the report would show them are gone.
        confirmed = held.intersection(routed)
        for key in confirmed:
            del routed[key]
        _unindex(self._routed_by, replica_id, confirmed)
        self._expire(replica_id, routed, self._clock() - self.confirm_s)

    def routed(self, replica_id: int, keys: Sequence[int]) -> None:
        """The head sent a request with these prefix keys to the replica."""
        now = self._clock()
        routed = self._routed.get(replica_id)
        if routed is None:
            routed = self._routed[replica_id] = OrderedDict()
        for key in keys:
            routed[key] = now
            routed.move_to_end(key)
        _index(self._routed_by, replica_id, keys)
        while len(routed) > self.max_routed:
            key, _ = routed.popitem(last=False)
            _unindex(self._routed_by, replica_id, (key,))
        self._expire(replica_id, routed, now - self.ttl_s)

    def drop(self, replica_id: int) -> None:
        """The replica's cache is gone (it went down, or restarted)."""
        _unindex(self._reported_by, replica_id, self._reported.pop(replica_id, _NOTHING))
        _unindex(self._routed_by, replica_id, self._routed.pop(replica_id, {}))

    def match(self, keys: Sequence[int], weights: Sequence[int]) -> dict[int, int]:
        """Replica id -> the weight of the longest of ``keys`` (``weights[i]`` for key
        ``i``) it holds; replicas that hold none are left out."""
        cutoff = self._clock() - self.ttl_s
        out: dict[int, int] = {}
        # Longest first: a replica's first hit is its longest held prefix.
        for i in range(len(keys) - 1, -1, -1):
            key = keys[i]
            for rid in self._reported_by.get(key, _NOTHING):
                out.setdefault(rid, weights[i])
            for rid in self._routed_by.get(key, _NOTHING):
                # Expired routings go lazily (on the replica's next routing or report):
                # here they are only skipped.
                if rid not in out and self._routed[rid][key] > cutoff:
                    out[rid] = weights[i]
        return out

    def reported_count(self, replica_id: int) -> int | None:
        """Keys the replica last reported; None if it never reported."""
        held = self._reported.get(replica_id)
        return None if held is None else len(held)

    def routed_count(self, replica_id: int) -> int:
        """Routed keys not yet expired (as of the last expiry pass)."""
        routed = self._routed.get(replica_id)
        if routed:
            self._expire(replica_id, routed, self._clock() - self.ttl_s)
        return len(routed) if routed else 0

    def replicas(self) -> set[int]:
        return self._reported.keys() | self._routed.keys()

    def _expire(self, replica_id: int, routed: OrderedDict[int, float], cutoff: float) -> None:
        """Drop entries routed at or before ``cutoff`` (they are oldest first)."""
        while routed:
            key, at = next(iter(routed.items()))
            if at > cutoff:
                return
            del routed[key]
            _unindex(self._routed_by, replica_id, (key,))


def _index(by_key: dict[int, set[int]], replica_id: int, keys: Iterable[int]) -> None:
    for key in keys:
        holders = by_key.get(key)
        if holders is None:
            by_key[key] = {replica_id}
        else:
            holders.add(replica_id)


def _unindex(by_key: dict[int, set[int]], replica_id: int, keys: Iterable[int]) -> None:
    for key in keys:
        holders = by_key.get(key)
        if holders is not None:
            holders.discard(replica_id)
            if not holders:
                del by_key[key]
