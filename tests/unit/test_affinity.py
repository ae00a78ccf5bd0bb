"""Session affinity: AffinityMap's bound, and StagePool.try_acquire with an affinity key
(sticks while the replica can take it, moves when it cannot, and records the move)."""

from __future__ import annotations

import pytest

from omnistage.control.balancing import make_policy
from omnistage.control.balancing.affinity import AffinityMap
from omnistage.dataplane.stage_pool import StagePool
from omnistage.protocol.enums import Reason
from omnistage.protocol.messages import ReplicaState
from tests.unit.fakes import pool_leave, pool_up

# -- AffinityMap --------------------------------------------------------------------------


def test_affinity_map_remembers_the_last_replica_per_key():
    m = AffinityMap()
    assert m.preferred("s1") is None
    m.record("s1", 0)
    m.record("s2", 1)
    m.record("s1", 2)  # the key moved
    assert (m.preferred("s1"), m.preferred("s2"), len(m)) == (2, 1, 2)


def test_affinity_map_drops_the_least_recently_used_key_past_its_bound():
    m = AffinityMap(max_keys=3)
    for i, key in enumerate(["a", "b", "c"]):
        m.record(key, i)
    m.record("a", 0)  # used again: now the newest
    m.record("d", 3)  # over the bound: "b" is the oldest
    assert len(m) == 3
    assert m.preferred("b") is None
    assert [m.preferred(k) for k in "acd"] == [0, 2, 3]


def test_affinity_map_of_one_keeps_only_the_last_key():
    m = AffinityMap(max_keys=1)
    m.record("a", 0)
    m.record("b", 1)
    assert (m.preferred("a"), m.preferred("b"), len(m)) == (None, 1, 1)


# -- StagePool.try_acquire with affinity --------------------------------------------------


_up = pool_up
_leave = pool_leave


def _pool(n: int = 2, capacity: int = 2) -> StagePool:
    pool = StagePool(0, "thinker", make_policy("round-robin"))
    for rid in range(n):
        _up(pool, rid, capacity)
    return pool


def _turn(pool: StagePool, request_id: str, key: str) -> int:
    """One request that finishes at once (a turn): the replica id it went to."""
    handle = pool.try_acquire(request_id, key)
    assert handle is not None
    pool.release(handle, request_id)
    return handle.replica_id


def test_a_key_sticks_to_the_replica_that_took_it_first():
    pool = _pool(3, capacity=8)
    first = _turn(pool, "r0", "sess-a")
    # Round-robin alone would rotate through the three replicas.
    assert [_turn(pool, f"r{i}", "sess-a") for i in range(1, 7)] == [first] * 6
    assert pool.replicas[first].dispatched_total == 7
    assert pool.affinity.preferred("sess-a") == first


def test_keys_spread_by_the_policy_and_each_sticks():
    pool = _pool(2, capacity=8)
    a, b = _turn(pool, "a0", "sess-a"), _turn(pool, "b0", "sess-b")
    assert a != b  # round-robin gave the second key the other replica
    for i in range(1, 4):
        assert (_turn(pool, f"a{i}", "sess-a"), _turn(pool, f"b{i}", "sess-b")) == (a, b)


def test_without_a_key_the_policy_decides_as_before():
    pool = _pool(2, capacity=8)
    _turn(pool, "k0", "sess-a")
    picks = []
    for i in range(4):
        handle = pool.try_acquire(f"n{i}")
        assert handle is not None
        picks.append(handle.replica_id)
        pool.release(handle, f"n{i}")
    assert picks in ([0, 1, 0, 1], [1, 0, 1, 0])
    assert len(pool.affinity) == 1  # keyless requests record nothing


@pytest.mark.parametrize(
    ("state", "reason"),
    [
        (ReplicaState.DOWN, Reason.SHUT_DOWN),
        (ReplicaState.ERROR, Reason.PROCESS_EXITED),
        (ReplicaState.DRAINING, Reason.DRAINING),
    ],
)
def test_the_key_moves_when_its_replica_leaves_and_stays_moved(state, reason):
    pool = _pool(2, capacity=8)
    first = _turn(pool, "r0", "sess-a")
    _leave(pool, first, state, reason)
    other = _turn(pool, "r1", "sess-a")
    assert other != first
    assert pool.affinity.preferred("sess-a") == other
    # The first replica returns (a new incarnation): the key stays where it went.
    _up(pool, first, capacity=8, epoch=2)
    assert [_turn(pool, f"r{i}", "sess-a") for i in range(2, 5)] == [other] * 3


def test_the_key_moves_when_its_replica_is_full_and_the_move_is_recorded():
    pool = _pool(2, capacity=1)
    first = pool.try_acquire("r0", "sess-a")
    assert first is not None
    # The same session's next request while the first is in flight: the replica is full.
    second = pool.try_acquire("r1", "sess-a")
    assert second is not None and second.replica_id != first.replica_id
    assert pool.affinity.preferred("sess-a") == second.replica_id
    pool.release(first, "r0")
    pool.release(second, "r1")
    assert _turn(pool, "r2", "sess-a") == second.replica_id


def test_no_replica_with_room_is_none_and_keeps_the_key():
    pool = _pool(1, capacity=1)
    held = pool.try_acquire("r0", "sess-a")
    assert held is not None
    assert pool.try_acquire("r1", "sess-a") is None
    assert pool.affinity.preferred("sess-a") == held.replica_id
    assert held.dispatched_total == 1


def test_a_sticky_hit_keeps_the_key_from_aging_out():
    pool = _pool(2, capacity=8)
    pool.affinity = AffinityMap(max_keys=2)
    a = _turn(pool, "a0", "sess-a")
    _turn(pool, "b0", "sess-b")
    _turn(pool, "a1", "sess-a")  # a sticky hit: sess-a is now the most recent
    _turn(pool, "c0", "sess-c")  # evicts sess-b, the least recently used
    assert pool.affinity.preferred("sess-b") is None
    assert pool.affinity.preferred("sess-a") == a
