"""Stand-ins shared by the unit tests: a head for the HTTP API, a fake clock, and waits
on the event loop that end when what they wait for holds, not after a fixed sleep."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Awaitable, Callable
from types import SimpleNamespace
from typing import Any

from omnistage.api.service import OutputStream, ReplicaStats, RequestCounts
from omnistage.control.replica_table import ReplicaEntry
from omnistage.dataplane.latency import LatencySnapshot
from omnistage.protocol.messages import PipelineRequest, RealtimeSnapshot

Opener = Callable[[PipelineRequest], Awaitable[OutputStream]]
NO_REQUESTS = RequestCounts(0, 0, 0)


class FakeService:
    """A ``PipelineService`` with no head behind it: pipeline ``p``, no replicas.

    ``stages`` are ``(stage_id, name)`` pairs; ``opener`` answers ``open`` (by default a
    request reaching the pipeline fails the test); ``latency`` makes each snapshot.
    """

    def __init__(
        self,
        stages: tuple[tuple[int, str], ...] = (),
        *,
        opener: Opener | None = None,
        counts: RequestCounts = NO_REQUESTS,
        latency: Callable[[], LatencySnapshot] = LatencySnapshot,
    ) -> None:
        specs = [SimpleNamespace(stage_id=sid, name=name) for sid, name in stages]
        self.config: Any = SimpleNamespace(pipeline="p", stages=specs)
        self.graph: Any = SimpleNamespace(finals_with=lambda _: [0], stages={0: None})
        self.served_model_names = ("p",)
        self.served_model = "p"
        self.model_names = frozenset(self.served_model_names)
        self.started_at = 0
        self._opener = opener
        self._counts = counts
        self._latency = latency

    async def open(self, request: PipelineRequest) -> OutputStream:
        if self._opener is None:
            rid = request.request_id
            raise AssertionError(f"request {rid} was not expected to reach the pipeline")
        return await self._opener(request)

    def stages_without_replicas(self) -> list[tuple[int, str]]:
        return []

    def stages_status(self) -> dict[str, Any]:
        return {"stages": []}

    def replica_entries(self) -> list[ReplicaEntry]:
        return []

    def replica_loads(self) -> list[ReplicaStats]:
        return []

    def stage_waiting(self) -> dict[int, int]:
        return {}

    def request_counts(self) -> RequestCounts:
        return self._counts

    def latency(self) -> LatencySnapshot:
        return self._latency()

    def response_counts(self, mine: Counter[int]) -> Counter[int]:
        return mine

    def realtime(self, mine: RealtimeSnapshot) -> RealtimeSnapshot:
        return mine


class FakeClock:
    """A ``time.monotonic`` stand-in that moves only when the test advances it."""

    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


async def ticks(n: int = 10) -> None:
    """Let the loop run ``n`` rounds of ready callbacks (nothing timed is waited for)."""
    for _ in range(n):
        await asyncio.sleep(0)


async def until(cond: Callable[[], object], timeout_s: float = 5.0, what: str = "") -> None:
    """Yield to the loop until ``cond()`` holds; fail the test after ``timeout_s``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not cond():
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for {what or cond}")
        await asyncio.sleep(0.001)


async def others_done(timeout_s: float = 5.0) -> None:
    """Until every other task on the loop has ended, then one more round (for the
    callbacks they scheduled, such as an output flush)."""
    others = asyncio.all_tasks() - {asyncio.current_task()}
    await asyncio.wait_for(asyncio.gather(*others, return_exceptions=True), timeout_s)
    await ticks(1)
