from __future__ import annotations

import random
from collections.abc import Sequence

from omnistage.control.balancing.base import ReplicaLoad, load_of
from omnistage.protocol.enums import LbPolicy


class PowerOfTwoPolicy:
    """Power of two choices: sample two distinct replicas, keep the less loaded one.

    Nearly as good as least-loaded at spreading load, without every dispatcher
    converging on the same replica when counts are equal or stale.
    """

    name = LbPolicy.POWER_OF_TWO

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def choose(self, candidates: Sequence[ReplicaLoad]) -> int:
        if len(candidates) == 1:
            return 0
        a, b = self._rng.sample(range(len(candidates)), 2)
        return a if load_of(candidates[a]) <= load_of(candidates[b]) else b
