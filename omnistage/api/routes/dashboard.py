"""GET /dashboard (a live page of the pipeline) and GET /v1/omni/events (its feed).

The page is a static file with no data in it, so it is served without ``--api-key``;
what it shows arrives over ``/v1/omni/events`` (server-sent events), which the key
guards like the rest of /v1/ (and which also takes the key as ``?api_key=``, because a
browser's EventSource cannot send headers).

The feed sends ``event: stages`` with the body of ``GET /v1/omni/stages`` on connect and
whenever it changes, and ``event: waiting`` (requests waiting for a replica slot, per
stage id) likewise. The head's state is checked every ``TICK_S``, per connection: a
look at in-memory state, no request to anyone, so a page costs the head next to nothing
while nothing changes.

Every ``LATENCY_S`` it also sends ``event: latency`` when anything in it changed (and
once on connect): the cumulative latency histograms, the count of 429 and 5xx
responses and the live voice sessions, compactly (see ``latency_body``). The page turns
the deltas of those counts into quantiles over a sliding window itself, so the head
keeps no per-page history.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Mapping
from functools import cache
from importlib import resources
from typing import Any

import msgspec
from fastapi import APIRouter, Request
from starlette.responses import Response, StreamingResponse

from omnistage.api.routes.common import service
from omnistage.dataplane.latency import LatencySnapshot
from omnistage.protocol.front import RealtimeSnapshot
from omnistage.realtime.stats import as_json
from omnistage.service import PipelineService

router = APIRouter()

EVENTS_PATH = "/v1/omni/events"
TICK_S = 0.25
LATENCY_S = 1.0
KEEPALIVE_S = 15.0
# How long a browser waits before it reconnects after the stream broke.
RETRY_MS = 1000
# Replica fields that change on every look without anything having happened: left out
# of the comparison (not of the event), else an idle pipeline would send an event a tick.
_VOLATILE = ("last_heartbeat_age_s",)

# The page holds no data but runs script: it may talk to this origin only, and may not
# be framed.
_PAGE_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
        "connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; "
        "frame-ancestors 'none'"
    ),
    "Referrer-Policy": "no-referrer",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",
}
_STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

_json = msgspec.json.Encoder()


@cache
def _page() -> bytes:
    return (resources.files("omnistage.api") / "static" / "dashboard.html").read_bytes()


@router.get("/dashboard", include_in_schema=False)
async def dashboard() -> Response:
    return Response(_page(), media_type="text/html; charset=utf-8", headers=_PAGE_HEADERS)


@router.get(EVENTS_PATH)
async def events(request: Request) -> Response:
    """Server-sent events: the stages status on connect and on every change."""
    return StreamingResponse(
        _feed(request, service(request)), media_type="text/event-stream", headers=_STREAM_HEADERS
    )


def event(name: str, data: bytes) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + data + b"\n\n"


def comparable(status: dict[str, Any]) -> bytes:
    """``status`` serialized without the fields that change by themselves."""
    stages = [
        {**s, "replicas": [_steady(r) for r in s.get("replicas", ())]}
        for s in status.get("stages", ())
    ]
    return _json.encode({**status, "stages": stages})


def _steady(replica: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in replica.items() if k not in _VOLATILE}
    if out.get("restarting"):  # its due time is news; the countdown to it is not
        out["restarting"] = round(out["restarting"]["due_at"])
    return out


def latency_body(
    snap: LatencySnapshot,
    responses: Mapping[int, int],
    realtime: RealtimeSnapshot | None = None,
) -> bytes:
    """The ``event: latency`` body, JSON: ``bounds`` (bucket upper bounds in seconds,
    once; each counts array has one more slot, for the values above the last bound),
    ``stages`` {family: {stage id: [counts, sum, count]}}, ``requests`` {family: {kind:
    [counts, sum, count]}}, ``responses`` {"429": n, "5xx": n}, ``realtime`` (the live
    voice sessions, ``realtime.stats.as_json``; its histogram has its own bounds): all
    cumulative since the head started, but ``realtime.live_sessions``, a gauge."""

    def hist(state: tuple[list[int], float]) -> list[Any]:
        counts, total = state
        return [counts, round(total, 6), sum(counts)]

    return _json.encode(
        {
            "bounds": snap.bounds,
            "stages": {
                f: {str(sid): hist(h) for sid, h in by_sid.items()}
                for f, by_sid in snap.stages.items()
            },
            "requests": {
                f: {kind: hist(h) for kind, h in by_kind.items()}
                for f, by_kind in snap.requests.items()
            },
            "responses": {
                "429": responses.get(429, 0),
                "5xx": sum(n for code, n in responses.items() if code >= 500),
            },
            "realtime": as_json(realtime if realtime is not None else RealtimeSnapshot()),
        }
    )


async def _feed(request: Request, omni: PipelineService) -> AsyncIterator[bytes]:
    last_stages = last_waiting = last_latency = b""
    last_sent = time.monotonic()
    next_latency = 0.0
    mine = request.app.state.response_counts
    my_realtime = request.app.state.realtime_stats
    yield f"retry: {RETRY_MS}\n\n".encode()
    # Ends when the client goes (checked each tick; a keepalive that cannot be written
    # ends it as well) or when the server shuts down and cancels it.
    while not await request.is_disconnected():
        status = omni.stages_status()
        now_stages = comparable(status)
        out = []
        if now_stages != last_stages:
            last_stages = now_stages
            out.append(event("stages", _json.encode(status)))
        now_waiting = _json.encode({str(k): v for k, v in omni.stage_waiting().items()})
        if now_waiting != last_waiting:
            last_waiting = now_waiting
            out.append(event("waiting", now_waiting))
        now = time.monotonic()
        if now >= next_latency:
            next_latency = now + LATENCY_S
            now_latency = latency_body(
                omni.latency(), omni.response_counts(mine), omni.realtime(my_realtime.snapshot())
            )
            if now_latency != last_latency:
                last_latency = now_latency
                out.append(event("latency", now_latency))
        if not out and now - last_sent >= KEEPALIVE_S:
            out.append(b": keepalive\n\n")
        if out:
            last_sent = now
            yield b"".join(out)
        await asyncio.sleep(TICK_S)
