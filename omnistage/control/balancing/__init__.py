"""Load-balancing policies, one small class per file, chosen by --omni-lb-policy."""

from __future__ import annotations

import random

from omnistage.control.balancing.base import BalancingPolicy, ReplicaLoad, RouteReason
from omnistage.control.balancing.cache_aware import CacheAwarePolicy
from omnistage.control.balancing.least_queue import LeastQueueLengthPolicy
from omnistage.control.balancing.power_of_two import PowerOfTwoPolicy
from omnistage.control.balancing.random_policy import RandomPolicy
from omnistage.control.balancing.round_robin import RoundRobinPolicy
from omnistage.protocol.enums import LbPolicy

POLICIES: dict[str, type] = {
    p.name: p
    for p in (
        RandomPolicy,
        RoundRobinPolicy,
        LeastQueueLengthPolicy,
        PowerOfTwoPolicy,
        CacheAwarePolicy,
    )
}


# One class for each name the config accepts (protocol.enums.LbPolicy).
assert set(POLICIES) == set(LbPolicy), sorted(set(POLICIES) ^ set(LbPolicy))


def make_policy(name: str, rng: random.Random | None = None) -> BalancingPolicy:
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(
            f"unknown policy {name!r}; expected one of {', '.join(POLICIES)}"
        ) from None
    return cls() if cls is RoundRobinPolicy else cls(rng)


__all__ = [
    "POLICIES",
    "BalancingPolicy",
    "CacheAwarePolicy",
    "ReplicaLoad",
    "RouteReason",
    "make_policy",
]
