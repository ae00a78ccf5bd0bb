"""A stand-in for the head, shared by the unit tests of the HTTP API."""

from __future__ import annotations

from collections import Counter
from collections.abc import Awaitable, Callable
from types import SimpleNamespace
from typing import Any

from omnistage.api.service import OutputStream, ReplicaLoad, RequestCounts
from omnistage.control.replica_table import ReplicaEntry
from omnistage.dataplane.latency import LatencySnapshot
from omnistage.protocol.messages import Prompt

Opener = Callable[..., Awaitable[OutputStream]]
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

    async def open(
        self,
        request_id: str,
        prompt: Prompt,
        finals: list[int],
        params: dict[str, Any] | None = None,
        stage_params: dict[int, dict[str, Any]] | None = None,
        only: bool = False,
        ack: bool = False,
    ) -> OutputStream:
        if self._opener is None:
            raise AssertionError(f"request {request_id} was not expected to reach the pipeline")
        return await self._opener(
            request_id, prompt, finals, params, stage_params, only=only, ack=ack
        )

    def stages_without_replicas(self) -> list[tuple[int, str]]:
        return []

    def stages_status(self) -> dict[str, Any]:
        return {"stages": []}

    def replica_entries(self) -> list[ReplicaEntry]:
        return []

    def replica_loads(self) -> list[ReplicaLoad]:
        return []

    def stage_waiting(self) -> dict[int, int]:
        return {}

    def request_counts(self) -> RequestCounts:
        return self._counts

    def latency(self) -> LatencySnapshot:
        return self._latency()

    def response_counts(self, mine: Counter[int]) -> Counter[int]:
        return mine
