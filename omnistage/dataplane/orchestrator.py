"""Moves each request through the stage DAG.

Per request: check every needed stage has a live replica, or wait for one coming back
(else 503 before anything starts: see ``comebacks``), bind a replica of every stage the
request needs (waiting, boundedly, for capacity: 429 when there is none), and send each
its AddRequest in one tick. Outputs
of a stage that is not final for the request go straight to the downstream replicas
(the connector seam: ``AddRequest.peers``) where they can; the head then sees only the
last chunk of such a stage, to free its slot. Other edges go through the head, which
forwards each chunk synchronously in the output reader. Only final-stage chunks wake the
request's consumer. However a request ends (done, error, client gone), every stage
still working on it is aborted and every replica slot it held is released.

Nothing is lost with a replica: when one fails, the stages joined to it by direct edges
(``run.restart_group``) are dispatched again, as a new attempt, to other replicas, up to
``max_retries`` times per failed stage (see ``failover``). The head keeps what it needs
for that: the inputs it forwarded, and what each final stage delivered (see ``Resume``),
so nothing reaches the client twice. Stages whose outputs the head never saw run again
from their start, which repeats their output exactly only for deterministic engines.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

from omnistage import defaults
from omnistage.control.replica_table import Transition
from omnistage.dataplane.channels import DataChannels
from omnistage.dataplane.comebacks import WaitBounds
from omnistage.dataplane.dispatch import Dispatcher
from omnistage.dataplane.failover import Failover
from omnistage.dataplane.graph import StageGraph
from omnistage.dataplane.latency import LatencyRecorder
from omnistage.dataplane.run import DONE, Run
from omnistage.dataplane.stage_pool import ReplicaHandle, StagePool
from omnistage.dataplane.streamed import StreamedInput
from omnistage.protocol.enums import ErrorKind, Outcome, ReplicaState
from omnistage.protocol.errors import (
    BadRequestError,
    StageFailedError,
)
from omnistage.protocol.front import PipelineRequest
from omnistage.protocol.messages import Abort, OutputChunk, Usage, is_tensor
from omnistage.tracing import RequestTraces, request_traces

log = logging.getLogger(__name__)

# Members this hot path compares against, bound once (see protocol/enums.py).
_OK = Outcome.OK
_NOT_KEPT = ErrorKind.NOT_KEPT


class Orchestrator:
    def __init__(
        self,
        graph: StageGraph,
        pools: dict[int, StagePool],
        channels: DataChannels,
        no_replica_wait_s: float = defaults.STAGE_WAIT_TIMEOUT_S,
        max_retries: int = defaults.MAX_RETRIES,
        latency: LatencyRecorder | None = None,
        traces: RequestTraces | None = None,
        restart_wait_s: float = defaults.RESTART_WAIT_TIMEOUT_S,
    ) -> None:
        """``no_replica_wait_s``: how long a request waits for a stage with no live
        replica and none coming, or for a free slot; ``restart_wait_s``: for a replica
        that is coming back (see ``dataplane.comebacks``)."""
        self.graph = graph
        self.pools = pools
        self.channels = channels
        self._runs: dict[str, Run] = {}
        self.started_total = 0
        self.forwarded_chunks_total = 0  # chunks the head passed on between stages
        # Of those, tensor chunks and their bytes (none where tensor edges are direct).
        self.forwarded_tensor_chunks_total = 0
        self.forwarded_tensor_bytes_total = 0
        names = {s: st.name for s, st in graph.stages.items()}
        # The observers, shared with the dispatcher (it times and traces dispatches).
        self.latency = latency or LatencyRecorder(names)
        # Spans of requests and stage dispatches; does nothing unless tracing is on.
        self.traces = traces or request_traces(graph.config.pipeline, names)
        self.dispatcher = Dispatcher(
            graph,
            pools,
            channels,
            self.latency,
            self.traces,
            WaitBounds(no_replica_wait_s, restart_wait_s),
        )
        self.failover = Failover(self.dispatcher, max_retries)

    @property
    def in_flight(self) -> int:
        return len(self._runs)

    @property
    def retried_total(self) -> int:
        return self.failover.retried_total

    @property
    def busy_total(self) -> int:
        """Dispatches a replica refused as full (several heads)."""
        return self.failover.busy_total

    @property
    def direct_edges_total(self) -> int:
        """Stage-to-stage edges of dispatched requests whose chunks went replica to
        replica (the rest: ``forwarded_chunks_total``)."""
        return self.dispatcher.direct_edges_total

    @property
    def redirects_total(self) -> int:
        """Replaced downstream replicas fed again by the final stage before them."""
        return self.dispatcher.redirects_total

    async def open(self, request: PipelineRequest) -> RequestStream:
        """Start a request (see ``PipelineRequest``) and return its output stream."""
        rid, finals = request.request_id, request.finals
        if rid in self._runs:
            raise ValueError(f"duplicate request id {rid}")
        if request.only:
            active = set(finals)
        else:
            active = self.graph.required_for(finals, request.prompt.modalities())
        run = Run(
            request_id=rid,
            prompt=request.prompt,
            params={sid: self.graph.params_for(sid, request) for sid in active},
            active=active,
            finals=set(finals),
            ack=request.ack,
            affinity=request.affinity,
            streamed=StreamedInput(rid) if request.input_streaming else None,
        )
        if self.dispatcher.cache_aware:
            run.prefix = self.dispatcher.prefix_of(run)
        self._runs[rid] = run
        self.started_total += 1
        self.latency.opened(run)
        self.traces.opened(run)
        try:
            if self.dispatcher.lacking_live(active):
                await self.dispatcher.wait_live(active)
            await self.dispatcher.dispatch(run, active)
        except BaseException:
            self._finish(run, Outcome.REJECTED)
            raise
        return RequestStream(self, run)

    async def _outputs(self, run: Run) -> AsyncIterator[OutputChunk]:
        try:
            while True:
                item = await run.queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item is DONE:
                    return
                assert isinstance(item, OutputChunk)
                yield item
        finally:
            self._finish(run)

    def _feed(self, run: Run, data: bytes, last: bool) -> None:
        """The next piece of ``run``'s streamed input: kept for a retry, and sent to every
        stage reading it that is dispatched now (one waiting for a replica gets it all when
        dispatched, see ``Dispatcher.send_group``)."""
        if run.streamed is None:
            raise ValueError(f"request {run.request_id} was not opened with input_streaming")
        if run.request_id not in self._runs:
            return  # closed: nobody reads it any more
        seq = run.streamed.append(data, last)
        if seq is None:
            return  # after the last piece
        for sid in run.readers:
            handle = run.assigned.get(sid)
            st = run.progress(sid)
            if handle is not None and not st.waiting and sid not in run.finished:
                self.channels.post(handle.identity, run.streamed.chunk(seq, st.attempt))

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

    def _on_chunk(self, run: Run, chunk: OutputChunk, handle: ReplicaHandle) -> None:
        sid = chunk.stage_id
        st = run.progress(sid)
        if chunk.attempt != st.attempt or chunk.seq < st.next_seq:
            # An earlier attempt's, or already delivered (a retry re-sent it); or a
            # keeper's answer to a Redirect (stamped with the run's attempt, not its own).
            if chunk.error_kind == _NOT_KEPT and chunk.attempt == run.attempt:
                self.failover.refeed(run, sid, chunk.error or "nothing kept")
            return
        st.next_seq = chunk.seq + 1
        if chunk.text:
            st.text.append(chunk.text)
        if chunk.data:
            st.data_chunks += 1
        if chunk.error:
            if chunk.error_kind == ErrorKind.BUSY:
                self.pools[sid].busy(handle)
                self.failover.retry(run, sid, "replica full with other heads' requests", busy=True)
            elif chunk.error_kind == ErrorKind.BAD_REQUEST:
                run.fail(BadRequestError(chunk.error, chunk.error_param, chunk.error_code))
            else:
                run.fail(StageFailedError(sid, self._name(sid), chunk.error))
            return
        if chunk.usage is not None:
            run.usage[sid] = chunk.usage
            st.tokens = chunk.usage.completion_tokens
        self.latency.output(run, sid, st, chunk)
        for down in self.graph.downstream[sid]:
            if down in run.active and (sid, down) not in run.direct:
                self._forward(run, down, chunk)
        if chunk.finished:
            run.finished.add(sid)
            self.traces.stage_ended(run, sid, _OK)
            usage = run.usage.get(sid)
            if usage is not None:  # per replica: how much of what it read its prefix cache had
                handle.prompt_tokens_total += usage.prompt_tokens
                handle.cached_tokens_total += usage.cached_tokens or 0
            if not any(up == sid for up, _ in run.direct):
                st.inputs.clear()  # nothing can make it run again: free what it kept
            self.pools[sid].release(handle, run.request_id)
        if sid in run.finals:
            if sid not in run.delivered:
                run.queue.put_nowait(chunk)
            if chunk.finished:
                run.delivered.add(sid)
        if chunk.finished and run.active <= run.finished:
            self.latency.done(run)
            run.queue.put_nowait(DONE)

    def _forward(self, run: Run, down: int, chunk: OutputChunk) -> None:
        st = run.progress(down)
        st.inputs.append(chunk)
        handle = run.assigned.get(down)
        if handle is not None and not st.waiting:
            chunk.attempt = st.attempt  # encoded at once: the stamp is this receiver's
            self.channels.post(handle.identity, chunk)
            self.forwarded_chunks_total += 1
            if is_tensor(chunk):
                self.forwarded_tensor_chunks_total += 1
                self.forwarded_tensor_bytes_total += len(chunk.data)

    # -- the end of a request --------------------------------------------------------

    def _finish(self, run: Run, outcome: Outcome = Outcome.DERIVE) -> None:
        """Abort unfinished stages and release replica slots; safe to call twice.
        ``outcome`` is for the request's trace."""
        if self._runs.pop(run.request_id, None) is None:
            return
        self.traces.ended(run, outcome)
        if run.streamed is not None:
            run.streamed.pieces.clear()  # the held input: no retry can need it now
            run.streamed.ended = True
        for task in list(run.tasks):
            task.cancel()
        for sid, handle in run.assigned.items():
            finished = sid in run.finished
            if finished and sid not in run.keepers:
                continue
            if handle.up:  # a keeper that finished drops what it kept
                self.channels.post(handle.identity, Abort(run.request_id))
            if not finished:
                self.pools[sid].release(handle, run.request_id)

    # -- replica state changes -------------------------------------------------------

    def on_transition(self, t: Transition) -> None:
        pool = self.pools.get(t.entry.stage_id)
        if pool is None:
            return
        lost = pool.apply(t)
        if not lost:
            return
        reason = f"replica {t.entry.replica_id} went {t.new}: {t.why}"
        if t.new == ReplicaState.DOWN:
            reason = f"replica {t.entry.replica_id} shut down"
        sid = t.entry.stage_id
        for request_id in lost:
            # A silent replica may come back: it must not keep working on these.
            if t.new == ReplicaState.ERROR:
                self.channels.post(t.entry.identity, Abort(request_id))
            run = self._runs.get(request_id)
            if run is not None and not run.failed:
                self.failover.retry(run, sid, reason)

    def _name(self, sid: int) -> str:
        return self.graph.stages[sid].name


