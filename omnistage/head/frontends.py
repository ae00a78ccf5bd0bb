"""The head's side of ``--api-server-count``: API server processes send requests here, and
get their outputs and the head's state back (see ``api.remote``).

One ROUTER on an ipc socket in a directory only this user can enter: the API servers
run on the head's host, and nobody else may hand the orchestrator requests around the
HTTP API's key check. Each request runs as a task that relays its outputs.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import tempfile
import time
from collections import Counter

import msgspec
import zmq

from omnistage.dataplane.orchestrator import RequestStream
from omnistage.head.service import HeadService
from omnistage.logs import Throttled
from omnistage.protocol import codec
from omnistage.protocol.errors import as_api_error
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
from omnistage.zmqio import NOBLOCK, Outbox, Pump, send_frames

log = logging.getLogger(__name__)
_bad_input = Throttled(log)

# API servers ask for a snapshot every 0.5 s; one silent for this long is gone.
SILENT_AFTER_S = 3.0


def error_info(exc: Exception) -> ErrorInfo:
    e = as_api_error(exc)
    return ErrorInfo(e.status, e.message, e.type, e.param, e.code)


class FrontendServer:
    def __init__(self, service: HeadService) -> None:
        self._service = service
        # Its own context: the head's may carry CURVE defaults, which this local socket
        # needs no more than the HTTP port does.
        self._ctx = zmq.Context()
        self._dir = tempfile.mkdtemp(prefix="omnistage-")
        os.chmod(self._dir, 0o700)
        self.address = f"ipc://{self._dir}/frontends"
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, 100_000)
        self._sock.setsockopt(zmq.RCVHWM, 100_000)
        self._sock.bind(self.address)
        self._tasks: dict[tuple[bytes, str], asyncio.Task[None]] = {}
        # Open requests by (API server, request id): where FrontInput pieces go.
        self._streams: dict[tuple[bytes, str], RequestStream] = {}
        self._responses: dict[int, dict[int, int]] = {}
        self._realtime: dict[int, RealtimeSnapshot] = {}
        # When each API server (by socket identity) last asked for a snapshot: one that
        # stops asking is gone (killed, say), and its requests are aborted.
        self._seen: dict[bytes, float] = {}

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._outbox = Outbox(loop, self._send)
        self._pump = Pump(loop, self._sock, self._on_frames)
        self._reaper = loop.create_task(self._reap_silent())

    async def stop(self) -> None:
        self._reaper.cancel()
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._outbox.close()
        self._pump.close()
        self._sock.close(linger=0)
        self._ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)

    def response_counts(self) -> Counter[int]:
        """Every API server's last reported HTTP response counts, summed."""
        total: Counter[int] = Counter()
        for counts in self._responses.values():
            total.update(counts)
        return total

    def _send(self, identity: object, batch: bytes) -> None:
        assert isinstance(identity, bytes)
        try:
            send_frames(self._sock, [identity, batch], NOBLOCK)
        except zmq.ZMQError as exc:
            _bad_input.warning("an API server is not reading (%s); its messages dropped", exc)
        finally:
            self._pump.kick()

    def _on_frames(self, frames: list[bytes]) -> None:
        identity = frames[0]
        for msg in codec.decode_batch_or_drop(frames[1:], _bad_input, "from an API server"):
            if isinstance(msg, PipelineRequest):
                key = (identity, msg.request_id)
                task = self._loop.create_task(self._serve(identity, msg))
                self._tasks[key] = task
                task.add_done_callback(lambda _t, key=key: self._tasks.pop(key, None))
            elif isinstance(msg, FrontInput):
                stream = self._streams.get((identity, msg.request_id))
                if stream is not None:
                    try:
                        stream.feed(msg.data, msg.last)
                    except ValueError as exc:
                        _bad_input.warning("%s", exc)
            elif isinstance(msg, FrontClose):
                running = self._tasks.get((identity, msg.request_id))
                if running is not None:
                    running.cancel()
            elif isinstance(msg, FrontQuery):
                self._seen[identity] = time.monotonic()
                self._responses[msg.server] = msg.responses
                if msg.realtime is not None:
                    self._realtime[msg.server] = msg.realtime
                self._outbox.put(identity, self._snapshot())
            else:
                _bad_input.warning("unexpected %s from an API server", type(msg).__name__)

    async def _reap_silent(self) -> None:
        """Abort the requests of API servers that stopped asking for snapshots."""
        while True:
            await asyncio.sleep(SILENT_AFTER_S / 2)
            now = time.monotonic()
            gone = {i for i, seen in self._seen.items() if now - seen > SILENT_AFTER_S}
            for identity in gone:
                del self._seen[identity]
            for (identity, rid), task in list(self._tasks.items()):
                if identity in gone:
                    log.warning("request %s: its API server went silent; aborting it", rid)
                    task.cancel()

    async def _serve(self, identity: bytes, msg: PipelineRequest) -> None:
        rid = msg.request_id
        try:
            stream = await self._service.open(msg)
        except asyncio.CancelledError:
            return
        except Exception as exc:
            self._outbox.put(identity, FrontOpened(rid, error_info(exc)))
            return
        key = (identity, rid)
        self._streams[key] = stream
        self._outbox.put(identity, FrontOpened(rid))
        try:
            async for chunk in stream:
                self._outbox.put(identity, chunk)
            self._outbox.put(identity, FrontDone(rid, stream.usage()))
        except asyncio.CancelledError:
            pass  # the client went away: closing the stream aborts the rest
        except Exception as exc:
            self._outbox.put(identity, FrontDone(rid, {}, error_info(exc)))
        finally:
            self._streams.pop(key, None)
            stream.close()

    def _snapshot(self) -> FrontSnapshot:
        s = self._service
        return FrontSnapshot(
            missing=s.stages_without_replicas(),
            status_json=msgspec.json.encode(s.stages_status()),
            counts=s.request_counts(),
            entries_json=msgspec.json.encode(s.replica_entries()),
            loads=s.replica_loads(),
            waiting=s.stage_waiting(),
            responses=dict(self._responses),
            latency_json=msgspec.json.encode(s.latency()),
            realtime=dict(self._realtime),
        )
