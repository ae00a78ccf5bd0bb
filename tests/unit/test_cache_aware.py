"""Cache-aware balancing: the score (cached share minus load), the 1.5x-mean bound, ties,
and StagePool routing with its prefix index (reports, routed keys, replicas leaving,
sticky sessions refused when overloaded, decisions counted by reason)."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass

import pytest

from omnistage.control.balancing import RouteReason, make_policy
from omnistage.control.balancing.cache_aware import CacheAwarePolicy
from omnistage.control.balancing.cache_aware import load_bound as _load_bound
from omnistage.control.balancing.prefix_index import RequestPrefix
from omnistage.dataplane.stage_pool import StagePool
from omnistage.protocol.enums import Reason
from omnistage.protocol.messages import ChatMessage, ReplicaState
from tests.unit.fakes import FakeClock, pool_leave, pool_up


@dataclass
class Load:
    in_flight: int = 0
    queue_length: int = 0
    capacity: int = 8


def loads(*in_flight: int, capacity: int = 8) -> list[Load]:
    return [Load(n, 0, capacity) for n in in_flight]


# -- load_bound ---------------------------------------------------------------------------


def load_bound(live: list[int], least: int) -> int:
    """The bound for live replicas holding ``live`` requests each."""
    return _load_bound(len(live), sum(live), least)


@pytest.mark.parametrize(
    ("live", "least", "bound"),
    [
        ([0, 0], 0, 1),  # ceil(1.5 * 1 / 2) = 1
        ([1, 0], 0, 2),  # ceil(1.5 * 2 / 2) = 2
        ([2, 0], 0, 3),  # ceil(1.5 * 3 / 2) = 3: a replica may reach 3 while the other has 0
        ([3, 0], 0, 3),  # ceil(1.5 * 4 / 2) = 3: the fourth goes elsewhere
        ([3, 1], 1, 4),  # 1.5 * 5 / 2 = 3.75 -> 4
        ([5, 5, 5, 5], 5, 8),  # 1.5 * 21 / 4 = 7.875 -> 8
        ([9, 9], 9, 15),  # 1.5 * 19 / 2 = 14.25 -> 15
        ([6, 0, 0], 0, 4),  # 1.5 * 7 / 3 = 3.5 -> 4
    ],
)
def test_load_bound_is_one_and_a_half_the_mean_rounded_up(live, least, bound):
    assert load_bound(live, least) == bound


def test_load_bound_always_lets_the_least_loaded_candidate_take_one():
    # The least loaded live replicas are full (not candidates); the others exceed 1.5x.
    assert load_bound([0, 0, 0, 9], 9) == 10


def test_the_bound_is_exact_at_integer_boundaries():
    # 1.5 * 4 / 1 = 6 exactly: no float rounding may turn it into 7.
    assert load_bound([3], 3) == 6
    assert load_bound([1, 1, 1], 1) == 2  # 1.5 * 4 / 3 = 2


# -- the score ----------------------------------------------------------------------------


def test_the_replica_holding_the_longest_prefix_wins():
    policy = CacheAwarePolicy(random.Random(0))
    pick, reason = policy.choose_cached(loads(0, 0, 0), [10, 70, 40], total=100, bound=10)
    assert (pick, reason) == (1, RouteReason.CACHE)


def test_load_outweighs_a_small_cache_advantage():
    policy = CacheAwarePolicy(random.Random(0))
    # Replica 0 holds 5% more of the prompt but carries 4/8 = 50% of its capacity.
    pick, reason = policy.choose_cached(loads(4, 0), [55, 50], total=100, bound=10)
    assert (pick, reason) == (1, RouteReason.LOAD)


def test_between_replicas_holding_the_same_prefix_the_less_loaded_wins_for_load():
    policy = CacheAwarePolicy(random.Random(0))
    pick, reason = policy.choose_cached(loads(2, 1, 3), [40, 40, 40], total=100, bound=10)
    assert (pick, reason) == (1, RouteReason.LOAD)


def test_a_candidate_over_the_bound_is_passed_over_however_much_it_holds():
    policy = CacheAwarePolicy(random.Random(0))
    bound = load_bound([3, 0], 0)  # 3: replica 0 would reach 4
    pick, reason = policy.choose_cached(loads(3, 0), [100, 0], total=100, bound=bound)
    assert (pick, reason) == (1, RouteReason.LOAD)


def test_ties_go_to_the_least_loaded_then_the_shorter_queue_then_at_random():
    policy = CacheAwarePolicy(random.Random(1))
    # Equal score (share - load) but different counts: capacity 16 vs 8.
    cands = [Load(2, 0, 16), Load(1, 0, 8)]
    assert policy.choose_cached(cands, [0, 0], 100, 10)[0] == 1
    cands = [Load(1, 5, 8), Load(1, 2, 8)]
    assert policy.choose_cached(cands, [30, 30], 100, 10)[0] == 1
    picks = Counter(
        policy.choose_cached(loads(0, 0, 0), [30, 30, 30], 100, 10)[0] for _ in range(300)
    )
    assert set(picks) == {0, 1, 2}  # equal in every way: spread at random


def test_a_request_without_keys_falls_back_to_least_queue_length():
    policy = make_policy("cache-aware", random.Random(0))
    assert policy.choose(loads(3, 1, 2)) == 1


# -- StagePool with the cache-aware policy -----------------------------------------------


def _up(pool: StagePool, rid: int, capacity: int = 8, epoch: int = 1) -> None:
    pool_up(pool, rid, capacity, epoch)


_leave = pool_leave


def _pool(n: int = 2, capacity: int = 8, policy: str = "cache-aware") -> StagePool:
    pool = StagePool(0, "thinker", make_policy(policy, random.Random(7)), clock=FakeClock())
    for rid in range(n):
        _up(pool, rid, capacity)
    return pool


SYSTEM = ChatMessage(role="system", content="You are a helpful assistant. " * 20)


def _conversation(name: str, turns: int) -> RequestPrefix:
    """The prompt of a conversation's turn ``turns`` (1-based): system, then turns."""
    msgs = [SYSTEM]
    for t in range(turns):
        if t:
            msgs.append(ChatMessage(role="assistant", content=f"{name} answer {t}"))
        msgs.append(ChatMessage(role="user", content=f"{name} question {t + 1} " * 5))
    prefix = RequestPrefix.of(msgs)
    assert prefix is not None
    return prefix


