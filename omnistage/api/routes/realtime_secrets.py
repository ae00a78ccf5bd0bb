"""POST /v1/realtime/client_secrets: a short-lived secret for a browser's Realtime socket.

OpenAI's shape: the body ``{"expires_after": {"anchor": "created_at", "seconds": 10..7200},
"session": {...}}`` (both optional), the answer ``{"value": "ek_...", "expires_at": ...,
"session": {...}}``. The route sits under /v1, so minting takes the real API key; the
secret it returns opens only the WebSocket at /v1/realtime (see ``api.auth``), whose
session then starts with the ``session`` config given here. See ``realtime.secrets``.

Without ``--api-key`` the route answers all the same: every WebSocket is let in then, and
a secret only carries its session config and expiry.
"""

from __future__ import annotations

import secrets
from typing import Any, Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.responses import Response

from omnistage.api.body import body_schema, read_body
from omnistage.api.errors import invalid_body
from omnistage.api.routes.common import json_response
from omnistage.protocol.errors import ApiError
from omnistage.realtime.config import SessionConfig
from omnistage.realtime.secrets import (
    DEFAULT_TTL_S,
    MAX_SESSION_BYTES,
    MAX_TTL_S,
    MIN_TTL_S,
    ClientSecrets,
    session_size,
)

PATH = "/v1/realtime/client_secrets"

router = APIRouter()


class ExpiresAfter(BaseModel):
    model_config = ConfigDict(extra="ignore")

    anchor: Literal["created_at"] = "created_at"
    seconds: int = Field(DEFAULT_TTL_S, ge=MIN_TTL_S, le=MAX_TTL_S, strict=True)


class ClientSecretRequest(BaseModel):
    """What OpenAI's ``client.realtime.client_secrets.create`` sends; other fields are
    ignored, as on every route."""

    model_config = ConfigDict(extra="ignore")

    expires_after: ExpiresAfter = Field(default_factory=ExpiresAfter)
    # The session config the secret's sessions start with, as a session.update's.
    session: dict[str, Any] | None = None


def client_secrets(request: Request) -> ClientSecrets:
    secrets_: ClientSecrets = request.app.state.client_secrets
    return secrets_


@router.post(PATH, openapi_extra=body_schema(ClientSecretRequest))
async def create_client_secret(request: Request) -> Response:
    raw = await read_body(request)
    try:
        body = ClientSecretRequest.model_validate_json(raw or b"{}")
    except ValidationError as exc:
        raise invalid_body(exc.errors()) from None
    session = _session(body.session)
    value, expires_at = client_secrets(request).mint(session, body.expires_after.seconds)
    echoed = {
        "id": f"sess_{secrets.token_hex(12)}",
        "object": f"{session['type']}.session",
        **session,
    }
    return json_response({"value": value, "expires_at": expires_at, "session": echoed})


def _session(given: dict[str, Any] | None) -> dict[str, Any]:
    """The session config a secret carries, checked now as the WebSocket route will apply
    it (a bad field is a 400 naming it here, not a refused handshake later); ``type`` is
    ``realtime`` unless given, and the whole must fit in a header (``realtime.secrets``)."""
    session = {"type": "realtime", **(given or {})}
    SessionConfig().update(session)  # raises BadRequestError, a 400 naming the field
    if session_size(session) > MAX_SESSION_BYTES:
        raise ApiError(
            400,
            f"session config is over {MAX_SESSION_BYTES} bytes of JSON",
            "invalid_request_error",
            "session",
        )
    return session
