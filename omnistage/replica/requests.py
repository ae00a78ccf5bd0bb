"""A replica's requests: start, feed, abort and resume them, and route their outputs.

No sockets and no threads: the head's messages come in through ``handle`` (and inputs
pushed by upstream replicas through ``feed``), and outputs leave through an injected
``Outlet`` once per loop tick, merged where possible (see ``outputs``), to the head and
the downstream peers the head named (see ``peer_routes``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from omnistage import tracing
from omnistage.aio import Mailbox
from omnistage.engines.base import Engine, EngineRequest, StageInput, joined_prompt
from omnistage.protocol.enums import ErrorKind, FinishReason, Modality, Outcome
from omnistage.protocol.errors import BadRequestError
from omnistage.protocol.messages import (
    Abort,
    AddRequest,
    InputChunk,
    OutputChunk,
    PeerConnector,
    Ping,
    Redirect,
    Shutdown,
)
from omnistage.replica.admission import Admission
from omnistage.replica.early_inputs import EarlyInputs
from omnistage.replica.outputs import OutputCoalescer, ReplayFilter
from omnistage.replica.peer_routes import PeerBatches, PeerRoutes
from omnistage.replica.streamed import InputPieces, prompt_piece

log = logging.getLogger(__name__)

# Members this hot path compares against, bound once (see protocol/enums.py).
_OK = Outcome.OK
_STOP = FinishReason.STOP

_NOT_KEPT_ERROR = "nothing kept for the request: it cannot feed the new replicas"


class ReplicaBusy(Exception):
    def __init__(self) -> None:
        super().__init__("replica full with other heads' requests")


class Outlet(Protocol):
    def to_head(self, chunks: list[OutputChunk]) -> None: ...

    def to_peer(self, address: str, chunks: list[OutputChunk], connector: PeerConnector) -> None:
        """``chunks`` to a downstream replica, tensor payloads through ``connector``."""
        ...


@dataclass
class _Running:
    attempt: int
    upstream: frozenset[int]
    inputs: Mailbox[StageInput]
    task: asyncio.Task[None] | None = None
    span: Any = None  # its ``omnistage.replica.generate`` span, when tracing is on
    pieces: InputPieces | None = None  # a streamed input (AddRequest.input_streaming)


class RequestRunner:
    def __init__(
        self,
        stage_id: int,
        engine: Engine,
        on_shutdown: Callable[[str], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.stage_id = stage_id
        self.engine = engine
        self._modality = engine.stage.output_modality
        self._on_shutdown = on_shutdown
        self.requests: dict[str, _Running] = {}
        self._routes = PeerRoutes()
        self._early = EarlyInputs(clock)
        self._outputs = OutputCoalescer()
        self._outlet: Outlet | None = None
        self.replica_id = self.epoch = 0
        self.chunks_sent = 0
        self.pieces_taken = 0  # of streamed inputs (heartbeat progress)
        # Shared with the runners of the fleet's other heads (``other_heads``); None
        # while the replica serves one head.
        self.admission: Admission | None = None

    def bind(self, replica_id: int, epoch: int, outlet: Outlet) -> None:
        """Serve a head as this incarnation; outputs leave through ``outlet``."""
        self.replica_id, self.epoch, self._outlet = replica_id, epoch, outlet

    # -- messages --------------------------------------------------------------------

    def handle(self, msg: object) -> None:
        """One message from the head."""
        if isinstance(msg, OutputChunk):
            self.feed(msg)
        elif isinstance(msg, InputChunk):
            self.take_input(msg)
        elif isinstance(msg, AddRequest):
            self.add(msg)
        elif isinstance(msg, Abort):
            self.abort(msg.request_id)
        elif isinstance(msg, Redirect):
            self.redirect(msg)
        elif isinstance(msg, Shutdown):
            self._on_shutdown(msg.reason)
        elif not isinstance(msg, Ping):
            log.warning("unexpected %s on the input channel", type(msg).__name__)

    def feed(self, chunk: OutputChunk) -> None:
        """An upstream stage's output, for one of our requests (now or soon)."""
        running = self.requests.get(chunk.request_id)
        if running is not None and chunk.attempt == running.attempt:
            if chunk.stage_id in running.upstream:
                running.inputs.put_nowait(chunk)
        elif running is None or chunk.attempt > running.attempt:
            self._early.keep(chunk)

    def take_input(self, chunk: InputChunk) -> None:
        """The next piece of a request's streamed input (a late one of an earlier attempt,
        or of a request gone, is dropped)."""
        running = self.requests.get(chunk.request_id)
        if running is not None and running.pieces is not None and chunk.attempt == running.attempt:
            running.pieces.take(chunk)
            self.pieces_taken += 1

    def add(self, msg: AddRequest) -> None:
        if msg.request_id in self.requests:
            log.warning("duplicate request id %s ignored", msg.request_id)
            return
        rid = msg.request_id
        running = _Running(msg.attempt, frozenset(msg.upstream), Mailbox())
        if msg.trace:  # the head traces this request
            running.span = tracing.start_replica_span(msg.trace, self._span_attributes(rid))
        for chunk in self._early.take(rid):
            if chunk.attempt == msg.attempt and chunk.stage_id in running.upstream:
                running.inputs.put_nowait(chunk)
        request = EngineRequest(
            request_id=rid,
            prompt=msg.prompt,
            params=msg.params,
            inputs=_upstream(running.inputs, set(msg.upstream)),
        )
        if msg.input_streaming and msg.prompt is not None:
            running.pieces = InputPieces(prompt_piece(msg.prompt))
            request.prompt_chunks = running.pieces.read()
        replay: ReplayFilter | None = None
        seq = 0
        if msg.resume is not None:
            # A retry of a request a failed replica had started: continue its output
            # (an engine that cannot runs again; the head's chunks skip what it has).
            seq = msg.resume.seq
            if self.engine.supports_resume:
                request.resume_text = msg.resume.text
                request.resume_tokens = msg.resume.tokens
            else:
                replay = ReplayFilter(len(msg.resume.text), msg.resume.data_chunks)
        self._routes.add(msg, replay)
        self._outputs.start_at(rid, seq)
        if self.admission is not None and self.admission.full(self.engine.capacity):
            # Full with other heads' requests: this head dispatches it again.
            self._send(self._refusal(rid, running, seq, ReplicaBusy()))
            _end_span(running, 1, Outcome.REJECTED)
            return
        if msg.ack:
            try:
                self.engine.check(msg.params)
            except BadRequestError as exc:
                self._send(self._refusal(rid, running, seq, exc))
                _end_span(running, 1, Outcome.BAD_REQUEST)
                return
            self._send(self._chunk(rid, running.attempt, seq, self._modality, False))
            seq += 1
        self.requests[rid] = running
        running.task = asyncio.create_task(self._run(request, seq, running))
        if running.span is not None:
            # A task cancelled before its first step never runs its ``finally``.
            running.task.add_done_callback(lambda _: _end_span(running, 0, Outcome.ABORTED))

    def abort(self, request_id: str) -> None:
        # Forget it now, not when the task ends: a retry of the same request may follow
        # in this very batch (a silent replica that came back).
        self._routes.release(request_id)
        running = self.requests.pop(request_id, None)
        if running is not None and running.task is not None:
            running.task.cancel()

    async def cancel_all(self) -> None:
        tasks = [r.task for r in self.requests.values() if r.task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # -- running ---------------------------------------------------------------------

    async def _run(self, request: EngineRequest, seq: int, running: _Running) -> None:
        rid, modality = request.request_id, self._modality
        finished, first_seq, outcome = False, seq, _OK
        try:
            if request.prompt_chunks is not None and not self.engine.streams_input:
                # An engine that reads whole prompts: the input once it has all come.
                assert request.prompt is not None
                request.prompt = await joined_prompt(request.prompt, request.prompt_chunks)
                request.prompt_chunks = None
            async for chunk in self.engine.generate(request):
                out = self._chunk(rid, running.attempt, seq, chunk.modality, chunk.finished)
                out.text, out.data, out.meta = chunk.text, chunk.data, chunk.meta
                out.finish_reason, out.usage = chunk.finish_reason, chunk.usage
                out.logprobs = chunk.logprobs
                self._send(out)
                seq += 1
                if chunk.finished:
                    finished = True
                    break
            if not finished:
                final = self._chunk(rid, running.attempt, seq, modality, True)
                final.finish_reason = _STOP
                self._send(final)
                seq += 1
        except asyncio.CancelledError:
            # Aborted: no more output wanted. Unless a retry of the same request already
            # took its place here (and set where its numbering starts).
            current = self.requests.get(rid)
            if current is None or current is running:
                self._outputs.forget(rid)
            outcome = Outcome.ABORTED
        except Exception as exc:
            log.warning("request %s failed: %s", rid, exc)
            self._send(self._refusal(rid, running, seq, exc))
            seq, outcome = seq + 1, Outcome.ERROR
        finally:
            if self.requests.get(rid) is running:
                self.requests.pop(rid, None)
            _end_span(running, seq - first_seq, outcome)

    def _span_attributes(self, rid: str) -> dict[str, Any]:
        return {
            "omnistage.request_id": rid,
            "omnistage.stage_id": self.stage_id,
            "omnistage.replica_id": self.replica_id,
            "omnistage.engine": self.engine.name,
        }

    def _refusal(self, rid: str, running: _Running, seq: int, exc: Exception) -> OutputChunk:
        """The last chunk of a request that failed: the error, and its kind."""
        final = self._chunk(rid, running.attempt, seq, self._modality, True)
        final.finish_reason, final.error = FinishReason.ERROR, str(exc) or repr(exc)
        if isinstance(exc, BadRequestError):
            final.error_kind, final.error_param = ErrorKind.BAD_REQUEST, exc.param
            final.error_code = exc.code
        elif isinstance(exc, ReplicaBusy):
            final.error_kind = ErrorKind.BUSY
        return final

    def _chunk(
        self, rid: str, attempt: int, seq: int, modality: Modality, finished: bool
    ) -> OutputChunk:
        return OutputChunk(
            request_id=rid,
            stage_id=self.stage_id,
            replica_id=self.replica_id,
            epoch=self.epoch,
            seq=seq,
            modality=modality,
            finished=finished,
            attempt=attempt,
        )

    # -- outputs ---------------------------------------------------------------------

    def _send(self, chunk: OutputChunk) -> None:
        # Outputs of one loop tick leave together, merged where possible (see outputs).
        if not self._outputs:
            asyncio.get_running_loop().call_soon(self.flush)
        self._outputs.add(chunk)
        self.chunks_sent += 1

    def redirect(self, msg: Redirect) -> None:
        """A downstream replica was replaced: what this request sent it goes to the new
        one, and the rest follows there. Nothing kept for it (dropped: ``MAX_KEPT``; or
        this replica started again): the head is told, and runs the request again."""
        self.flush()  # what this tick made leaves first, to the peers it was meant for
        batches = self._routes.redirect(msg)
        if batches is None:
            log.warning("redirect of request %s: nothing kept for it", msg.request_id)
            if self._outlet is not None:
                answer = self._chunk(msg.request_id, msg.attempt, 0, self._modality, False)
                answer.error, answer.error_kind = _NOT_KEPT_ERROR, ErrorKind.NOT_KEPT
                self._outlet.to_head([answer])
            return
        self._to_peers(batches)

    def flush(self) -> None:
        to_head, to_peers = self._routes.route(self._outputs.drain())
        if self._outlet is None:
            return
        if to_head:
            self._outlet.to_head(to_head)
        self._to_peers(to_peers)

    def _to_peers(self, batches: PeerBatches) -> None:
        if self._outlet is None:
            return
        for (peer, _), (connector, chunks) in batches.items():
            self._outlet.to_peer(peer, chunks, connector)

    def forget_routes(self) -> None:
        """Leaving a head: what it asked for is void."""
        self._outputs.drain()
        self._routes.clear()
        self._early.clear()


def _end_span(running: _Running, chunks: int, outcome: Outcome) -> None:
    if running.span is not None:
        tracing.end_replica_span(running.span, chunks, outcome)
        running.span = None


async def _upstream(
    queue: Mailbox[StageInput], open_sources: set[int]
) -> AsyncIterator[StageInput]:
    """Yield upstream chunks until every upstream stage has sent its last one."""
    while open_sources:
        chunk = await queue.get()
        if chunk.text or chunk.data:
            yield chunk
        if chunk.finished:
            open_sources.discard(chunk.stage_id)