class RequestStream:
    """The outputs of one request. Iterate once; ``close`` aborts what is unfinished."""

    def __init__(self, orchestrator: Orchestrator, run: Run) -> None:
        self._orchestrator = orchestrator
        self._run = run
        self.request_id = run.request_id

    def __aiter__(self) -> AsyncIterator[OutputChunk]:
        return self._orchestrator._outputs(self._run)

    def feed(self, data: bytes, last: bool = False) -> None:
        """Append to the request's streamed input; ``last`` ends it. ValueError when the
        request was not opened with ``input_streaming``; ignored after the last piece or
        ``close``."""
        self._orchestrator._feed(self._run, data, last)

    def close(self) -> None:
        self._orchestrator._finish(self._run)

    def usage(self) -> Usage:
        """Prompt tokens read by the stages given the client's prompt; completion tokens
        of the finals."""
        graph = self._orchestrator.graph
        run = self._run
        reading = [
            u
            for sid, u in run.usage.items()
            if graph.prompt_for(sid, bool(run.active.intersection(graph.upstream(sid))))
        ]
        prompt = sum(u.prompt_tokens for u in reading)
        completion = sum(u.completion_tokens for sid, u in run.usage.items() if sid in run.finals)
        cached = [u.cached_tokens for u in reading if u.cached_tokens is not None]
        # Of the prompt tokens, those an engine's prefix cache had; None when no stage
        # that read the prompt keeps a prefix cache.
        return Usage(prompt, completion, sum(cached) if cached else None)
