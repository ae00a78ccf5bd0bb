"""Stand-ins shared by the unit tests: a head for the HTTP API, a fake clock, and waits
on the event loop that end when what they wait for holds, not after a fixed sleep."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from types import SimpleNamespace
from typing import Any

from omnistage.control.replica_table import ReplicaEntry, Transition
from omnistage.dataplane.latency import LatencySnapshot
from omnistage.protocol.chunk_meta import ChunkMeta
from omnistage.protocol.enums import FinishReason, Modality, Reason
from omnistage.protocol.front import PipelineRequest, RealtimeSnapshot
from omnistage.protocol.messages import OutputChunk, ReplicaState, Usage
from omnistage.service import OutputStream, ReplicaStats, RequestCounts

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


class ScriptedStream:
    """An ``OutputStream`` whose chunks the test hands over as it goes: ``put`` one,
    ``fail`` with an exception, ``end`` it. ``close`` (the consumer's abort) ends the
    iteration at once, as a real stream's does; ``closed`` says whether it was called."""

    def __init__(self, request_id: str = "r", usage: Usage | None = None) -> None:
        self.request_id = request_id
        self.closed = False
        self.fed: list[bytes] = []
        self.input_ended = False
        self._queue: asyncio.Queue[OutputChunk | BaseException | None] = asyncio.Queue()
        self._usage = usage or Usage()

    @property
    def pending(self) -> int:
        """Chunks put and not yet taken by the consumer."""
        return self._queue.qsize()

    def put(self, *chunks: OutputChunk) -> None:
        for chunk in chunks:
            self._queue.put_nowait(chunk)

    def fail(self, exc: BaseException) -> None:
        self._queue.put_nowait(exc)

    def end(self) -> None:
        self._queue.put_nowait(None)

    def close(self) -> None:
        self.closed = True
        self._queue.put_nowait(None)

    def feed(self, data: bytes, last: bool = False) -> None:
        """A streamed input's next piece: kept in ``fed``; ``input_ended`` after ``last``."""
        self.fed.append(data)
        self.input_ended = self.input_ended or last

    def usage(self) -> Usage:
        return self._usage

    async def __aiter__(self) -> AsyncIterator[OutputChunk]:
        while not self.closed:
            item = await self._queue.get()
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            yield item


def chunk(
    stage_id: int,
    modality: Modality = Modality.TEXT,
    text: str = "",
    data: bytes = b"",
    *,
    finished: bool = False,
    finish_reason: FinishReason | None = None,
    meta: ChunkMeta | None = None,
) -> OutputChunk:
    """One stage output chunk as a replica would send it."""
    return OutputChunk(
        "r", stage_id, 0, 0, 0, modality, text, data, finished, finish_reason, meta=meta
    )


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


# -- a stage pool's replicas coming and going ---------------------------------------------


def replica_entry(
    rid: int, state: ReplicaState, capacity: int = 2, epoch: int = 1, sid: int = 0
) -> ReplicaEntry:
    return ReplicaEntry(
        stage_id=sid,
        replica_id=rid,
        epoch=epoch,
        state=state,
        address="127.0.0.1",
        local=True,
        registered_at=0.0,
        last_seen=0.0,
        start_deadline=0.0,
        capacity=capacity,
    )


def pool_up(pool: Any, rid: int, capacity: int = 2, epoch: int = 1) -> None:
    """Replica ``rid`` of the ``StagePool``'s stage comes UP."""
    e = replica_entry(rid, ReplicaState.UP, capacity, epoch, pool.stage_id)
    pool.apply(Transition(e, ReplicaState.STARTING, ReplicaState.UP, Reason.READY))


def pool_leave(pool: Any, rid: int, new: ReplicaState, reason: Reason, epoch: int = 1) -> set[str]:
    """Replica ``rid`` goes from UP to ``new``; the requests lost with it."""
    e = replica_entry(rid, new, epoch=epoch, sid=pool.stage_id)
    return pool.apply(Transition(e, ReplicaState.UP, new, reason))
