"""Moves each request through the stage DAG.

Per request: check every needed stage has a live replica (else 503 before anything
starts), dispatch the source stages, then handle output chunks as they arrive. Chunks
are handled synchronously in the output reader: each is forwarded at once to every
downstream stage (dispatching that stage on its first input, so stages pipeline), and
only final-stage chunks wake the request's consumer. However a request ends (done,
error, client gone), every stage still working on it is aborted and every replica slot
it held is released.

Nothing is lost with a replica: until a stage finishes a request, the head keeps the
stage's inputs and what it has delivered so far. When the replica fails, the stage's
part of the request is dispatched again (up to ``max_retries`` times) to another
replica, told what was already delivered (see ``Resume``); chunks carry sequence
numbers and any the head already has are dropped.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from omnistage.control.replica_table import ReplicaState, Transition
from omnistage.dataplane.channels import DataChannels
from omnistage.dataplane.graph import StageGraph
from omnistage.dataplane.stage_pool import ReplicaHandle, StagePool
from omnistage.protocol.errors import (
    BadRequestError,
    StageFailedError,
    StageOverloadedError,
    StageUnavailableError,
)
from omnistage.protocol.messages import (
    Abort,
    AddRequest,
    InputChunk,
    OutputChunk,
    Prompt,
    Resume,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StageOutput:
    stage_id: int
    modality: str
    text: str
    data: bytes
    finished: bool
    finish_reason: str | None
    usage: dict[str, int] | None
    meta: dict[str, Any] | None = None


class _Done:
    """Queued after the last output of a request."""


_DONE = _Done()


@dataclass
class _StageProgress:
    """One stage's part of a request, kept until the stage finishes it for a retry."""

    # Every input forwarded to the stage, replayed to a replacement replica.
    inputs: list[InputChunk] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    data_chunks: int = 0
    next_seq: int = 0
    retries: int = 0
    # A dispatch is waiting for a replica; inputs queue in ``inputs`` meanwhile.
    waiting: bool = False

    def resume(self) -> Resume | None:
        if not self.retries:
            return None
        return Resume(text="".join(self.text), data_chunks=self.data_chunks, seq=self.next_seq)


@dataclass
class _Run:
    request_id: str
    prompt: Prompt
    params: dict[int, dict[str, Any]]
    active: set[int]
    finals: set[int]
    queue: asyncio.Queue[StageOutput | BaseException | _Done] = field(default_factory=asyncio.Queue)
    assigned: dict[int, ReplicaHandle] = field(default_factory=dict)
    finished: set[int] = field(default_factory=set)
    usage: dict[int, dict[str, int]] = field(default_factory=dict)
    stages: dict[int, _StageProgress] = field(default_factory=dict)
    tasks: set[asyncio.Task[None]] = field(default_factory=set)
    failed: bool = False

    def fail(self, exc: BaseException) -> None:
        if not self.failed:
            self.failed = True
            self.queue.put_nowait(exc)

    def progress(self, sid: int) -> _StageProgress:
        st = self.stages.get(sid)
        if st is None:
            st = self.stages[sid] = _StageProgress()
        return st


