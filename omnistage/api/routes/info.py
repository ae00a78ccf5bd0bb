"""GET /v1/models, /health, /v1/omni/stages: what is served and whether it can serve."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from omnistage.api.routes.common import check_model, service
from omnistage.api.routes.common import json_response as _json_response
from omnistage.protocol.errors import error_body
from omnistage.protocol.messages import ReplicaState
from omnistage.realtime.stats import as_json
from omnistage.service import PipelineService

router = APIRouter()


def _model(omni: PipelineService, name: str) -> dict[str, Any]:
    config = omni.config
    finals = [config.stage(sid) for sid in omni.graph.final]
    return {
        "id": name,
        "object": "model",
        "created": omni.started_at,
        "owned_by": "omnistage",
        "description": config.description,
        "output_modalities": sorted({s.output_modality for s in finals}),
        "stages": [
            {"stage_id": s.stage_id, "name": s.name, "engine": s.engine} for s in config.stages
        ],
    }


@router.get("/v1/models")
async def models(request: Request) -> Response:
    omni = service(request)
    cards = [_model(omni, name) for name in omni.served_model_names]
    return _json_response({"object": "list", "data": cards})


@router.get("/v1/models/{model_id:path}")
async def model(request: Request, model_id: str) -> Response:
    """One model, as OpenAI's ``models.retrieve``; an unknown id is a 404."""
    omni = service(request)
    check_model(omni, model_id)
    return _json_response(_model(omni, model_id))


@router.get("/health")
async def health(request: Request) -> Response:
    """200 "ok" when every stage has a live replica; 200 "restarting" when the stages
    that have none each have one coming back (requests wait for it, so a load balancer
    should keep this head); else 503, naming the stages nothing will serve."""
    omni = service(request)
    missing = omni.stages_without_replicas()
    if not missing:
        return _json_response({"status": "ok"})
    coming = _restarting(omni)
    down = [(sid, name) for sid, name in missing if sid not in coming]
    if not down:
        return _json_response({"status": "restarting", "restarting": list(coming.values())})
    names = ", ".join(f"{sid} ({name})" for sid, name in down)
    body = error_body(f"no live replica for stage(s) {names}", "service_unavailable")
    body["status"] = "unavailable"
    if coming:
        body["restarting"] = list(coming.values())
    return _json_response(body, 503)


def _restarting(omni: PipelineService) -> dict[int, dict[str, Any]]:
    """Stage id -> what /health says of a stage whose replica is coming back: its
    name and its replicas on the way: those the head restarts, with when each is due
    (unix time; None for a STARTING one, loading now)."""
    out: dict[int, dict[str, Any]] = {}
    for stage in omni.stages_status()["stages"]:
        if stage.get("status") != "restarting":
            continue
        due = [
            {
                "replica_id": r["replica_id"],
                "state": r["state"],
                "due_at": r["restarting"]["due_at"] if r.get("restarting") else None,
            }
            for r in stage["replicas"]
            if r.get("restarting") or r["state"] == ReplicaState.STARTING
        ]
        sid = stage["stage_id"]
        out[sid] = {"stage_id": sid, "name": stage["name"], "replicas": due}
    return out


@router.get("/v1/omni/stages")
async def stages(request: Request) -> Response:
    omni = service(request)
    # The head's status, and the live voice sessions of every API server (counted where
    # the WebSockets are, not in the head).
    realtime = omni.realtime(request.app.state.realtime_stats.snapshot())
    return _json_response({**omni.stages_status(), "realtime": as_json(realtime)})
