"""Moves each request through the stage DAG.

Per request: dispatch the source stages; as chunks arrive, hand each to the client if
its stage is final, and forward it to every downstream stage (dispatching that stage on
its first input, so stages pipeline instead of waiting for whole outputs). Whatever way
the request ends (done, error, client gone), every stage still working on it is aborted
and every replica slot it held is released.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from omnistage.control.replica_table import ReplicaState, Transition
from omnistage.dataplane.channels import DataChannels, ReplicaUnreachableError
from omnistage.dataplane.graph import StageGraph
from omnistage.dataplane.stage_pool import ReplicaHandle, StagePool
from omnistage.protocol.errors import StageFailedError, StageUnavailableError
from omnistage.protocol.messages import Abort, AddRequest, InputChunk, OutputChunk, Prompt

log = logging.getLogger(__name__)

# How many replicas a dispatch tries when sends fail because replicas vanished.
_DISPATCH_ATTEMPTS = 3


@dataclass(frozen=True)
class StageOutput:
    stage_id: int
    modality: str
    text: str
    data: bytes
    finished: bool
    finish_reason: str | None
    usage: dict[str, int] | None


@dataclass(frozen=True)
class _Lost:
    stage_id: int
    reason: str


@dataclass
class _Run:
    request_id: str
    prompt: Prompt
    params: dict[int, dict[str, Any]]
    active: set[int]
    finals: set[int]
    queue: asyncio.Queue[OutputChunk | _Lost] = field(default_factory=asyncio.Queue)
    assigned: dict[int, ReplicaHandle] = field(default_factory=dict)
    finished: set[int] = field(default_factory=set)
    usage: dict[int, dict[str, int]] = field(default_factory=dict)


class Orchestrator:
    def __init__(
        self,
        graph: StageGraph,
        pools: dict[int, StagePool],
        channels: DataChannels,
        on_unreachable: Callable[[ReplicaHandle], None],
        no_replica_wait_s: float = 3.0,
    ) -> None:
        self.graph = graph
        self.pools = pools
        self.channels = channels
        self._on_unreachable = on_unreachable
        self.no_replica_wait_s = no_replica_wait_s
        self._runs: dict[str, _Run] = {}
        self.started_total = 0

    @property
    def in_flight(self) -> int:
        return len(self._runs)

    async def open(
        self,
        request_id: str,
        prompt: Prompt,
        finals: list[int],
        params: dict[str, Any] | None = None,
        stage_params: dict[int, dict[str, Any]] | None = None,
    ) -> RequestStream:
        """Start a request: dispatch its source stages now, so a stage without live
        replicas fails here (before any response is sent), then stream its outputs."""
        if request_id in self._runs:
            raise ValueError(f"duplicate request id {request_id}")
        active = self.graph.required_for(finals)
        run = _Run(
            request_id=request_id,
            prompt=prompt,
            params={sid: self._params_for(sid, params, stage_params) for sid in active},
            active=active,
            finals=set(finals),
        )
        self._runs[request_id] = run
        self.started_total += 1
        try:
            # Every stage the request needs must be servable before anything starts, so
            # a missing downstream stage is a 503 up front, not an error mid-stream.
            deadline = time.monotonic() + self.no_replica_wait_s
            for sid in sorted(active):
                await self.pools[sid].wait_live(deadline, self.no_replica_wait_s)
            for sid in sorted(active):
                if not self.graph.upstream(sid):
                    await self._dispatch(run, sid)
        except BaseException:
            self._finish(run)
            raise
        return RequestStream(self, run)

    async def _outputs(self, run: _Run) -> AsyncIterator[StageOutput]:
        try:
            while not run.active <= run.finished:
                item = await run.queue.get()
                if isinstance(item, _Lost):
                    raise StageFailedError(item.stage_id, self._name(item.stage_id), item.reason)
                out = await self._handle_chunk(run, item)
                if out is not None:
                    yield out
        finally:
            self._finish(run)

    def _params_for(
        self,
        sid: int,
        params: dict[str, Any] | None,
        stage_params: dict[int, dict[str, Any]] | None,
    ) -> dict[str, Any]:
        merged = dict(self.graph.stages[sid].default_sampling_params)
        merged.update(params or {})
        merged.update((stage_params or {}).get(sid, {}))
        return merged

    async def _handle_chunk(self, run: _Run, chunk: OutputChunk) -> StageOutput | None:
        sid = chunk.stage_id
        if chunk.error:
            raise StageFailedError(sid, self._name(sid), chunk.error)
        for down in self.graph.downstream[sid]:
            if down not in run.active:
                continue
            if down not in run.assigned:
                await self._dispatch(run, down)
            self._send(
                run,
                down,
                InputChunk(
                    request_id=run.request_id,
                    source_stage=sid,
                    seq=chunk.seq,
                    modality=chunk.modality,
                    text=chunk.text,
                    data=chunk.data,
                    finished=chunk.finished,
                ),
            )
        if chunk.usage:
            run.usage[sid] = chunk.usage
        if chunk.finished:
            run.finished.add(sid)
            self.pools[sid].release(run.assigned[sid], run.request_id)
        if sid not in run.finals:
            return None
        return StageOutput(
            stage_id=sid,
            modality=chunk.modality,
            text=chunk.text,
            data=chunk.data,
            finished=chunk.finished,
            finish_reason=chunk.finish_reason,
            usage=chunk.usage,
        )

    async def _dispatch(self, run: _Run, sid: int) -> None:
        pool = self.pools[sid]
        upstream = [u for u in self.graph.upstream(sid) if u in run.active]
        msg = AddRequest(
            request_id=run.request_id,
            prompt=None if upstream else run.prompt,
            upstream=upstream,
            params=run.params[sid],
        )
        for _ in range(_DISPATCH_ATTEMPTS):
            handle = await pool.acquire(run.request_id, self.no_replica_wait_s)
            try:
                self.channels.send(handle.identity, msg)
            except ReplicaUnreachableError:
                pool.release(handle, run.request_id)
                self._on_unreachable(handle)
                continue
            run.assigned[sid] = handle
            return
        raise StageUnavailableError(sid, self._name(sid), self.no_replica_wait_s)

    def _send(self, run: _Run, sid: int, msg: InputChunk) -> None:
        handle = run.assigned[sid]
        try:
            self.channels.send(handle.identity, msg)
        except ReplicaUnreachableError:
            self._on_unreachable(handle)
            raise StageFailedError(
                sid, self._name(sid), f"replica {handle.replica_id} became unreachable"
            ) from None

    def _finish(self, run: _Run) -> None:
        """Abort unfinished stages and release replica slots; safe to call twice."""
        if self._runs.pop(run.request_id, None) is None:
            return
        for sid, handle in run.assigned.items():
            if sid in run.finished:
                continue
            if handle.up:
                try:
                    self.channels.send(handle.identity, Abort(run.request_id))
                except ReplicaUnreachableError:
                    pass
            self.pools[sid].release(handle, run.request_id)

    # -- events from the data plane and the coordinator ------------------------------

    def on_output(self, chunk: OutputChunk) -> None:
        run = self._runs.get(chunk.request_id)
        if run is None:
            return  # late output of an aborted or finished request
        handle = run.assigned.get(chunk.stage_id)
        if handle is None or handle.replica_id != chunk.replica_id or handle.epoch != chunk.epoch:
            return  # from a replica this request is no longer bound to
        run.queue.put_nowait(chunk)

    def on_transition(self, t: Transition) -> None:
        pool = self.pools.get(t.entry.stage_id)
        if pool is None:
            return
        lost = pool.apply(t)
        if not lost:
            return
        reason = f"replica {t.entry.replica_id} went {t.new}: {t.reason}"
        if t.new == ReplicaState.DOWN:
            reason = f"replica {t.entry.replica_id} shut down"
        for request_id in lost:
            run = self._runs.get(request_id)
            if run is not None:
                run.queue.put_nowait(_Lost(t.entry.stage_id, reason))

    def _name(self, sid: int) -> str:
        return self.graph.stages[sid].name


class RequestStream:
    """The outputs of one request. Iterate once; ``close`` aborts what is unfinished."""

    def __init__(self, orchestrator: Orchestrator, run: _Run) -> None:
        self._orchestrator = orchestrator
        self._run = run
        self.request_id = run.request_id

    def __aiter__(self) -> AsyncIterator[StageOutput]:
        return self._orchestrator._outputs(self._run)

    def close(self) -> None:
        self._orchestrator._finish(self._run)

    def usage(self) -> dict[str, int]:
        """Prompt tokens read by the source stages; completion tokens of the finals."""
        graph = self._orchestrator.graph
        run = self._run
        prompt = sum(
            u.get("prompt_tokens", 0) for sid, u in run.usage.items() if not graph.upstream(sid)
        )
        completion = sum(
            u.get("completion_tokens", 0) for sid, u in run.usage.items() if sid in run.finals
        )
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }
