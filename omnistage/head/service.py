"""The head as the API sees it: ``service.PipelineService`` over the orchestrator,
the pools and the coordinator."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Coroutine
from typing import Any

from omnistage.control.coordinator import Coordinator
from omnistage.control.replica_table import ReplicaEntry
from omnistage.dataplane.latency import LatencySnapshot
from omnistage.dataplane.orchestrator import Orchestrator, RequestStream
from omnistage.dataplane.stage_pool import StagePool
from omnistage.head import status
from omnistage.head.history import History
from omnistage.head.options import HeadOptions
from omnistage.protocol.front import PipelineRequest, RealtimeSnapshot
from omnistage.service import ReplicaStats, RequestCounts


class HeadService:
    def __init__(
        self,
        opts: HeadOptions,
        orchestrator: Orchestrator,
        coordinator: Coordinator,
        *,
        master_url: str,
        history: History | None = None,
        scaling: Callable[[], dict[int, dict[str, Any]]] | None = None,
        nodes: Callable[[], dict[tuple[int, int], str]] | None = None,
        heads: Callable[[], list[dict[str, object]]] | None = None,
    ) -> None:
        """``heads``: the fleet's heads (``HeadFleet.snapshot``), this one first."""
        self._heads = heads
        self._opts = opts
        self.config = opts.config
        self.graph = orchestrator.graph
        self.served_model_names = opts.model_names
        self.served_model = opts.model_names[0]
        self.model_names = frozenset(opts.model_names)
        self.started_at = int(time.time())
        self._orchestrator = orchestrator
        self._pools: dict[int, StagePool] = orchestrator.pools
        self._coordinator = coordinator
        # Where replicas register, as /v1/omni/stages reports it.
        self._master_url = master_url
        # State changes and local restarts, for the views of the running system.
        self.history = history or History({s.stage_id: s.name for s in opts.config.stages})
        # Per autoscaling stage, the scaler's view (``head.scaler.Scaler.status``).
        self._scaling = scaling
        # (stage, replica) -> the node a backend placed it on (Ray); empty for processes.
        self._nodes = nodes or dict

    def open(self, request: PipelineRequest) -> Coroutine[Any, Any, RequestStream]:
        # Not async itself: the orchestrator's coroutine is returned as is, one frame
        # fewer per request.
        return self._orchestrator.open(request)

    def stages_without_replicas(self) -> list[tuple[int, str]]:
        return [(sid, p.name) for sid, p in self._pools.items() if not p.has_live()]

    def stages_status(self) -> dict[str, Any]:
        return status.stages_status(
            self.config,
            self._pools,
            self._coordinator.snapshot(),
            {
                "master_address": self._master_url,
                "lb_policy": self._opts.lb_policy,
                "heartbeat_timeout_s": self._opts.heartbeat_timeout_s,
                # The fleet's heads (--omni-join), this one first; [] when alone.
                "heads": self._fleet_heads(),
            },
            history=self.history,
            scaling=self._scaling() if self._scaling is not None else None,
            nodes=self._nodes(),
        )

    def _fleet_heads(self) -> list[dict[str, object]]:
        rows = self._heads() if self._heads is not None else []
        return rows if len(rows) > 1 else []

    def replica_entries(self) -> list[ReplicaEntry]:
        return self._coordinator.snapshot()

    def replica_loads(self) -> list[ReplicaStats]:
        nodes = self._nodes()
        return [
            ReplicaStats(
                h.stage_id,
                h.replica_id,
                h.up,
                h.in_flight,
                h.capacity,
                h.queue_length,
                h.dispatched_total,
                nodes.get((h.stage_id, h.replica_id)),
                h.prompt_tokens_total,
                h.cached_tokens_total,
            )
            for sid, pool in sorted(self._pools.items())
            for _, h in sorted(pool.replicas.items())
        ]

    def stage_waiting(self) -> dict[int, int]:
        return {sid: pool.waiting for sid, pool in sorted(self._pools.items())}

    def response_counts(self, mine: Counter[int]) -> Counter[int]:
        return mine

    def realtime(self, mine: RealtimeSnapshot) -> RealtimeSnapshot:
        return mine

    def latency(self) -> LatencySnapshot:
        return self._orchestrator.latency.snapshot()

    def request_counts(self) -> RequestCounts:
        o = self._orchestrator
        return RequestCounts(
            o.started_total,
            o.in_flight,
            o.retried_total,
            o.direct_edges_total,
            o.forwarded_chunks_total,
            o.busy_total,
            o.forwarded_tensor_chunks_total,
            o.forwarded_tensor_bytes_total,
            o.redirects_total,
        )
