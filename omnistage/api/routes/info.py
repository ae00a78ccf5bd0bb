"""GET /v1/models, /health, /v1/omni/stages: what is served and whether it can serve."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from omnistage.api.routes.common import check_model, service
from omnistage.api.routes.common import json_response as _json_response
from omnistage.protocol.errors import error_body
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
    missing = service(request).stages_without_replicas()
    if missing:
        names = ", ".join(f"{sid} ({name})" for sid, name in missing)
        body = error_body(f"no live replica for stage(s) {names}", "service_unavailable")
        body["status"] = "unavailable"
        return _json_response(body, 503)
    return _json_response({"status": "ok"})


@router.get("/v1/omni/stages")
async def stages(request: Request) -> Response:
    omni = service(request)
    # The head's status, and the live voice sessions of every API server (counted where
    # the WebSockets are, not in the head).
    realtime = omni.realtime(request.app.state.realtime_stats.snapshot())
    return _json_response({**omni.stages_status(), "realtime": as_json(realtime)})
