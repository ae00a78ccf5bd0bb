"""Session affinity: requests that share a key go to the replica that served the key
last, while it is up and has room.

A Realtime session sends each turn with the session's key, so the thinker replica that
answered the last turn (whose prefix cache holds the conversation so far) answers the
next one. When that replica is gone or full the balancing policy picks another, and the
key moves with it: the conversation itself travels in every request, so nothing is lost,
only the cache is cold once.
"""

from __future__ import annotations

from collections import OrderedDict


class AffinityMap:
    """Key -> replica id, the ``max_keys`` most recently used (one map per stage)."""

    def __init__(self, max_keys: int = 16384) -> None:
        self.max_keys = max_keys
        self._replica: OrderedDict[str, int] = OrderedDict()

    def preferred(self, key: str) -> int | None:
        return self._replica.get(key)

    def record(self, key: str, replica_id: int) -> None:
        self._replica[key] = replica_id
        self._replica.move_to_end(key)
        while len(self._replica) > self.max_keys:
            self._replica.popitem(last=False)

    def __len__(self) -> int:
        return len(self._replica)
