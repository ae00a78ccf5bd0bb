from __future__ import annotations

import random
from collections.abc import Sequence

from omnistage.control.balancing.base import ReplicaLoad, load_of
from omnistage.protocol.enums import LbPolicy


class LeastQueueLengthPolicy:
    """Pick the replica with the fewest requests in flight, by the head's live count.

    Heartbeat-only queue lengths are up to an interval stale, so a burst would all land
    on the replica that looked idle at the last heartbeat (vLLM-Omni's herding). The
    live count moves with every dispatch. Ties break at random so equal replicas share.
    """

    name = LbPolicy.LEAST_QUEUE_LENGTH

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def choose(self, candidates: Sequence[ReplicaLoad]) -> int:
        best = min(load_of(c) for c in candidates)
        tied = [i for i, c in enumerate(candidates) if load_of(c) == best]
        return tied[0] if len(tied) == 1 else self._rng.choice(tied)
