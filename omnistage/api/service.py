"""What the API needs from the head, as a typed protocol: the routes are written against
this and nothing else (``head.service.HeadService`` implements it)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from omnistage.config.schema import DeployConfig
from omnistage.control.replica_table import ReplicaEntry
from omnistage.dataplane.graph import StageGraph
from omnistage.dataplane.orchestrator import RequestStream
from omnistage.dataplane.stage_pool import StagePool
from omnistage.protocol.messages import Prompt


@dataclass(frozen=True)
class RequestCounts:
    started_total: int
    in_flight: int
    retried_total: int
    direct_edges_total: int = 0
    forwarded_chunks_total: int = 0


class PipelineService(Protocol):
    config: DeployConfig
    graph: StageGraph
    model_names: frozenset[str]
    started_at: int  # unix seconds

    async def open(
        self,
        request_id: str,
        prompt: Prompt,
        finals: list[int],
        params: dict[str, Any] | None = None,
        stage_params: dict[int, dict[str, Any]] | None = None,
        only: bool = False,
    ) -> RequestStream:
        """Start a request through the pipeline (see ``Orchestrator.open``)."""
        ...

    def stages_without_replicas(self) -> list[tuple[int, str]]: ...

    def stages_status(self) -> dict[str, Any]:
        """The body of ``GET /v1/omni/stages``."""
        ...

    def replica_entries(self) -> list[ReplicaEntry]:
        """The coordinator's table, copied."""
        ...

    def pools(self) -> Mapping[int, StagePool]:
        """Per stage, the live replicas and their load (read on the loop only)."""
        ...

    def request_counts(self) -> RequestCounts: ...