class Orchestrator:
    def __init__(
        self,
        graph: StageGraph,
        pools: dict[int, StagePool],
        channels: DataChannels,
        no_replica_wait_s: float = 3.0,
        max_retries: int = 2,
    ) -> None:
        self.graph = graph
        self.pools = pools
        self.channels = channels
        self.no_replica_wait_s = no_replica_wait_s
        self.max_retries = max_retries
        self._runs: dict[str, _Run] = {}
        self.started_total = 0
        self.retried_total = 0

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
        only: bool = False,
    ) -> RequestStream:
        """Start a request and return its output stream.

        ``only``: run just the ``finals`` stages, each fed the prompt directly (e.g. the
        speech endpoint driving a TTS stage that normally listens to an LLM).
        """
        if request_id in self._runs:
            raise ValueError(f"duplicate request id {request_id}")
        active = set(finals) if only else self.graph.required_for(finals)
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
            # Sources of this run: stages none of whose inputs take part in it.
            for sid in sorted(active):
                if not active.intersection(self.graph.upstream(sid)):
                    await self._dispatch(run, sid)
        except BaseException:
            self._finish(run)
            raise
        return RequestStream(self, run)

    async def _outputs(self, run: _Run) -> AsyncIterator[StageOutput]:
        try:
            while True:
                item = await run.queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item is _DONE:
                    return
                assert isinstance(item, StageOutput)
                yield item
        finally:
            self._finish(run)

    def _params_for(
        self,
        sid: int,
        params: dict[str, Any] | None,
        stage_params: dict[int, dict[str, Any]] | None,
    ) -> dict[str, Any]:
        defaults = self.graph.stages[sid].default_sampling_params
        extra = stage_params.get(sid) if stage_params else None
        if not extra and not defaults:
            return params or {}
        return {**defaults, **(params or {}), **(extra or {})}

    # -- dispatch --------------------------------------------------------------------

    def _add_request(self, run: _Run, sid: int) -> AddRequest:
        upstream = [u for u in self.graph.upstream(sid) if u in run.active]
        return AddRequest(
            request_id=run.request_id,
            prompt=None if upstream else run.prompt,
            upstream=upstream,
            params=run.params[sid],
            resume=run.progress(sid).resume(),
        )

    def _try_dispatch(self, run: _Run, sid: int) -> bool:
        """Dispatch now if a replica has room; False if the caller must wait for one.

        The AddRequest and the stage's inputs so far leave with this tick's batch for
        the replica (one send for every request dispatched to it in the tick). A
        replica found gone when the batch is sent is marked ERROR at once, which sends
        the requests it held elsewhere.
        """
        handle = self.pools[sid].try_acquire(run.request_id)
        if handle is None:
            return False
        run.assigned[sid] = handle
        self.channels.post(handle.identity, self._add_request(run, sid))
        for msg in run.progress(sid).inputs:
            self.channels.post(handle.identity, msg)
        return True

    async def _dispatch(self, run: _Run, sid: int) -> None:
        deadline = time.monotonic() + self.no_replica_wait_s
        while not self._try_dispatch(run, sid):
            await self.pools[sid].wait_capacity(deadline, self.no_replica_wait_s)

    def _dispatch_soon(self, run: _Run, sid: int, failure: str | None = None) -> None:
        """Dispatch now, or in a task that waits (boundedly) for a replica."""
        if self._try_dispatch(run, sid):
            return
        st = run.progress(sid)
        st.waiting = True
        task = asyncio.get_running_loop().create_task(self._dispatch_later(run, sid, failure))
        run.tasks.add(task)
        task.add_done_callback(run.tasks.discard)

    async def _dispatch_later(self, run: _Run, sid: int, failure: str | None) -> None:
        try:
            await self._dispatch(run, sid)
        except (StageUnavailableError, StageOverloadedError) as exc:
            if failure is not None:  # a retry that found no replica in time
                exc = StageFailedError(sid, self._name(sid), f"{failure}; retry: {exc}")
            run.fail(exc)
            return
        finally:
            run.progress(sid).waiting = False

    # -- outputs (called synchronously from the output reader) ----------------------

    def on_outputs(self, chunks: list[OutputChunk]) -> None:
        for chunk in chunks:
            run = self._runs.get(chunk.request_id)
            if run is None or run.failed:
                continue  # late output of an aborted, failed or finished request
            handle = run.assigned.get(chunk.stage_id)
            if handle is None or (handle.replica_id, handle.epoch) != (
                chunk.replica_id,
                chunk.epoch,
            ):
                continue  # from a replica this request is no longer bound to
            self._on_chunk(run, chunk, handle)

    def _on_chunk(self, run: _Run, chunk: OutputChunk, handle: ReplicaHandle) -> None:
        sid = chunk.stage_id
        st = run.progress(sid)
        if chunk.seq < st.next_seq:
            return  # already delivered (a retry re-sent it)
        st.next_seq = chunk.seq + 1
        if chunk.text:
            st.text.append(chunk.text)
        if chunk.data:
            st.data_chunks += 1
        if chunk.error:
            if chunk.error_kind == "bad_request":
                run.fail(BadRequestError(chunk.error, chunk.error_param))
            else:
                run.fail(StageFailedError(sid, self._name(sid), chunk.error))
            return
        if chunk.usage:
            run.usage[sid] = chunk.usage
        for down in self.graph.downstream[sid]:
            if down in run.active:
                self._forward(run, down, chunk)
        if chunk.finished:
            run.finished.add(sid)
            del run.stages[sid]  # nothing left to retry: free what it kept
            self.pools[sid].release(handle, run.request_id)
        if sid in run.finals:
            run.queue.put_nowait(
                StageOutput(
                    stage_id=sid,
                    modality=chunk.modality,
                    text=chunk.text,
                    data=chunk.data,
                    finished=chunk.finished,
                    finish_reason=chunk.finish_reason,
                    usage=chunk.usage,
                    meta=chunk.meta,
                )
            )
        if chunk.finished and run.active <= run.finished:
            run.queue.put_nowait(_DONE)

    def _forward(self, run: _Run, down: int, chunk: OutputChunk) -> None:
        msg = InputChunk(
            request_id=run.request_id,
            source_stage=chunk.stage_id,
            seq=chunk.seq,
            modality=chunk.modality,
            text=chunk.text,
            data=chunk.data,
            finished=chunk.finished,
            meta=chunk.meta,
        )
        st = run.progress(down)
        st.inputs.append(msg)
        handle = run.assigned.get(down)
        if handle is not None:
            self.channels.post(handle.identity, msg)
        elif not st.waiting:  # the stage's first input: dispatch it
            self._dispatch_soon(run, down)

    # -- the end of a request --------------------------------------------------------

    def _finish(self, run: _Run) -> None:
        """Abort unfinished stages and release replica slots; safe to call twice."""
        if self._runs.pop(run.request_id, None) is None:
            return
        for task in list(run.tasks):
            task.cancel()
        for sid, handle in run.assigned.items():
            if sid in run.finished:
                continue
            if handle.up:
                self.channels.post(handle.identity, Abort(run.request_id))
            self.pools[sid].release(handle, run.request_id)

    # -- replica state changes -------------------------------------------------------

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
        sid = t.entry.stage_id
        for request_id in lost:
            # A silent replica may come back: it must not keep working on these.
            if t.new == ReplicaState.ERROR:
                self.channels.post(t.entry.identity, Abort(request_id))
            run = self._runs.get(request_id)
            if run is not None and not run.failed:
                self._retry(run, sid, reason)

    def _retry(self, run: _Run, sid: int, reason: str) -> None:
        """Send the stage's part of ``run`` to another replica, or fail the request."""
        run.assigned.pop(sid, None)
        st = run.progress(sid)
        if st.retries >= self.max_retries:
            detail = f"{reason}; gave up after {st.retries} retries (--omni-max-retries)"
            run.fail(StageFailedError(sid, self._name(sid), detail))
            return
        st.retries += 1
        self.retried_total += 1
        log.info(
            "request %s: stage %d (%s) %s; retry %d of %d",
            run.request_id,
            sid,
            self._name(sid),
            reason,
            st.retries,
            self.max_retries,
        )
        self._dispatch_soon(run, sid, failure=reason)

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
            u.get("prompt_tokens", 0)
            for sid, u in run.usage.items()
            if not run.active.intersection(graph.upstream(sid))
        )
        completion = sum(
            u.get("completion_tokens", 0) for sid, u in run.usage.items() if sid in run.finals
        )
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }
