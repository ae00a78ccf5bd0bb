"""A stage's live replicas and their load kept as requests come and go (``LivePool``),
and routing in a stage too large to walk per request: a random sample, a walk of all
only where the sample has no room."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Sequence

import pytest

from omnistage.control.balancing import make_policy
from omnistage.control.balancing.base import ReplicaLoad
from omnistage.control.replica_table import LoadReading
from omnistage.dataplane import pool_load
from omnistage.dataplane.pool_load import SAMPLE, SAMPLE_ABOVE
from omnistage.dataplane.stage_pool import ReplicaHandle, StagePool
from omnistage.protocol.enums import Reason
from omnistage.protocol.messages import ReplicaState
from tests.unit.fakes import pool_leave, pool_up

STATES = {
    ReplicaState.DRAINING: Reason.SHUT_DOWN,
    ReplicaState.ERROR: Reason.PROCESS_EXITED,
    ReplicaState.DOWN: Reason.SHUT_DOWN,
}


def _up(pool: StagePool, rid: int, capacity: int = 4, epoch: int = 1) -> None:
    pool_up(pool, rid, capacity, epoch)


def _leave(pool: StagePool, rid: int, state: ReplicaState, epoch: int = 1) -> set[str]:
    return pool_leave(pool, rid, state, STATES[state], epoch)


class Recording:
    """A policy that records how many candidates each request was offered."""

    name = "recording"

    def __init__(self, inner: object) -> None:
        self.inner = inner
        self.offered: list[int] = []

    def choose(self, candidates: Sequence[ReplicaLoad]) -> int:
        self.offered.append(len(candidates))
        return self.inner.choose(candidates)  # type: ignore[attr-defined]


def _pool(n: int, capacity: int = 4, seed: int = 3) -> tuple[StagePool, Recording]:
    policy = Recording(make_policy("least-queue-length", random.Random(seed)))
    pool = StagePool(0, "s", policy, rng=random.Random(seed))  # type: ignore[arg-type]
    for rid in range(n):
        _up(pool, rid, capacity)
    return pool, policy


def _check(pool: StagePool) -> None:
    """The kept figures against a walk of every replica."""
    live = [r for r in pool.replicas.values() if r.up]
    # The same handles (their order may differ: a replica back UP joins at the end).
    assert sorted(map(id, pool.live())) == sorted(map(id, live))
    assert pool._live.in_flight == sum(r.in_flight for r in live)
    assert pool._live.least() == min((r.in_flight for r in live), default=0)
    assert pool.has_live() == bool(live)
    assert pool.slots() == (sum(r.capacity for r in live), pool._live.in_flight)
    free = {r.replica_id for r in live if r.in_flight < r.capacity}
    assert {r.replica_id for r in pool._live._free.items} == free
    shared = {r.replica_id for r in live if r.in_flight + r.others < r.capacity}
    assert {r.replica_id for r in pool._live._open.items} == shared


def test_a_small_stage_offers_every_live_replica_a_large_one_a_sample() -> None:
    small, small_policy = _pool(SAMPLE_ABOVE)
    large, large_policy = _pool(SAMPLE_ABOVE + 1)
    for i in range(10):
        assert small.try_acquire(f"s{i}") is not None
        assert large.try_acquire(f"l{i}") is not None
    assert small_policy.offered == [SAMPLE_ABOVE] * 10
    assert large_policy.offered == [SAMPLE] * 10


def test_least_loaded_of_a_sample_spreads_a_large_stage_evenly() -> None:
    pool, _ = _pool(200, capacity=8)
    for i in range(400):
        assert pool.try_acquire(f"r{i}") is not None
    counts = Counter(r.in_flight for r in pool.replicas.values())
    # Two each would be perfect; the least loaded of 32 random ones stays within one.
    assert min(counts) >= 1 and max(counts) <= 3, counts
    _check(pool)


def test_a_request_finds_the_one_replica_with_room_outside_the_sample() -> None:
    pool, _ = _pool(300, capacity=1)
    held = [pool.try_acquire(f"r{i}") for i in range(300)]
    assert all(h is not None for h in held)
    assert pool.try_acquire("full") is None  # every replica holds its one request
    handle = held[123]
    assert handle is not None
    pool.release(handle, "r123")
    again = pool.try_acquire("next")
    assert again is handle  # the sample (32 of 300) had no room: all were walked
    _check(pool)


@pytest.mark.parametrize("seed", range(20))
def test_kept_figures_match_a_walk_through_any_history(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Small thresholds, so that sampling, walks and a history of replicas coming, going,
    # draining and coming back as new incarnations all happen in a few hundred steps.
    monkeypatch.setattr(pool_load, "SAMPLE_ABOVE", 4)
    monkeypatch.setattr(pool_load, "SAMPLE", 2)
    rng = random.Random(seed)
    pool = StagePool(0, "s", make_policy("least-queue-length", rng), rng=rng)
    epochs: dict[int, int] = {}
    held: list[tuple[ReplicaHandle, str]] = []
    for step in range(400):
        op = rng.random()
        rid = rng.randrange(10)
        if op < 0.15:
            epochs[rid] = epochs.get(rid, 0) + rng.choice((0, 1))  # or a new incarnation
            _up(pool, rid, capacity=rng.randrange(1, 4), epoch=max(1, epochs[rid]))
        elif op < 0.25 and rid in epochs:
            state = rng.choice(list(STATES))
            lost = _leave(pool, rid, state, epoch=max(1, epochs[rid]))
            held = [(h, r) for h, r in held if r not in lost]
        elif op < 0.35 and rid in epochs:
            # A heartbeat's load (sometimes of an incarnation not UP here yet), or a BUSY.
            epoch = max(1, epochs[rid]) + rng.choice((0, 0, 1))
            pool.observe(LoadReading(0, rid, epoch, rng.randrange(3), rng.randrange(4)))
            if rid in pool.replicas and rng.random() < 0.2:
                pool.busy(pool.replicas[rid])
        elif op < 0.65:
            handle = pool.try_acquire(f"q{step}")
            room = [r for r in pool.replicas.values() if r.up and r.in_flight < r.capacity]
            if handle is None:
                assert not room, "a request was refused while a replica had room"
            else:
                held.append((handle, f"q{step}"))
        elif held:
            handle, request_id = held.pop(rng.randrange(len(held)))
            pool.release(handle, request_id)
        _check(pool)


def test_a_request_finds_room_the_other_heads_left_outside_the_sample() -> None:
    pool, _ = _pool(300, capacity=2)
    for rid in range(300):  # the other heads hold every slot but replica 77's
        pool.observe(LoadReading(0, rid, 1, 0, 1 if rid == 77 else 2))
    handle = pool.try_acquire("r")
    assert handle is not None and handle.replica_id == 77
    _check(pool)


def test_a_load_reading_before_its_replica_is_up_here_is_kept_for_it() -> None:
    pool, _ = _pool(2, capacity=2)
    # Replica 5's heartbeat said the other heads fill it; its UP had not reached the
    # pool yet. Readings come only on change: this one must not be lost.
    pool.observe(LoadReading(0, 5, 3, 1, 2))
    _up(pool, 5, capacity=2, epoch=3)
    handle = pool.replicas[5]
    assert (handle.queue_length, handle.others) == (1, 2)
    _check(pool)
    # A reading of an older incarnation is not kept for a newer one.
    pool.observe(LoadReading(0, 6, 1, 1, 2))
    _up(pool, 6, capacity=2, epoch=2)
    assert pool.replicas[6].others == 0
