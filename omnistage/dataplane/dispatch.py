"""Binding a request's stages to replicas and sending them their work.

A group of stages is bound all or none at a time (a request waiting for capacity holds
no slot), then each stage gets its AddRequest and the inputs the head holds for it, in
one tick. Direct edges (replica to replica, the connector seam) are chosen per dispatch;
a keeper (``Run.keepers``) outside the group that fed a replaced stage is pointed at the
new replica (Redirect) and sends it again what it kept.
"""

from __future__ import annotations

import logging
import time

from omnistage.connectors.registry import choose
from omnistage.control.balancing.prefix_index import RequestPrefix
from omnistage.dataplane.channels import DataChannels
from omnistage.dataplane.comebacks import WaitBounds
from omnistage.dataplane.graph import StageGraph
from omnistage.dataplane.latency import LatencyRecorder
from omnistage.dataplane.run import Feeds, Run, direct_edge
from omnistage.dataplane.stage_pool import ReplicaHandle, StagePool
from omnistage.logs import Throttled
from omnistage.protocol.enums import Modality
from omnistage.protocol.errors import StageFailedError
from omnistage.protocol.messages import AddRequest, PeerConnector, Redirect
from omnistage.tracing import RequestTraces

log = logging.getLogger(__name__)
_fallback = Throttled(log)


