"""The FastAPI application: OpenAI-compatible routes over a running head."""

from __future__ import annotations

import inspect
from collections import Counter
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from starlette.types import ASGIApp

from omnistage import __version__
from omnistage.api import errors
from omnistage.api.auth import ApiKeyMiddleware
from omnistage.api.body import body_schema
from omnistage.api.fastpath import FastPaths, FastRoute
from omnistage.api.limits import BodyLimitMiddleware
from omnistage.api.routes import (
    chat,
    completions,
    dashboard,
    image_edits,
    images,
    info,
    metrics,
    realtime,
    realtime_secrets,
    responses,
    speech,
    stored_responses,
    talk,
    transcriptions,
    videos,
)
from omnistage.api.schemas.chat import ChatCompletionRequest
from omnistage.api.schemas.completions import CompletionRequest
from omnistage.api.schemas.images import ImageGenerationRequest
from omnistage.api.schemas.responses import ResponsesRequest
from omnistage.api.schemas.speech import SpeechRequest
from omnistage.jobs.state import Persistence
from omnistage.realtime.secrets import ClientSecrets
from omnistage.realtime.stats import RealtimeStats
from omnistage.service import PipelineService

DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024

# The generation routes, each declared here once: their POSTs take the fast path, and
# FastAPI documents them (and answers other methods on their paths).
FAST_ROUTES = (
    FastRoute("/v1/chat/completions", chat.chat_completions, ChatCompletionRequest),
    FastRoute("/v1/completions", completions.completions, CompletionRequest),
    FastRoute("/v1/responses", responses.responses, ResponsesRequest),
    FastRoute("/v1/audio/speech", speech.speech, SpeechRequest),
    FastRoute("/v1/images/generations", images.generations, ImageGenerationRequest),
)

# FastAPI >= 0.165 looks up OpenTelemetry providers on every request (~25 us here) unless
# told not to; omnistage does its own instrumentation. Older FastAPI has no such option.
_NO_NATIVE_TELEMETRY: dict[str, Any] = (
    {"telemetry": {"tracing": False, "metrics": False, "logs": False}}
    if "telemetry" in inspect.signature(FastAPI.__init__).parameters
    else {}
)


def create_app(
    omni: PipelineService,
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    realtime_limits: realtime.RealtimeLimits | None = None,
    persist: Persistence | None = None,
) -> FastPaths:
    """The app over ``omni``, what the head offers the API (see ``api.service``): the
    FastAPI app, with the generation routes' POSTs taken past it (see ``fastpath``).
    ``realtime_limits``: --realtime-max-sessions and --realtime-idle-timeout, for this
    process (None: the defaults)."""
    app = FastAPI(title="omnistage", version=__version__, **_NO_NATIVE_TELEMETRY)
    app.state.realtime_limits = realtime_limits or realtime.RealtimeLimits()
    counts: Counter[int] = Counter()
    app.state.response_counts = counts
    # This process's live voice sessions: the realtime route counts into it.
    app.state.realtime_stats = RealtimeStats()
    # Uploads (audio, images) may be as large as OpenAI takes, even under a lower general
    # limit.
    path_limits = {
        transcriptions.PATH: max(max_body_bytes, transcriptions.TRANSCRIPTION_BODY_BYTES),
        image_edits.PATH: max(max_body_bytes, image_edits.EDIT_BODY_BYTES),
    }
    # Innermost first. The response counter is the outermost: it counts the 401s and
    # 413s of the others as well.
    stack: list[tuple[type, dict[str, Any]]] = [
        (BodyLimitMiddleware, {"max_bytes": max_body_bytes, "path_limits": path_limits})
    ]
    # Signed, not stored: every API server process derives the same key from the API key,
    # so one verifies a secret another minted (see realtime.secrets).
    app.state.client_secrets = secrets = ClientSecrets(api_key or None)
    # Installed without a key too: it refuses nothing then, but hands the Realtime socket
    # the session config of a client secret (see auth). The fast path (HTTP POSTs only)
    # needs it only with a key.
    auth = {"api_key": api_key or None, "client_secrets": secrets}
    stack.append((ApiKeyMiddleware, {**auth, "query_paths": [dashboard.EVENTS_PATH]}))
    stack.append((metrics.ResponseCounterMiddleware, {"counts": counts}))
    for cls, kwargs in stack:
        app.add_middleware(cls, **kwargs)
    fast_stack = [(c, kw) for c, kw in stack if api_key or c is not ApiKeyMiddleware]

    def wrap(inner: ASGIApp) -> ASGIApp:
        for cls, kwargs in fast_stack:
            inner = cls(inner, **kwargs)
        return inner

    app.state.omni = omni
    # The store of jobs and responses (None: nothing is stored; see jobs.state).
    app.state.persist = persist
    errors.install(app)
    for route in FAST_ROUTES:
        app.add_api_route(
            route.path, route.handler, methods=["POST"], openapi_extra=body_schema(route.body)
        )
    modules = (
        transcriptions,
        image_edits,
        info,
        metrics,
        dashboard,
        realtime,
        realtime_secrets,
        talk,
        videos,
        stored_responses,
    )
    for module in modules:
        app.include_router(module.router)
    _document_bodies(
        app, [route.body for route in FAST_ROUTES] + [realtime_secrets.ClientSecretRequest]
    )
    return FastPaths(app, FAST_ROUTES, wrap)


def _document_bodies(app: FastAPI, models: list[type[BaseModel]]) -> None:
    """Put the schemas of bodies parsed by ``parse_body`` into /openapi.json."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for model in models:
            js = model.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(js.pop("$defs", {}))
            components[model.__name__] = js
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
