"""The head's recent replica state changes and local restarts, for the views of the
running system (/v1/omni/stages, the dashboard, ``omnistage status``).

Pure and bounded: a ring of the last changes with wall-clock times (an injected clock),
and a count of restarts per replica. Written from the head's event loop only.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable
from typing import Any

from omnistage.control.replica_table import Transition

MAX_CHANGES = 50


class History:
    def __init__(
        self,
        stage_names: dict[int, str],
        clock: Callable[[], float] = time.time,
        max_changes: int = MAX_CHANGES,
    ) -> None:
        self._names = stage_names
        self._clock = clock
        self._changes: deque[dict[str, Any]] = deque(maxlen=max_changes)
        self.restarts: Counter[tuple[int, int]] = Counter()

    def changed(self, t: Transition) -> None:
        e = t.entry
        self._changes.append(
            {
                "time": round(self._clock(), 3),
                "stage_id": e.stage_id,
                "stage": self._names.get(e.stage_id, str(e.stage_id)),
                "replica_id": e.replica_id,
                "epoch": e.epoch,
                "old": str(t.old) if t.old is not None else None,
                "state": str(t.new),
                "reason": t.why,
            }
        )

    def restarted(self, stage_id: int, replica_id: int) -> None:
        self.restarts[(stage_id, replica_id)] += 1

    def recent(self, limit: int = 20) -> list[dict[str, Any]]:
        """The last ``limit`` changes, newest first."""
        out = list(self._changes)[-limit:]
        out.reverse()
        return out
