"""What the API needs from the head, as typed protocols: the routes are written against
these and nothing else. ``head.service.HeadService`` implements them in the head;
``api.remote.RemoteService`` in an API server process (``--api-server-count``)."""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator, Coroutine
from typing import Any, Protocol

from omnistage.config.schema import DeployConfig
from omnistage.control.replica_table import ReplicaEntry
from omnistage.dataplane.graph import StageGraph
from omnistage.dataplane.latency import LatencySnapshot
from omnistage.protocol.front import PipelineRequest, RealtimeSnapshot, ReplicaStats, RequestCounts
from omnistage.protocol.messages import OutputChunk, Usage

__all__ = ["ReplicaStats", "RequestCounts"]  # what the routes read, with the protocol


class OutputStream(Protocol):
    """The outputs of one request (``Orchestrator.RequestStream`` or its remote twin)."""

    request_id: str

    def __aiter__(self) -> AsyncIterator[OutputChunk]: ...

    def feed(self, data: bytes, last: bool = False) -> None:
        """Append to the request's streamed input (``PipelineRequest.input_streaming``);
        ``last=True`` ends it (``data`` may be empty). Does not block. ValueError for a
        request opened without ``input_streaming``; ignored after the last piece or
        ``close``."""
        ...

    def close(self) -> None:
        """Abort what is unfinished; safe to call twice."""
        ...

    def usage(self) -> Usage: ...


class PipelineService(Protocol):
    config: DeployConfig
    graph: StageGraph
    # --served-model-name, else the pipeline name: what /v1/models lists, in order, and
    # requests may name; ``served_model`` (the first) is the ``model`` of responses.
    served_model_names: tuple[str, ...]
    served_model: str
    model_names: frozenset[str]
    started_at: int  # unix seconds

    def open(self, request: PipelineRequest) -> Coroutine[Any, Any, OutputStream]:
        """Start a request through the pipeline (see ``PipelineRequest``)."""
        ...

    def stages_without_replicas(self) -> list[tuple[int, str]]: ...

    def stages_status(self) -> dict[str, Any]:
        """The body of ``GET /v1/omni/stages``."""
        ...

    def replica_entries(self) -> list[ReplicaEntry]:
        """The coordinator's table, copied."""
        ...

    def replica_loads(self) -> list[ReplicaStats]:
        """Every replica the pools know, by stage and replica id."""
        ...

    def stage_waiting(self) -> dict[int, int]:
        """Per stage, requests waiting for a free replica slot."""
        ...

    def request_counts(self) -> RequestCounts: ...

    def latency(self) -> LatencySnapshot:
        """The orchestrator's latency histograms and output counters, copied."""
        ...

    def response_counts(self, mine: Counter[int]) -> Counter[int]:
        """HTTP responses by status, of every API server, given this one's own."""
        ...

    def realtime(self, mine: RealtimeSnapshot) -> RealtimeSnapshot:
        """Live voice sessions of every API server, given this one's own."""
        ...
