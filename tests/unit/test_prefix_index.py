"""The head's prefix index: reported keys replace wholesale, routed keys expire (by TTL,
or when a later report leaves them out), a replica's entries go with it, memory stays
bounded, and ``match`` finds each replica's longest held prefix."""

from __future__ import annotations

from omnistage.control.balancing.prefix_index import PrefixIndex, RequestPrefix
from omnistage.protocol.messages import ChatMessage
from omnistage.protocol.prefix import MAX_REPORTED, prefix_keys, prefix_weights
from tests.unit.fakes import FakeClock

KEYS = [11, 12, 13, 14]  # a four-message conversation's prefix keys
WEIGHTS = [10, 25, 40, 70]


def _index(clock: FakeClock, **kw: float) -> PrefixIndex:
    return PrefixIndex(clock, ttl_s=kw.get("ttl_s", 60.0), confirm_s=kw.get("confirm_s", 5.0))


def test_match_gives_each_replica_the_weight_of_its_longest_held_prefix():
    idx = _index(FakeClock())
    idx.report(0, [11, 12])
    idx.report(1, [11, 99])
    idx.report(2, [98, 99])
    assert idx.match(KEYS, WEIGHTS) == {0: 25, 1: 10}  # replica 2 holds none of them


def test_match_takes_the_longest_even_when_a_shorter_one_is_missing():
    # A cache may have evicted a short prefix and kept a long one: the long one counts.
    idx = _index(FakeClock())
    idx.report(0, [13])
    assert idx.match(KEYS, WEIGHTS) == {0: 40}


def test_a_report_replaces_the_last_one_wholesale():
    idx = _index(FakeClock())
    idx.report(0, [11, 12, 13])
    idx.report(0, [11])  # the engine evicted 12 and 13
    assert idx.match(KEYS, WEIGHTS) == {0: 10}
    idx.report(0, [])
    assert idx.match(KEYS, WEIGHTS) == {}
    assert idx.reported_count(0) == 0


def test_routed_keys_count_at_once_and_expire_after_the_ttl():
    clock = FakeClock()
    idx = _index(clock, ttl_s=60.0)
    idx.routed(1, KEYS[:3])
    assert idx.match(KEYS, WEIGHTS) == {1: 40}
    clock.now += 59.9
    assert idx.match(KEYS, WEIGHTS) == {1: 40}
    clock.now += 0.2
    assert idx.match(KEYS, WEIGHTS) == {}
    assert idx.routed_count(1) == 0


def test_routing_a_key_again_refreshes_it():
    clock = FakeClock()
    idx = _index(clock, ttl_s=60.0)
    idx.routed(0, [11, 12])
    clock.now += 50
    idx.routed(0, [11])  # the next turn shares only the first prefix
    clock.now += 20
    assert idx.match(KEYS, WEIGHTS) == {0: 10}  # 12 expired, 11 was refreshed


def test_a_report_soon_after_routing_keeps_the_routed_keys():
    # The request may still be queued or prefilling: the report cannot show it yet.
    clock = FakeClock()
    idx = _index(clock, confirm_s=5.0)
    idx.routed(0, KEYS)
    clock.now += 1
    idx.report(0, [11])
    assert idx.match(KEYS, WEIGHTS) == {0: 70}


def test_a_report_well_after_routing_that_lacks_the_keys_drops_them():
    clock = FakeClock()
    idx = _index(clock, confirm_s=5.0, ttl_s=600.0)
    idx.routed(0, KEYS)
    clock.now += 6
    idx.report(0, [11])  # the engine never cached (or already evicted) the rest
    assert idx.match(KEYS, WEIGHTS) == {0: 10}
    assert idx.routed_count(0) == 0


def test_routed_keys_a_report_confirms_follow_the_reports_from_then_on():
    clock = FakeClock()
    idx = _index(clock, confirm_s=5.0, ttl_s=600.0)
    idx.routed(0, KEYS)
    clock.now += 1
    idx.report(0, KEYS)  # confirmed: the report owns them now
    assert idx.routed_count(0) == 0
    idx.report(0, [11])  # and a later eviction shows at once
    assert idx.match(KEYS, WEIGHTS) == {0: 10}


def test_drop_forgets_a_replica_entirely():
    clock = FakeClock()
    idx = _index(clock)
    idx.report(0, [11, 12])
    idx.routed(0, [13])
    idx.routed(1, [11])
    idx.drop(0)
    assert idx.match(KEYS, WEIGHTS) == {1: 10}
    assert idx.replicas() == {1}
    assert idx.reported_count(0) is None


def test_memory_is_bounded_per_replica():
    clock = FakeClock()
    idx = PrefixIndex(clock, max_routed=100)
    idx.report(0, range(10_000))
    assert idx.reported_count(0) == MAX_REPORTED  # a replica cannot make the head hoard
    idx.routed(1, list(range(20_000, 20_250)))
    assert idx.routed_count(1) == 100
    # The most recent were kept.
    assert idx.match([20_249], [5]) == {1: 5}
    assert idx.match([20_000], [5]) == {}


def test_request_prefix_of_chat_messages_and_of_none():
    msgs = [ChatMessage(role="system", content="be brief"), ChatMessage(role="user", content="hi")]
    p = RequestPrefix.of(msgs)
    assert p is not None
    assert p.keys == prefix_keys(msgs) and p.weights == prefix_weights(msgs)
    assert p.total == p.weights[-1]
    assert RequestPrefix.of([]) is None


def _match_by_walking(idx: PrefixIndex, keys: list[int], weights: list[int]) -> dict[int, int]:
    """``match`` as a walk over every replica's entries (how it was computed before the
    index by key): the oracle for the property test below."""
    cutoff = idx._clock() - idx.ttl_s
    out: dict[int, int] = {}
    for rid in idx.replicas():
        reported = idx._reported.get(rid, frozenset())
        routed = idx._routed.get(rid, {})
        for i in range(len(keys) - 1, -1, -1):
            if keys[i] in reported or routed.get(keys[i], cutoff) > cutoff:
                out[rid] = weights[i]
                break
    return out


def test_the_index_by_key_stays_in_step_with_every_replicas_entries():
    # Random histories of reports, routings, drops and passing time over a small key
    # space (so keys are shared and evicted often): match by key equals the walk over
    # every replica, and the index by key holds exactly the replicas' entries (nothing
    # stale left behind to grow without bound).
    import random

    for seed in range(20):
        rng = random.Random(seed)
        clock = FakeClock()
        idx = PrefixIndex(clock, ttl_s=10.0, confirm_s=2.0, max_routed=6)
        for _ in range(400):
            op = rng.random()
            rid = rng.randrange(8)
            if op < 0.35:
                idx.routed(rid, rng.sample(range(20), rng.randint(1, 5)))
            elif op < 0.6:
                idx.report(rid, rng.sample(range(20), rng.randint(0, 6)))
            elif op < 0.65:
                idx.drop(rid)
            elif op < 0.8:
                clock.now += rng.choice([0.5, 1.0, 3.0, 9.0])
            else:
                keys = sorted(rng.sample(range(20), rng.randint(1, 6)))
                weights = [10 * (i + 1) for i in range(len(keys))]
                assert idx.match(keys, weights) == _match_by_walking(idx, keys, weights)
            reported = {(k, r) for r, held in idx._reported.items() for k in held}
            routed = {(k, r) for r, held in idx._routed.items() for k in held}
            assert {(k, r) for k, rs in idx._reported_by.items() for r in rs} == reported
            assert {(k, r) for k, rs in idx._routed_by.items() for r in rs} == routed
            assert all(idx._reported_by.values()) and all(idx._routed_by.values())