class Dispatcher:
    def __init__(
        self,
        graph: StageGraph,
        pools: dict[int, StagePool],
        channels: DataChannels,
        latency: LatencyRecorder,
        traces: RequestTraces,
        bounds: WaitBounds,
    ) -> None:
        self.graph = graph
        self.pools = pools
        self.channels = channels
        self.latency = latency
        self.traces = traces
        # How long a request waits for a stage's replica (or a free slot on one).
        self.bounds = bounds
        # Stage ids in an order where every stage comes after its inputs.
        self.order = graph.topological()
        # Stage-to-stage edges of dispatched requests whose chunks went replica to replica.
        self.direct_edges_total = 0
        # Replaced downstream replicas fed again by a keeper (Redirect).
        self.redirects_total = 0
        # Stages whose pool routes by prefix cache: only their requests need prefix keys.
        self.cache_aware = frozenset(s for s, p in pools.items() if p.prefixes is not None)
        # Each edge's configured connector (edges not named: zmq).
        self.edge_connectors = graph.config.connectors()

    def prefix_of(self, run: Run) -> RequestPrefix | None:
        """The request's prefix keys, if a cache-aware stage of it reads its chat prompt
        (computed once per request; None keeps the other stages' routing as it was)."""
        if not run.prompt.messages:
            return None
        for sid in self.cache_aware & run.active:
            if self._reads_prompt(run, sid):
                return RequestPrefix.of(run.prompt.messages)
        return None

    def _reads_prompt(self, run: Run, sid: int) -> bool:
        return self.graph.prompt_for(sid, bool(run.active.intersection(self.graph.upstream(sid))))

    def lacking_live(self, active: set[int]) -> bool:
        """Some stage in ``active`` has no live replica now."""
        # A loop, not any(): no generator object on every request.
        for sid in active:  # noqa: SIM110
            if not self.pools[sid].has_live():
                return True
        return False

    async def wait_live(self, active: set[int]) -> None:
        """Wait (boundedly, see ``StagePool.wait_live``) until every stage in ``active``
        has a live replica: a missing downstream stage is a 503 up front, not an error
        mid-stream. Stages with no replica coming are judged first: their short wait
        is not spent after a long one for a restart."""
        started = time.monotonic()
        lacking = [sid for sid in self.order if sid in active and not self.pools[sid].has_live()]
        lacking.sort(key=lambda sid: bool(self.pools[sid].comebacks))
        for sid in lacking:
            await self.pools[sid].wait_live(started, self.bounds)

    async def dispatch(self, run: Run, group: set[int], feeds: Feeds | None = None) -> None:
        """Bind a replica of every stage in ``group``, then send their AddRequests (and
        ``feeds``' Redirects, see ``send_group``)."""
        started = time.monotonic()
        while (lacking := self.try_acquire(run, group)) is not None:
            await self.pools[lacking].wait_capacity(started, self.bounds)
        self.send_group(run, group, feeds)

    def try_acquire(self, run: Run, group: set[int]) -> int | None:
        """Acquire for every stage of ``group``; or release all and return one that has
        no free replica now."""
        got: list[tuple[int, ReplicaHandle]] = []
        for sid in group:
            prefix = None
            if run.prefix is not None and sid in self.cache_aware and self._reads_prompt(run, sid):
                prefix = run.prefix
            handle = self.pools[sid].try_acquire(run.request_id, run.affinity, prefix)
            if handle is None:
                for s, h in got:
                    self.pools[s].release(h, run.request_id)
                return sid
            got.append((sid, handle))
        run.assigned.update(got)
        return None

    def send_group(self, run: Run, group: set[int], feeds: Feeds | None = None) -> None:
        """Choose the direct edges inside ``group`` and send each stage its AddRequest
        and the inputs the head holds for it; they leave with this tick's batches. A
        replica found gone when a batch is sent is marked ERROR at once, which sends the
        requests it held elsewhere. ``feeds`` (``run.redirects``): keepers outside the
        group to point at the group's new replicas."""
        for up in group:
            for down in self.graph.downstream[up]:
                if down in group and direct_edge(self.graph, run, up, down):
                    run.direct.add((up, down))
                    self.direct_edges_total += 1
        if feeds and not self._feedable(run, feeds):
            return
        for sid in self.order:
            if sid not in group:
                continue
            st = run.progress(sid)
            st.waiting = False
            st.attempt = run.attempt
            st.dispatches += 1
            self.latency.dispatched(run, sid, st)
            handle = run.assigned[sid]
            trace = self.traces.dispatched(run, sid, handle)
            add = self._add_request(run, sid, trace)
            if add.peer_tensors:
                run.keepers.add(sid)
            else:
                run.keepers.discard(sid)
            self.channels.post(handle.identity, add)
            for chunk in st.inputs:
                chunk.attempt = st.attempt
                self.channels.post(handle.identity, chunk)
            if add.input_streaming:
                # All the input fed so far; the rest follows as it comes (Orchestrator.feed).
                assert run.streamed is not None
                run.readers.add(sid)
                for piece in run.streamed.replay(st.attempt):
                    self.channels.post(handle.identity, piece)
        for up, lost in (feeds or {}).items():
            self._redirect(run, up, lost)

    def _feedable(self, run: Run, feeds: Feeds) -> bool:
        """Whether every keeper in ``feeds`` can feed the group's new replicas; if not,
        the request fails (what they kept exists nowhere else)."""
        for up, lost in feeds.items():
            handle = run.assigned.get(up)
            for down in lost:
                if handle is None or not handle.up or not direct_edge(self.graph, run, up, down):
                    run.fail(
                        StageFailedError(
                            down,
                            self.graph.stages[down].name,
                            f"its new replica cannot be fed by stage {up}'s replica again",
                        )
                    )
                    return False
        return True

    def _redirect(self, run: Run, up: int, lost: dict[int, str]) -> None:
        downs = sorted(lost)
        for down in downs:
            run.direct.add((up, down))
            self.direct_edges_total += 1
        self.redirects_total += 1
        self.channels.post(
            run.assigned[up].identity,
            Redirect(
                request_id=run.request_id,
                attempt=run.attempt,
                peers=[run.assigned[d].peer_address for d in downs],
                connectors=[self._connector(run, up, d) for d in downs],
                gone=[lost[d] for d in downs if lost[d]],
            ),
        )

    def _add_request(self, run: Run, sid: int, trace: str) -> AddRequest:
        upstream = [u for u in self.graph.upstream(sid) if u in run.active]
        peers, head_all, via_head = [], sid in run.finals, False
        connectors: list[PeerConnector] = []
        for down in self.graph.downstream[sid]:
            if down not in run.active or down in run.finished:
                continue
            if (sid, down) in run.direct:
                peers.append(run.assigned[down].peer_address)
                connectors.append(self._connector(run, sid, down))
            else:
                head_all = via_head = True
        st = run.progress(sid)
        reads = self.graph.prompt_for(sid, bool(upstream))
        return AddRequest(
            request_id=run.request_id,
            prompt=run.prompt if reads else None,
            upstream=upstream,
            params=run.params[sid],
            resume=st.resume(),
            attempt=st.attempt,
            peers=peers,
            connectors=connectors,
            head_all=head_all,
            ack=run.ack and sid in run.finals and st.dispatches == 1,
            trace=trace,
            input_streaming=reads and self._streams_to(run, sid, bool(upstream)),
            # A final stage whose tensors no stage reads through the head.
            peer_tensors=bool(peers) and sid in run.finals and not via_head,
        )

    def _connector(self, run: Run, up: int, down: int) -> PeerConnector:
        """The connector of the direct edge ``up`` -> ``down`` between the two replicas
        bound to it: the configured one, or zmq where it needs one host and they differ."""
        src, dst = run.assigned[up], run.assigned[down]
        choice, fell_back = choose(self.edge_connectors.get((up, down)), src.host_key, dst.host_key)
        if fell_back:
            _fallback.warning(
                "edge %d -> %d: replicas %d and %d do not share a host's memory; its "
                "tensors go over zmq instead of %s",
                up,
                down,
                src.replica_id,
                dst.replica_id,
                self.edge_connectors[(up, down)].name,
            )
        return choice

    def _streams_to(self, run: Run, sid: int, has_upstream: bool) -> bool:
        """Whether a stage given the prompt reads the streamed input too: a source stage, or
        one that reads the streamed modality itself (in ``voice``, the listener hears the
        streamed audio and the thinker after it does not)."""
        if run.streamed is None:
            return False
        streamed = Modality.AUDIO if run.prompt.audio is not None else Modality.TEXT
        return not has_upstream or streamed in self.graph.reads_prompt[sid]
