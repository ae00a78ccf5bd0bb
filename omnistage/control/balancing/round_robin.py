from __future__ import annotations

from collections.abc import Sequence

from omnistage.control.balancing.base import ReplicaLoad
from omnistage.protocol.enums import LbPolicy


class RoundRobinPolicy:
    """Cycles through the candidates. The counter is per pool, so when the candidate
    list changes (a replica joins or dies) the rotation continues over the new list."""

    name = LbPolicy.ROUND_ROBIN

    def __init__(self) -> None:
        self._next = 0

    def choose(self, candidates: Sequence[ReplicaLoad]) -> int:
        index = self._next % len(candidates)
        self._next = index + 1
        return index
