"""The FastAPI application: OpenAI-compatible routes over a running head."""

from __future__ import annotations

import inspect
from collections import Counter
from typing import Any

from fastapi import APIRouter, FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from omnistage import __version__
from omnistage.api import errors
from omnistage.api.auth import ApiKeyMiddleware
from omnistage.api.fastpath import FastPathMiddleware, FastRoute
from omnistage.api.limits import BodyLimitMiddleware
from omnistage.api.media_parts import MediaFetch
from omnistage.api.routes import (
    chat,
    completions,
    dashboard,
    image_edits,
    images,
    info,
    metrics,
    realtime,
    realtime_calls,
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

# Every route of the app, each declared once. The generation routes are FastRoutes: their
# POSTs skip FastAPI's per-request layers (see ``fastpath``), while FastAPI documents them
# and answers their other methods. The rest are the route modules' routers.
ROUTES: tuple[FastRoute | APIRouter, ...] = (
    FastRoute("/v1/chat/completions", chat.chat_completions, ChatCompletionRequest),
    FastRoute("/v1/completions", completions.completions, CompletionRequest),
    FastRoute("/v1/responses", responses.responses, ResponsesRequest),
    FastRoute("/v1/audio/speech", speech.speech, SpeechRequest),
    FastRoute("/v1/images/generations", images.generations, ImageGenerationRequest),
    transcriptions.router,
    image_edits.router,
    info.router,
    metrics.router,
    dashboard.router,
    realtime.router,
    realtime_calls.router,
    realtime_secrets.router,
    talk.router,
    videos.router,
    stored_responses.router,
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
    media_fetch: MediaFetch | None = None,
) -> FastAPI:
    """The app over ``omni``, what the head offers the API (see ``service``).
    ``realtime_limits``: --realtime-max-sessions and --realtime-idle-timeout, for this
    process (None: the defaults); ``media_fetch``: what a chat's image URLs may fetch
    (None: nothing)."""
    app = FastAPI(title="omnistage", version=__version__, **_NO_NATIVE_TELEMETRY)
    app.state.omni = omni
    # The store of jobs and responses (None: nothing is stored; see jobs.state).
    app.state.persist = persist
    app.state.realtime_limits = realtime_limits or realtime.RealtimeLimits()
    app.state.media_fetch = media_fetch or MediaFetch()
    app.state.response_counts = Counter()
    # This process's live voice sessions: the realtime route counts into it.
    app.state.realtime_stats = RealtimeStats()
    # Signed, not stored: every API server process derives the same key from the API key,
    # so one verifies a secret another minted (see realtime.secrets).
    app.state.client_secrets = ClientSecrets(api_key or None)
    errors.install(app)
    for entry in ROUTES:
        if isinstance(entry, FastRoute):
            app.router.routes.append(entry)
        else:
            app.include_router(entry)
    _add_middleware(app, api_key, max_body_bytes)
    bodies = [entry.body for entry in ROUTES if isinstance(entry, FastRoute)]
    _document_bodies(app, [*bodies, realtime_secrets.ClientSecretRequest])
    return app


def _add_middleware(app: FastAPI, api_key: str | None, max_body_bytes: int) -> None:
    """Innermost first. The response counter is the outermost: it counts the 401s and
    413s of the others as well."""
    app.add_middleware(FastPathMiddleware, routes=app.routes)
    # Uploads (audio, images) may be as large as OpenAI takes, even under a lower general
    # limit.
    path_limits = {
        transcriptions.PATH: max(max_body_bytes, transcriptions.TRANSCRIPTION_BODY_BYTES),
        image_edits.PATH: max(max_body_bytes, image_edits.EDIT_BODY_BYTES),
    }
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_body_bytes, path_limits=path_limits)
    # Installed without a key too: it refuses nothing then, but hands the Realtime socket
    # the session config of a client secret (see auth).
    app.add_middleware(
        ApiKeyMiddleware,
        api_key=api_key or None,
        client_secrets=app.state.client_secrets,
        query_paths=[dashboard.EVENTS_PATH],
    )
    app.add_middleware(metrics.ResponseCounterMiddleware, counts=app.state.response_counts)


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