def _turn(pool: StagePool, request_id: str, prefix: RequestPrefix | None, key: str = "") -> int:
    handle = pool.try_acquire(request_id, key, prefix)
    assert handle is not None
    pool.release(handle, request_id)
    return handle.replica_id


def test_a_conversations_turns_follow_its_routed_prefix():
    pool = _pool(3)
    first = _turn(pool, "a1", _conversation("a", 1))
    later = [_turn(pool, f"a{t}", _conversation("a", t)) for t in range(2, 6)]
    assert later == [first] * 4
    assert pool.decisions == {"cache": 4, "load": 1, "affinity": 0}


def test_conversations_sharing_a_system_prompt_stay_within_the_bound():
    # The shared system prompt is most of each first turn: the replica that prefilled it
    # first draws the next ones, up to the bound; the first that spills caches it on the
    # other replica too, and from then on load decides between them.
    pool = _pool(2, capacity=64)
    held = [pool.try_acquire(f"{c}1", "", _conversation(c, 1)) for c in "abcdefghij"]
    rids = [h.replica_id for h in held if h is not None]
    first = rids[0]
    assert rids[:4] == [first, first, first, 1 - first]
    counts = Counter(rids)
    assert max(counts.values()) <= -(-3 * 10 // 4)  # ceil(1.5 x the mean of 5)
    assert min(counts.values()) >= 4


def test_a_reported_cache_draws_the_request_to_its_replica():
    pool = _pool(3)
    prefix = _conversation("b", 3)
    assert pool.prefixes is not None
    pool.report_prefixes(2, epoch=1, seq=5, keys=prefix.keys[:-2])
    assert _turn(pool, "b3", prefix) == 2
    assert pool.decisions["cache"] == 1


def test_reports_of_another_incarnation_or_out_of_order_are_ignored():
    pool = _pool(2)
    prefix = _conversation("c", 2)
    pool.report_prefixes(1, epoch=9, seq=1, keys=prefix.keys)  # not this incarnation
    pool.report_prefixes(1, epoch=1, seq=4, keys=[])
    pool.report_prefixes(1, epoch=1, seq=3, keys=prefix.keys)  # older than seq 4
    assert pool.prefixes is not None
    assert pool.prefixes.match(prefix.keys, prefix.weights) == {}


@pytest.mark.parametrize(
    ("state", "reason"),
    [(ReplicaState.ERROR, Reason.PROCESS_EXITED), (ReplicaState.DOWN, Reason.SHUT_DOWN)],
)
def test_a_replica_that_goes_away_loses_its_entries_and_turns_move(state, reason):
    pool = _pool(2)
    first = _turn(pool, "d1", _conversation("d", 1))
    pool.report_prefixes(first, epoch=1, seq=1, keys=_conversation("d", 1).keys)
    _leave(pool, first, state, reason)
    assert pool.prefixes is not None
    assert first not in pool.prefixes.replicas()
    other = _turn(pool, "d2", _conversation("d", 2))
    assert other != first
    # Back as a new incarnation (an empty cache): the conversation stays where it moved.
    _up(pool, first, epoch=2)
    assert _turn(pool, "d3", _conversation("d", 3)) == other


def test_a_hot_prefix_spreads_within_one_and_a_half_times_the_mean():
    pool = _pool(2, capacity=64)
    prefix = _conversation("hot", 1)
    pool.report_prefixes(0, epoch=1, seq=1, keys=prefix.keys)  # only replica 0 has it
    held = [pool.try_acquire(f"h{i}", "", prefix) for i in range(40)]
    counts = Counter(h.replica_id for h in held if h is not None)
    mean = 40 / 2
    assert max(counts.values()) <= 1.5 * mean
    # Replica 0 took the first three (its cache), the fourth spilled to replica 1 (which
    # then holds the prefix too: from there the two share the load).
    assert [h.replica_id for h in held[:4] if h is not None] == [0, 0, 0, 1]
    assert pool.decisions["cache"] == 3


def test_a_sticky_session_is_refused_when_its_replica_is_overloaded():
    pool = _pool(2, capacity=64, policy="round-robin")
    first = pool.try_acquire("s0", "sess")
    assert first is not None
    # Two requests of other sessions stick to the same replica: 3 in flight there, 0 on
    # the other; each was within ceil(1.5 x the mean) when it came.
    for i in range(2):
        pool.affinity.record(f"o{i}", first.replica_id)
        assert pool.try_acquire(f"o{i}", f"o{i}") is first
    # A fourth there would exceed ceil(1.5 * 4 / 2) = 3: the session moves, and stays.
    moved = pool.try_acquire("s1", "sess")
    assert moved is not None and moved is not first
    assert pool.affinity.preferred("sess") == moved.replica_id
    assert pool.decisions == {"cache": 0, "load": 2, "affinity": 2}


def test_sticky_hits_count_as_affinity_and_policy_picks_as_load():
    pool = _pool(2, policy="round-robin")
    _turn(pool, "r0", None, "sess")
    _turn(pool, "r1", None, "sess")
    _turn(pool, "r2", None)
    assert pool.decisions == {"cache": 0, "load": 2, "affinity": 1}


def test_other_policies_keep_no_index_and_ignore_prefixes():
    pool = _pool(2, policy="round-robin")
    assert pool.prefixes is None
    prefix = _conversation("e", 1)
    assert [_turn(pool, f"e{i}", prefix) for i in range(4)] in ([0, 1, 0, 1], [1, 0, 1, 0])
    pool.report_prefixes(0, epoch=1, seq=1, keys=prefix.keys)  # ignored, no error


def test_a_conversation_follows_its_prefix_in_a_stage_too_large_to_walk():
    # 200 live replicas: each request looks at a random 32 of them, plus those holding
    # its prefix, so the conversation still finds the replica that has its turns.
    pool = _pool(200)
    first = _turn(pool, "f1", _conversation("f", 1))
    later = [_turn(pool, f"f{t}", _conversation("f", t)) for t in range(2, 8)]
    assert later == [first] * 6
    assert pool.decisions["cache"] == 6
