"""GET /metrics: Prometheus text exposition (format 0.0.4), written by hand.

Open even with ``--api-key`` (the key guards /v1/* only), like /health, so a scraper
needs no secret. Everything is read from the head's in-memory state at scrape time;
nothing here keeps its own series except the HTTP response counter below.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import PlainTextResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from omnistage import __version__
from omnistage.api.prometheus import CONTENT_TYPE, Exposition, Labels
from omnistage.api.routes.common import service
from omnistage.dataplane.latency import Histogram, LatencySnapshot
from omnistage.protocol.front import RealtimeSnapshot
from omnistage.protocol.messages import ReplicaState
from omnistage.service import PipelineService

router = APIRouter()
# Listed even at 0 so every stage has a stable series per state.
REPLICA_STATES = tuple(str(s) for s in ReplicaState if s != ReplicaState.UNKNOWN)


class ResponseCounterMiddleware:
    """Counts HTTP responses by status code: one dict increment per response.

    Outermost of the app's own middleware, so it also sees the 401s and 413s they
    answer; an exception escaping the app becomes Starlette's 500, counted here.
    """

    def __init__(self, app: ASGIApp, counts: Counter[int]) -> None:
        self.app = app
        self.counts = counts

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def counting_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                self.counts[int(message["status"])] += 1
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        except Exception:
            if not started:
                self.counts[500] += 1
            raise


@router.get("/metrics", response_class=PlainTextResponse)
async def metrics(request: Request) -> Response:
    # async on purpose: the pools and orchestrator belong to the event loop (no locks),
    # so they must be read there, not from a worker thread.
    out = Exposition()
    head = service(request)
    _head_metrics(out, head)
    counts = head.response_counts(request.app.state.response_counts)
    out.family(
        "omnistage_http_responses_total",
        "counter",
        "HTTP responses sent, by status code.",
        [({"code": str(code)}, n) for code, n in sorted(counts.items())],
    )
    _realtime_metrics(out, head.realtime(request.app.state.realtime_stats.snapshot()))
    return Response(out.text(), media_type=CONTENT_TYPE)


# The orchestrator's request counts: (family, type, help, field of ``RequestCounts``).
_REQUEST_COUNTS = (
    (
        "omnistage_requests_started_total",
        "counter",
        "Requests the orchestrator has started.",
        "started_total",
    ),
    (
        "omnistage_requests_in_flight",
        "gauge",
        "Requests started and not yet finished.",
        "in_flight",
    ),
    (
        "omnistage_request_retries_total",
        "counter",
        "Stage dispatches retried on another replica after a replica failed.",
        "retried_total",
    ),
    (
        "omnistage_busy_refusals_total",
        "counter",
        "Stage dispatches a replica refused as full with other heads' requests "
        "(several heads), and sent again.",
        "busy_total",
    ),
    (
        "omnistage_direct_edges_total",
        "counter",
        "Stage-to-stage edges of dispatched requests whose chunks went replica to replica.",
        "direct_edges_total",
    ),
    (
        "omnistage_forwarded_chunks_total",
        "counter",
        "Output chunks the head passed on from one stage to the next.",
        "forwarded_chunks_total",
    ),
    (
        "omnistage_forwarded_tensor_chunks_total",
        "counter",
        "Tensor chunks the head passed on from one stage to the next (none where "
        "every tensor edge is direct).",
        "forwarded_tensor_chunks_total",
    ),
    (
        "omnistage_forwarded_tensor_bytes_total",
        "counter",
        "Payload bytes of the tensor chunks the head passed on between stages.",
        "forwarded_tensor_bytes_total",
    ),
    (
        "omnistage_redirects_total",
        "counter",
        "Replaced downstream replicas fed again by the final stage before them, which "
        "kept running.",
        "redirects_total",
    ),
)


def _head_metrics(out: Exposition, service: PipelineService) -> None:
    config = service.config
    out.family(
        "omnistage_info",
        "gauge",
        "Constant 1, labelled with the version and the pipeline served.",
        [({"version": __version__, "pipeline": config.pipeline}, 1)],
    )
    counts = service.request_counts()
    for name, type_, help_, attr in _REQUEST_COUNTS:
        out.family(name, type_, help_, [({}, getattr(counts, attr))])
    names = {s.stage_id: s.name for s in config.stages}
    by_state: Counter[tuple[int, str]] = Counter(
        (e.stage_id, str(e.state)) for e in service.replica_entries()
    )
    states = list(REPLICA_STATES) + sorted({st for _, st in by_state if st not in REPLICA_STATES})
    out.family(
        "omnistage_replicas",
        "gauge",
        "Registered replicas per stage and state.",
        [
            ({**_stage(sid, names), "state": st}, by_state.get((sid, st), 0))
            for sid in sorted(names)
            for st in states
        ],
    )
    _pool_metrics(out, service, names)
    _routing_metrics(out, service, names)
    _autoscale_metrics(out, service, names)
    _latency_metrics(out, service.latency(), names)


def _stage(sid: int, names: dict[int, str]) -> Labels:
    # Both: ids are unique, names are what people read.
    return {"stage_id": str(sid), "stage": names.get(sid, str(sid))}


def _pool_metrics(out: Exposition, service: PipelineService, names: dict[int, str]) -> None:
    loads = [
        ({**_stage(r.stage_id, names), "replica": str(r.replica_id)}, r)
        for r in service.replica_loads()
    ]
    per_replica = (
        ("up", "gauge", "1 if the replica takes new requests, else 0."),
        ("in_flight", "gauge", "Requests the head has sent the replica, unfinished."),
        ("capacity", "gauge", "Concurrent requests the replica accepts."),
        ("queue_length", "gauge", "Queue length the replica last reported."),
        (
            "dispatched_total",
            "counter",
            "Requests dispatched to the replica (resets with a new incarnation).",
        ),
        (
            "prompt_tokens_total",
            "counter",
            "Prompt tokens of the requests the replica finished, from their usage.",
        ),
        (
            "cached_tokens_total",
            "counter",
            "Of the replica's prompt tokens, those its prefix cache held (cache hits).",
        ),
    )
    for attr, type_, help_ in per_replica:
        out.family(
            f"omnistage_replica_{attr}",
            type_,
            help_,
            [(labels, getattr(r, attr)) for labels, r in loads],
        )
    out.family(
        "omnistage_replica_node_info",
        "gauge",
        "1 per replica a backend placed on a node (--worker-backend ray), labelled by node.",
        [({**labels, "node": r.node}, 1) for labels, r in loads if r.node is not None],
    )
    out.family(
        "omnistage_stage_waiting",
        "gauge",
        "Requests waiting for a free replica slot of the stage.",
        [(_stage(sid, names), n) for sid, n in sorted(service.stage_waiting().items())],
    )


def _routing_metrics(out: Exposition, service: PipelineService, names: dict[int, str]) -> None:
    """From /v1/omni/stages (read there so API server processes see the head's)."""
    out.family(
        "omnistage_routing_decisions_total",
        "counter",
        "Requests placed on a replica, by reason: cache (it held more of the prompt's "
        "prefix), load (the balancing policy's load rule), affinity (the session's last "
        "turn went there).",
        [
            ({**_stage(s["stage_id"], names), "reason": reason}, n)
            for s in service.stages_status().get("stages", [])
            for reason, n in sorted((s.get("routing") or {}).items())
        ],
    )


def _autoscale_metrics(out: Exposition, service: PipelineService, names: dict[int, str]) -> None:
    """From the autoscaler's view in /v1/omni/stages (``head.scaler``): stages the head
    autoscales only. Read there so API server processes see the head's."""
    scaling = [
        (s["stage_id"], s["autoscaling"])
        for s in service.stages_status().get("stages", [])
        if (s.get("autoscaling") or {}).get("active")
    ]
    out.family(
        "omnistage_autoscale_decisions_total",
        "counter",
        "Autoscaling decisions applied, by direction (up: replicas added; down: one "
        "drained) and cause (inflight; latency, headroom, idle; min_replicas, max_replicas).",
        [
            ({**_stage(sid, names), "direction": direction, "cause": cause}, n)
            for sid, a in scaling
            for direction, by_cause in a["decisions_by_cause"].items()
            for cause, n in by_cause.items()
        ],
    )
    out.family(
        "omnistage_autoscale_desired_replicas",
        "gauge",
        "Replicas the stage asks for: in-flight mode ceil(load / "
        "target_inflight_per_replica), latency mode what the last check wanted; within "
        "[min_replicas, max_replicas].",
        [(_stage(sid, names), a["desired"]) for sid, a in scaling],
    )
    _autoscale_latency_metrics(
        out,
        [
            ({**_stage(sid, names), "family": family}, w)
            for sid, a in scaling
            for family, w in a["latency"].items()
        ],
    )
    out.family(
        "omnistage_autoscale_replicas",
        "gauge",
        "Replicas the autoscaler counts for the stage: serving, starting or restarting, "
        "not draining.",
        [(_stage(sid, names), a["replicas"]) for sid, a in scaling],
    )
    out.family(
        "omnistage_autoscale_load",
        "gauge",
        "The stage's load as the autoscaler last read it: requests in flight on its "
        "replicas plus requests waiting for one.",
        [(_stage(sid, names), a["load"]) for sid, a in scaling],
    )


def _autoscale_latency_metrics(
    out: Exposition, windows: list[tuple[Labels, dict[str, Any]]]
) -> None:
    """The autoscaler's latency windows: (labels of stage and latency family, window)."""
    out.family(
        "omnistage_autoscale_latency_p90_seconds",
        "gauge",
        "p90 of the stage's latency (queue_wait, first_token, first_audio) over its "
        "autoscaling window, as the autoscaler last read it (latency mode: requests since "
        "the last change); absent without samples.",
        [(labels, w["p90_s"]) for labels, w in windows if w["p90_s"] is not None],
    )
    out.family(
        "omnistage_autoscale_latency_samples",
        "gauge",
        "Samples behind omnistage_autoscale_latency_p90_seconds.",
        [(labels, w["samples"]) for labels, w in windows],
    )
    out.family(
        "omnistage_autoscale_latency_target_seconds",
        "gauge",
        "The stage's autoscaling target for the p90 of that latency.",
        [(labels, w["target_p90_s"]) for labels, w in windows if w["target_p90_s"] is not None],
    )


# Retries: each dispatch of a stage is timed anew, so a retried stage counts once per
# dispatch in the per-stage families.
_PER_DISPATCH = (
    " Counted per dispatch: a stage dispatched again after a replica failed counts again."
)
STAGE_HISTOGRAMS = (
    (
        "queue_wait",
        "omnistage_stage_queue_wait_seconds",
        "From the request's start (a retry: from the replica's loss) to its dispatch to a "
        "replica of the stage." + _PER_DISPATCH,
    ),
    (
        "first_output",
        "omnistage_stage_first_output_seconds",
        "From dispatch to the first output chunk of the stage the head saw (a stage whose "
        "outputs go replica to replica shows the head only its last)." + _PER_DISPATCH,
    ),
    (
        "duration",
        "omnistage_stage_duration_seconds",
        "From dispatch to the stage's finished chunk." + _PER_DISPATCH,
    ),
)
REQUEST_HISTOGRAMS = (
    (
        "e2e",
        "omnistage_request_e2e_seconds",
        "From a request's start to its last final chunk, of requests that completed; "
        "kind is the final stages' names.",
    ),
    (
        "first_token",
        "omnistage_request_time_to_first_token_seconds",
        "From a request's start to the first text chunk of a final text stage.",
    ),
    (
        "first_audio",
        "omnistage_request_time_to_first_audio_seconds",
        "From a request's start to the first audio chunk with data of a final stage.",
    ),
)


def _latency_metrics(out: Exposition, snap: LatencySnapshot, names: dict[int, str]) -> None:
    for key, name, help_ in STAGE_HISTOGRAMS:
        by_sid = snap.stages.get(key, {})
        out.histogram(
            name,
            help_,
            [(_stage(sid, names), snap.histogram(h)) for sid, h in sorted(by_sid.items())],
        )
    for key, name, help_ in REQUEST_HISTOGRAMS:
        by_kind = snap.requests.get(key, {})
        out.histogram(
            name, help_, [({"kind": k}, snap.histogram(h)) for k, h in sorted(by_kind.items())]
        )
    out.family(
        "omnistage_completion_tokens_total",
        "counter",
        "Completion tokens of final stages, from their usage when they finish.",
        [(_stage(sid, names), n) for sid, n in sorted(snap.completion_tokens.items())],
    )
    out.family(
        "omnistage_audio_seconds_total",
        "counter",
        "Seconds of pcm16 audio final stages delivered (bytes / 2 / sample_rate).",
        [(_stage(sid, names), n) for sid, n in sorted(snap.audio_seconds.items())],
    )


# Live voice sessions (``GET /v1/realtime``), summed over every API server process. The
# gauge is not ``omnistage_realtime_sessions``: a parser takes that for the family of the
# counter ``..._sessions_total`` and the two would clash.
_REALTIME_COUNTS = (
    (
        "omnistage_realtime_live_sessions",
        "gauge",
        "Live voice sessions (Realtime API WebSockets and WebRTC calls) open now.",
        "live_sessions",
    ),
    (
        "omnistage_realtime_sessions_total",
        "counter",
        "Live voice sessions opened.",
        "sessions_total",
    ),
    (
        "omnistage_realtime_turns_total",
        "counter",
        "User turns of live voice sessions committed (by server VAD or the client).",
        "turns_total",
    ),
    (
        "omnistage_realtime_barge_ins_total",
        "counter",
        "Answers cut short because the user started speaking while they played.",
        "barge_ins_total",
    ),
)


def _realtime_metrics(out: Exposition, snap: RealtimeSnapshot) -> None:
    for name, type_, help_, attr in _REALTIME_COUNTS:
        out.family(name, type_, help_, [({}, getattr(snap, attr))])
    counts = snap.first_audio_counts
    out.histogram(
        "omnistage_realtime_first_audio_seconds",
        "Live voice: from the end of the user's speech to the first audio of the answer "
        "sent, per answered turn.",
        [({}, Histogram(snap.bounds, list(counts), snap.first_audio_sum))] if counts else [],
    )
