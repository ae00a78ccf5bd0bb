"""Load-balancing policies: which candidate index each one picks."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass

import pytest

from omnistage.control.balancing import POLICIES, CacheAwarePolicy, make_policy
from omnistage.control.balancing.least_queue import LeastQueueLengthPolicy
from omnistage.control.balancing.power_of_two import PowerOfTwoPolicy
from omnistage.control.balancing.random_policy import RandomPolicy
from omnistage.control.balancing.round_robin import RoundRobinPolicy


@dataclass
class Cand:
    in_flight: int = 0
    queue_length: int = 0


def cands(*loads: int) -> list[Cand]:
    return [Cand(in_flight=n) for n in loads]


# -- round-robin -------------------------------------------------------------------------


def test_round_robin_cycles_through_candidates_in_order():
    policy = RoundRobinPolicy()
    pool = cands(0, 0, 0)
    assert [policy.choose(pool) for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]


def test_round_robin_ignores_load():
    policy = RoundRobinPolicy()
    pool = cands(100, 0, 50)
    assert [policy.choose(pool) for _ in range(3)] == [0, 1, 2]


def test_round_robin_continues_over_a_shrunk_list():
    policy = RoundRobinPolicy()
    pool = cands(0, 0, 0)
    assert [policy.choose(pool) for _ in range(2)] == [0, 1]
    shrunk = cands(0, 0)
    picks = [policy.choose(shrunk) for _ in range(4)]
    assert all(0 <= i < 2 for i in picks)
    # Rotation continues from where it was (index 2 wraps to 0) and alternates.
    assert picks == [0, 1, 0, 1]


def test_round_robin_after_shrinking_from_the_end_stays_in_range():
    policy = RoundRobinPolicy()
    pool = cands(0, 0, 0, 0, 0)
    for _ in range(4):
        policy.choose(pool)  # next would be index 4
    picks = [policy.choose(cands(0)) for _ in range(3)]
    assert picks == [0, 0, 0]
    assert [policy.choose(cands(0, 0, 0)) for _ in range(3)] == [1, 2, 0]


# -- random ------------------------------------------------------------------------------


def test_random_covers_every_candidate_over_many_picks():
    policy = RandomPolicy(random.Random(1234))
    pool = cands(0, 0, 0, 0, 0)
    counts = Counter(policy.choose(pool) for _ in range(1000))
    assert set(counts) == {0, 1, 2, 3, 4}
    assert min(counts.values()) > 100  # roughly uniform: expected 200 each


def test_random_is_reproducible_with_same_seed():
    pool = cands(0, 0, 0, 0)
    a = RandomPolicy(random.Random(42))
    b = RandomPolicy(random.Random(42))
    c = RandomPolicy(random.Random(43))
    seq_a = [a.choose(pool) for _ in range(50)]
    seq_b = [b.choose(pool) for _ in range(50)]
    seq_c = [c.choose(pool) for _ in range(50)]
    assert seq_a == seq_b
    assert seq_a != seq_c


# -- least-queue-length ------------------------------------------------------------------


def test_least_queue_picks_lowest_in_flight():
    policy = LeastQueueLengthPolicy(random.Random(0))
    assert policy.choose(cands(5, 2, 9, 3)) == 1


def test_least_queue_prefers_lowest_in_flight_over_stale_queue_length():
    policy = LeastQueueLengthPolicy(random.Random(0))
    pool = [
        Cand(in_flight=4, queue_length=0),
        Cand(in_flight=1, queue_length=50),  # heartbeat says busy, live count says idle
        Cand(in_flight=3, queue_length=0),
    ]
    assert all(policy.choose(pool) == 1 for _ in range(20))


def test_least_queue_uses_queue_length_only_to_break_in_flight_ties():
    policy = LeastQueueLengthPolicy(random.Random(0))
    pool = [
        Cand(in_flight=2, queue_length=7),
        Cand(in_flight=2, queue_length=1),
        Cand(in_flight=2, queue_length=4),
        Cand(in_flight=3, queue_length=0),
    ]
    assert all(policy.choose(pool) == 1 for _ in range(20))


def test_least_queue_spreads_among_exact_ties():
    policy = LeastQueueLengthPolicy(random.Random(7))
    pool = [Cand(1, 1), Cand(0, 2), Cand(0, 2), Cand(5, 0), Cand(0, 2)]
    counts = Counter(policy.choose(pool) for _ in range(300))
    assert set(counts) == {1, 2, 4}


# -- power-of-two ------------------------------------------------------------------------


def test_power_of_two_with_one_candidate_returns_zero():
    policy = PowerOfTwoPolicy(random.Random(0))
    assert policy.choose(cands(99)) == 0


@pytest.mark.parametrize("loads", [(5, 1), (1, 5)])
def test_power_of_two_with_two_candidates_picks_the_lesser(loads):
    policy = PowerOfTwoPolicy(random.Random(3))
    expected = loads.index(min(loads))
    assert all(policy.choose(cands(*loads)) == expected for _ in range(50))


def test_power_of_two_never_picks_the_most_loaded_of_distinct_loads():
    policy = PowerOfTwoPolicy(random.Random(11))
    pool = cands(3, 9, 1, 6)
    counts = Counter(policy.choose(pool) for _ in range(500))
    assert 1 not in counts  # index 1 carries the highest load
    # The least loaded always wins its comparison, so it is picked most often.
    assert counts.most_common(1)[0][0] == 2


def test_power_of_two_breaks_in_flight_ties_with_queue_length():
    policy = PowerOfTwoPolicy(random.Random(5))
    pool = [Cand(in_flight=2, queue_length=8), Cand(in_flight=2, queue_length=1)]
    assert all(policy.choose(pool) == 1 for _ in range(30))


# -- registry ----------------------------------------------------------------------------


def test_policies_has_exactly_the_five_names():
    assert set(POLICIES) == {
        "random",
        "round-robin",
        "least-queue-length",
        "power-of-two",
        "cache-aware",
    }
    assert len(POLICIES) == 5


@pytest.mark.parametrize(
    ("name", "cls"),
    [
        ("random", RandomPolicy),
        ("round-robin", RoundRobinPolicy),
        ("least-queue-length", LeastQueueLengthPolicy),
        ("power-of-two", PowerOfTwoPolicy),
        ("cache-aware", CacheAwarePolicy),
    ],
)
def test_make_policy_builds_the_named_policy(name, cls):
    policy = make_policy(name, random.Random(0))
    assert isinstance(policy, cls)
    assert policy.name == name


def test_make_policy_passes_the_rng_through():
    pool = cands(0, 0, 0, 0)
    a = make_policy("random", random.Random(99))
    b = make_policy("random", random.Random(99))
    assert [a.choose(pool) for _ in range(30)] == [b.choose(pool) for _ in range(30)]


def test_make_policy_rejects_unknown_name_listing_valid_ones():
    with pytest.raises(ValueError) as info:
        make_policy("least-loaded")
    message = str(info.value)
    assert "least-loaded" in message
    for name in ("random", "round-robin", "least-queue-length", "power-of-two"):
        assert name in message
