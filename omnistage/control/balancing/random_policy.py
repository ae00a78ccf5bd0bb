from __future__ import annotations

import random
from collections.abc import Sequence

from omnistage.control.balancing.base import ReplicaLoad
from omnistage.protocol.enums import LbPolicy


class RandomPolicy:
    name = LbPolicy.RANDOM

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def choose(self, candidates: Sequence[ReplicaLoad]) -> int:
        return self._rng.randrange(len(candidates))
