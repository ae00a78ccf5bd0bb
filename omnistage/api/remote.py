"""The head as an API server process sees it (``--api-server-count``): the same
``PipelineService`` as in the head, over a socket to the head's ``FrontendServer``.

Requests go to the head and their outputs come back as they are made. What the other
routes show (health, stages, metrics) comes from a snapshot the server asks the head for
every ``refresh_s``, so it is at most that old.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import zmq

from omnistage.aio import Mailbox
from omnistage.config.schema import DeployConfig
from omnistage.control.replica_table import ReplicaEntry
from omnistage.dataplane.graph import StageGraph
from omnistage.dataplane.latency import LatencySnapshot
from omnistage.logs import Throttled
from omnistage.protocol import codec
from omnistage.protocol.errors import ApiError
from omnistage.protocol.front import (
    ErrorInfo,
    FrontClose,
    FrontDone,
    FrontInput,
    FrontOpened,
    FrontQuery,
    FrontSnapshot,
    PipelineRequest,
    RealtimeSnapshot,
)
from omnistage.protocol.messages import OutputChunk, Usage
from omnistage.realtime.stats import RealtimeStats, combine
from omnistage.service import ReplicaStats, RequestCounts
from omnistage.zmqio import NOBLOCK, Outbox, Pump

log = logging.getLogger(__name__)
_bad_input = Throttled(log)
_HEAD = b"head"  # the one destination of this server's outbox


def _raise(info: ErrorInfo) -> None:
    raise ApiError(info.status, info.message, info.type, info.param, info.code)


class _Done:
    def __init__(self, msg: FrontDone) -> None:
        self.msg = msg


class RemoteStream:
    """The outputs of one request, relayed by the head."""

    def __init__(self, service: RemoteService, request_id: str, streaming: bool = False) -> None:
        self._service = service
        self.request_id = request_id
        self._streaming = streaming
        self._input_ended = False
        self.opened: asyncio.Future[ErrorInfo | None] = asyncio.get_running_loop().create_future()
        self.queue: Mailbox[OutputChunk | _Done] = Mailbox()
        self._usage = Usage()
        self._finished = False

    async def _outputs(self) -> AsyncIterator[OutputChunk]:
        try:
            while True:
                item = await self.queue.get()
                if isinstance(item, _Done):
                    self._finished = True
                    self._usage = item.msg.usage
                    if item.msg.error is not None:
                        _raise(item.msg.error)
                    return
                yield item
        finally:
            self.close()

    def __aiter__(self) -> AsyncIterator[OutputChunk]:
        return self._outputs()

    def feed(self, data: bytes, last: bool = False) -> None:
        """Append to the streamed input (see ``OutputStream.feed``): on to the head."""
        if not self._streaming:
            raise ValueError(f"request {self.request_id} was not opened with input_streaming")
        if self._input_ended or self._finished:
            return
        self._input_ended = last
        self._service._feed(FrontInput(self.request_id, data, last))

    def close(self) -> None:
        self._service._forget(self.request_id, tell_head=not self._finished)
        self._finished = True

    def usage(self) -> Usage:
        return self._usage


class RemoteService:
    def __init__(
        self,
        config: DeployConfig,
        address: str,
        server: int,
        started_at: int,
        refresh_s: float = 0.5,
        served_model_names: tuple[str, ...] = (),
    ) -> None:
        self.config = config
        self.graph = StageGraph(config)
        self.served_model_names = served_model_names or (config.pipeline,)
        self.served_model = self.served_model_names[0]
        self.model_names = frozenset(self.served_model_names)
        self.started_at = started_at
        self._server = server
        self._refresh_s = refresh_s
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, 100_000)
        self._sock.setsockopt(zmq.RCVHWM, 100_000)
        self._sock.connect(address)
        self._streams: dict[str, RemoteStream] = {}
        self._snapshot: FrontSnapshot | None = None
        self._fresh = asyncio.Event()
        self._ids = itertools.count()
        # This server's own HTTP response counts and live voice sessions (the app's),
        # reported upward.
        self.my_responses: Counter[int] = Counter()
        self.my_realtime: RealtimeStats | None = None

    async def start(self, timeout_s: float = 30.0) -> None:
        """Connect and wait for the head's first snapshot."""
        loop = asyncio.get_running_loop()
        self._outbox = Outbox(loop, self._send)
        self._pump = Pump(loop, self._sock, self._on_frames)
        self._refresher = loop.create_task(self._refresh())
        await asyncio.wait_for(self._fresh.wait(), timeout_s)

    async def close(self) -> None:
        self._refresher.cancel()
        self._outbox.close()
        self._pump.close()
        self._sock.close(linger=0)
        self._ctx.term()

    # -- requests --------------------------------------------------------------------

    async def open(self, msg: PipelineRequest) -> RemoteStream:
        stream = RemoteStream(self, msg.request_id, msg.input_streaming)
        self._streams[msg.request_id] = stream
        self._outbox.put(_HEAD, msg)
        try:
            error = await stream.opened
        except BaseException:
            stream.close()
            raise
        if error is not None:
            self._streams.pop(msg.request_id, None)
            _raise(error)
        return stream

    def _feed(self, msg: FrontInput) -> None:
        self._outbox.put(_HEAD, msg)

    def _forget(self, request_id: str, tell_head: bool) -> None:
        if self._streams.pop(request_id, None) is not None and tell_head:
            self._outbox.put(_HEAD, FrontClose(request_id))

    # -- the head's state --------------------------------------------------------------

    def _snap(self) -> FrontSnapshot:
        assert self._snapshot is not None, "start() waits for the first snapshot"
        return self._snapshot

    def stages_without_replicas(self) -> list[tuple[int, str]]:
        return [(sid, name) for sid, name in self._snap().missing]

    def stages_status(self) -> dict[str, Any]:
        return msgspec.json.decode(self._snap().status_json)

    def replica_entries(self) -> list[ReplicaEntry]:
        return msgspec.json.decode(self._snap().entries_json, type=list[ReplicaEntry])

    def replica_loads(self) -> list[ReplicaStats]:
        return self._snap().loads

    def stage_waiting(self) -> dict[int, int]:
        return dict(self._snap().waiting)

    def request_counts(self) -> RequestCounts:
        return self._snap().counts

    def latency(self) -> LatencySnapshot:
        raw = self._snap().latency_json
        return msgspec.json.decode(raw, type=LatencySnapshot) if raw else LatencySnapshot()

    def response_counts(self, mine: Counter[int]) -> Counter[int]:
        """Every other server's counts as the head last heard them, and ours now."""
        total: Counter[int] = Counter(mine)
        for server, counts in self._snap().responses.items():
            if server != self._server:
                total.update(counts)
        return total

    def realtime(self, mine: RealtimeSnapshot) -> RealtimeSnapshot:
        """Every other server's sessions as the head last heard them, and ours now."""
        others = [s for server, s in self._snap().realtime.items() if server != self._server]
        return combine([mine, *others])

    async def _refresh(self) -> None:
        while True:
            mine = self.my_realtime
            query = FrontQuery(
                self._server, dict(self.my_responses), None if mine is None else mine.snapshot()
            )
            self._outbox.put(_HEAD, query)
            await asyncio.sleep(self._refresh_s)

    # -- socket ----------------------------------------------------------------------

    def _send(self, _dest: object, batch: bytes) -> None:
        try:
            self._sock.send(batch, NOBLOCK)
        except zmq.Again:
            _bad_input.warning("the head is not reading; a batch of messages dropped")
        finally:
            self._pump.kick()

    def _on_frames(self, frames: list[bytes]) -> None:
        for msg in codec.decode_batch_or_drop(frames, _bad_input, "from the head"):
            if isinstance(msg, OutputChunk):
                stream = self._streams.get(msg.request_id)
                if stream is not None:
                    stream.queue.put_nowait(msg)
            elif isinstance(msg, FrontOpened):
                stream = self._streams.get(msg.request_id)
                if stream is not None and not stream.opened.done():
                    stream.opened.set_result(msg.error)
            elif isinstance(msg, FrontDone):
                stream = self._streams.get(msg.request_id)
                if stream is not None:
                    stream.queue.put_nowait(_Done(msg))
            elif isinstance(msg, FrontSnapshot):
                self._snapshot = msg
                self._fresh.set()
            else:
                _bad_input.warning("unexpected %s from the head", type(msg).__name__)
