"""The FastAPI application: OpenAI-compatible routes over a running head."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from omnistage import __version__
from omnistage.api import errors
from omnistage.api.auth import ApiKeyMiddleware
from omnistage.api.routes import chat, info


def create_app(omni: Any, api_key: str | None = None) -> FastAPI:
    """``omni`` is the serving state (the head): config, graph, orchestrator, status."""
    app = FastAPI(title="omnistage", version=__version__)
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    app.state.omni = omni
    errors.install(app)
    app.include_router(chat.router)
    app.include_router(info.router)
    return app
