"""The balancing policy interface: pick one replica among live candidates."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Protocol


class RouteReason(enum.StrEnum):
    """Why a request went to the replica it went to (counted per stage, shown in
    /v1/omni/stages and /metrics)."""

    CACHE = "cache"  # it held more of the prompt's prefix than another candidate
    LOAD = "load"  # the policy's load rule (or the only candidate)
    AFFINITY = "affinity"  # its session's last turn went there


class ReplicaLoad(Protocol):
    """What a policy may look at. ``in_flight`` is the head's own live count of
    requests it has sent to the replica and not seen finish; ``queue_length`` is the
    replica's last heartbeat (up to one heartbeat interval old)."""

    @property
    def in_flight(self) -> int: ...

    @property
    def queue_length(self) -> int: ...


class BalancingPolicy(Protocol):
    name: str

    def choose(self, candidates: Sequence[ReplicaLoad]) -> int:
        """Return the index of the chosen candidate; ``candidates`` is never empty."""
        ...


def load_of(replica: ReplicaLoad) -> tuple[int, int]:
    """Live count first; the heartbeat's queue length only breaks ties, since it lags."""
    return (replica.in_flight, replica.queue_length)
