"""One pool per stage: its live replicas, their load, and the balancing policy.

Lives on the head's event loop (no locks). The coordinator's transitions arrive here;
``acquire`` waits, boundedly, for a replica when none is live. With the cache-aware
policy the pool also keeps the stage's prefix index (what each replica's prefix cache
holds): fed by the replicas' reports and by the pool's own routing, emptied for a
replica whose cache is gone.
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from omnistage.aio import Changes
from omnistage.control.balancing import BalancingPolicy, CacheAwarePolicy, RouteReason
from omnistage.control.balancing.affinity import AffinityMap
from omnistage.control.balancing.cache_aware import load_bound
from omnistage.control.balancing.prefix_index import PrefixIndex, RequestPrefix
from omnistage.control.replica_table import LoadReading, ReplicaEntry, Transition
from omnistage.dataplane.comebacks import Comebacks, WaitBounds
from omnistage.dataplane.pool_load import LivePool
from omnistage.protocol.errors import StageOverloadedError
from omnistage.protocol.messages import ReplicaState


@dataclass
class ReplicaHandle:
    stage_id: int
    replica_id: int
    epoch: int
    identity: bytes
    capacity: int
    address: str = ""  # the host it registered from
    peer_address: str = ""  # where other replicas push its inputs ("" = only via the head)
    host_key: str = ""  # which shared memory it sees (see Ready.host_key)
    up: bool = True
    in_flight: int = 0  # the head's live count: sent and not yet finished
    queue_length: int = 0  # from the last heartbeat
    # Requests it holds for the fleet's other heads (last heartbeat), or its capacity
    # after a BUSY refusal until the next heartbeat says better.
    others: int = 0
    requests: set[str] = field(default_factory=set)
    dispatched_total: int = 0
    # From the usage of the requests it finished: prompt tokens, and of those the ones
    # its prefix cache had (engines that report them).
    prompt_tokens_total: int = 0
    cached_tokens_total: int = 0
    prefixes_seq: int = -1  # the heartbeat seq of its last prefix report


class StagePool:
    def __init__(
        self,
        stage_id: int,
        name: str,
        policy: BalancingPolicy,
        max_waiting: int = 1024,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
    ) -> None:
        self.stage_id = stage_id
        self.name = name
        self.policy = policy
        # Only a cache-aware pool keeps a prefix index; the others route by load alone.
        self._cache_policy = policy if isinstance(policy, CacheAwarePolicy) else None
        self.prefixes = PrefixIndex(clock) if self._cache_policy is not None else None
        # Routing decisions by reason (RouteReason's values).
        self.decisions: dict[str, int] = dict.fromkeys(RouteReason, 0)
        # Requests allowed to wait for a free replica slot; more are refused (429), so
        # an overload costs memory in proportion to this, not to the offered load.
        self.max_waiting = max_waiting
        self.waiting = 0
        self.replicas: dict[int, ReplicaHandle] = {}
        # Load readings of an incarnation the pool has no handle for yet (its UP is on
        # its way to the loop): readings come only when the load changes, so one must
        # not be lost. Replica id -> its latest; kept until that incarnation comes UP.
        self._early: dict[int, LoadReading] = {}
        self._changed = Changes()  # what requests waiting for room sleep on
        # The replicas up and their load: kept by ``apply``, ``try_acquire`` and
        # ``release``, read per request.
        self._live: LivePool[ReplicaHandle] = LivePool(rng)
        self.affinity = AffinityMap()
        # Replicas on their way: what a request with none live waits for.
        self.comebacks = Comebacks()

    def live(self) -> list[ReplicaHandle]:
        return list(self._live.replicas)

    def has_live(self) -> bool:
        return len(self._live) > 0

    def slots(self) -> tuple[int, int]:
        """The live replicas' slots and how many of them are taken, all together."""
        return self._live.capacity, self._live.in_flight

    def apply(self, t: Transition) -> set[str]:
        """Apply a state transition; returns request ids lost with a failed replica."""
        if self.comebacks.observe(t.entry.replica_id, t.entry.epoch, t.new):
            self._wake()  # requests waiting for a replica re-judge what is coming
        try:
            return self._apply(t)
        finally:
            handle = self.replicas.get(t.entry.replica_id)
            self._live.sync(t.entry.replica_id, handle, handle is not None and handle.up)

    def _apply(self, t: Transition) -> set[str]:
        e = t.entry
        handle = self.replicas.get(e.replica_id)
        if handle is not None and handle.epoch != e.epoch:
            if t.new != ReplicaState.UP:
                return set()  # news about an older incarnation
            handle = None  # a new incarnation replaces the old one
        if t.new == ReplicaState.UP:
            if handle is None:
                handle = _handle_from(e, self._early.pop(e.replica_id, None))
                self.replicas[e.replica_id] = handle
                if self.prefixes is not None:
                    self.prefixes.drop(e.replica_id)  # a new incarnation: an empty cache
            handle.up = True
            self._wake()
            return set()
        if handle is None:
            return set()
        handle.up = False
        if t.new == ReplicaState.DRAINING:
            self._wake()
            return set()  # it finishes what it has; it just gets nothing new
        lost = set(handle.requests)
        if t.new in (ReplicaState.DOWN, ReplicaState.ERROR):
            handle.requests.clear()
            handle.in_flight = 0
            if self.prefixes is not None:
                self.prefixes.drop(e.replica_id)
            handle.prefixes_seq = -1
        if t.new == ReplicaState.DOWN:
            del self.replicas[e.replica_id]
            self._early.pop(e.replica_id, None)
        self._wake()
        return lost

    def observe(self, load: LoadReading) -> None:
        """Refresh heartbeat-reported load (for display, tie-breaking, and the room the
        other heads leave); only readings that changed come."""
        handle = self.replicas.get(load.replica_id)
        if handle is None or handle.epoch < load.epoch:
            self._early[load.replica_id] = load
            return
        if handle.epoch == load.epoch:
            handle.queue_length = load.queue_length
            if self._live.set_others(handle, load.others):
                self._wake()  # room the other heads left: requests waiting may take it

    def busy(self, handle: ReplicaHandle) -> None:
        """It refused a request as full with other heads' work: route elsewhere until
        its next heartbeat says how much the other heads hold."""
        self._live.set_others(handle, max(handle.others, handle.capacity))

    def report_prefixes(self, replica_id: int, epoch: int, seq: int, keys: list[int]) -> None:
        """A replica's heartbeat said what its prefix cache holds (``seq``: the
        heartbeat's, so a late report never replaces a newer one)."""
        handle = self.replicas.get(replica_id)
        if self.prefixes is None or handle is None or handle.epoch != epoch:
            return
        if not handle.up or seq <= handle.prefixes_seq:
            return
        handle.prefixes_seq = seq
        self.prefixes.report(replica_id, keys)

    def try_acquire(
        self, request_id: str, affinity: str = "", prefix: RequestPrefix | None = None
    ) -> ReplicaHandle | None:
        """Pick a live replica with spare capacity, or None if there is none now. With
        an ``affinity`` key, the replica that took the key last, if it can. ``prefix``:
        the request's prefix keys, for a cache-aware pool (None: route by load)."""
        handle = self._sticky(affinity) if affinity else None
        reason = RouteReason.AFFINITY
        if handle is None:
            held = self._held(prefix)
            candidates = self._candidates(held)
            if not candidates:
                return None
            index, reason = self._choose(candidates, held, prefix)
            handle = candidates[index]
        self.decisions[reason] += 1
        if affinity:  # also on a sticky hit: keeps a live session's key from aging out
            self.affinity.record(affinity, handle.replica_id)
        if prefix is not None and self.prefixes is not None:
            # Its prefill will cache these: the next turn may come before a report does.
            self.prefixes.routed(handle.replica_id, prefix.keys)
        handle.in_flight += 1
        self._live.moved(handle)
        handle.dispatched_total += 1
        handle.requests.add(request_id)
        return handle

    def _held(self, prefix: RequestPrefix | None) -> dict[int, int]:
        """Replica id -> how much of the request's prefix it holds (cache-aware pools)."""
        if self._cache_policy is None or self.prefixes is None or prefix is None:
            return {}
        return self.prefixes.match(prefix.keys, prefix.weights)

    def _candidates(self, held: dict[int, int]) -> list[ReplicaHandle]:
        """Live replicas with room (of a large stage's sample, the replicas in ``held``
        included; of a sample of all those with room where the sample has none):
        counting the fleet's other heads' requests where any has room so counted, else
        by this head's own count (what the others hold is a heartbeat old; a replica
        still full refuses, and the request moves on)."""
        also = [h for rid in held if (h := self.replicas.get(rid)) and h.up] if held else ()
        drawn = self._live.sample(also)
        shared, free = _room(drawn)
        if not shared and drawn is not self._live.replicas:
            shared, free = self._live.with_room()
        return shared or free

    def _choose(
        self, candidates: list[ReplicaHandle], held: dict[int, int], prefix: RequestPrefix | None
    ) -> tuple[int, RouteReason]:
        if len(candidates) == 1:
            return 0, RouteReason.LOAD
        policy = self._cache_policy
        if policy is None or not held or prefix is None:
            return self.policy.choose(candidates), RouteReason.LOAD
        cached = [held.get(c.replica_id, 0) for c in candidates]
        least = min(c.in_flight for c in candidates)
        bound = load_bound(len(self._live), self._live.in_flight, least)
        return policy.choose_cached(candidates, cached, prefix.total, bound)

    def _sticky(self, key: str) -> ReplicaHandle | None:
        rid = self.affinity.preferred(key)
        handle = self.replicas.get(rid) if rid is not None else None
        if handle is None or not handle.up or handle.in_flight >= handle.capacity:
            return None
        # Loaded well past the others (the cache-aware bound): the session moves once
        # rather than wait behind that replica's queue.
        live = self._live
        bound = load_bound(len(live), live.in_flight, live.least())
        if len(live) > 1 and handle.in_flight + 1 > bound:
            return None
        return handle

    async def wait_capacity(self, started: float, bounds: WaitBounds) -> None:
        """Wait until the pool changes (a replica joins or frees a slot), for a request
        waiting since ``started`` (time.monotonic). StageOverloadedError when the queue
        is full or the wait is over with replicas live but busy (as long as a wait for
        a replica coming back, if one is); with none live, as ``wait_live``."""
        now = time.monotonic()
        live = len(self._live)
        if not live:
            left = self._no_live_deadline(started, now, bounds) - now
        else:
            if self.waiting >= self.max_waiting:
                raise StageOverloadedError(
                    self.stage_id, self.name, f"{self.waiting} requests already waiting"
                )
            wait_s = max(bounds.stage_s, bounds.restart_s) if self.comebacks else bounds.stage_s
            left = started + wait_s - now
            if left <= 0:
                raise StageOverloadedError(
                    self.stage_id,
                    self.name,
                    f"all {live} live replica(s) at capacity for {wait_s:.1f}s",
                )
        await self._wait_counted(left)

    async def wait_live(self, started: float, bounds: WaitBounds) -> None:
        """Return once the stage has a live replica; the errors and bounds of
        ``Comebacks.deadline`` when that takes too long."""
        while not self.has_live():
            now = time.monotonic()
            await self._wait_counted(self._no_live_deadline(started, now, bounds) - now)

    def _no_live_deadline(self, started: float, now: float, bounds: WaitBounds) -> float:
        queue = (self.waiting, self.max_waiting)
        return self.comebacks.deadline(self.stage_id, self.name, started, now, bounds, queue)

    async def _wait_counted(self, timeout: float) -> None:
        self.waiting += 1
        try:
            await self._changed.wait(timeout)
        finally:
            self.waiting -= 1

    def restart(self, replica_id: int, at: float | None) -> None:
        """The head restarts ``replica_id`` at ``at`` (time.monotonic); None: it will
        not after all. Requests waiting for a replica re-judge."""
        self.comebacks.restart(replica_id, at)
        self._wake()

    def release(self, handle: ReplicaHandle, request_id: str) -> None:
        if request_id in handle.requests:
            handle.requests.discard(request_id)
            handle.in_flight -= 1
            self._live.moved(handle)
            self._wake()

    def _wake(self) -> None:
        self._changed.happened()


def _room(handles: list[ReplicaHandle]) -> tuple[list[ReplicaHandle], list[ReplicaHandle]]:
    """Those with room counting the other heads' requests too, and those with room by
    this head's count."""
    free = [r for r in handles if r.in_flight < r.capacity]
    return [r for r in free if r.in_flight + r.others < r.capacity], free


def _handle_from(e: ReplicaEntry, early: LoadReading | None) -> ReplicaHandle:
    """A handle for a new incarnation; ``early``: a load reading that came before it."""
    if early is not None and early.epoch == e.epoch:
        e = dataclasses.replace(e, queue_length=early.queue_length, others=early.others)
    return ReplicaHandle(
        stage_id=e.stage_id,
        replica_id=e.replica_id,
        epoch=e.epoch,
        identity=e.identity,
        capacity=max(1, e.capacity),
        queue_length=e.queue_length,
        others=e.others,
        address=e.address,
        peer_address=e.peer_address,
        host_key=e.host_key,
    )
