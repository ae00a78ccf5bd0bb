"""Reading a fast-path route's JSON body: straight from ``receive``, validated by its
schema (see ``api.schemas``), a bad one a 400 naming the field."""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect, Request

from omnistage import tracing
from omnistage.api.errors import invalid_body

M = TypeVar("M", bound=BaseModel)


async def parse_body(request: Request, model: type[M]) -> M:
    """Validate the JSON body straight from bytes (pydantic-core's parser: no json.loads
    pass first); a bad body is a 400 naming the field."""
    try:
        body = model.model_validate_json(await read_body(request))
    except ValidationError as exc:
        raise invalid_body(exc.errors()) from None
    tracing.mark_stream(body)  # for the request's root span; nothing when tracing is off
    return body


async def read_body(request: Request) -> bytes:
    """The whole body, read from ``receive`` directly: ``Request.body`` does the same
    through an async generator per request, which the hot path notices."""
    parts: list[bytes] = []
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnect()
        parts.append(message.get("body", b""))
        if not message.get("more_body", False):
            return parts[0] if len(parts) == 1 else b"".join(parts)


def body_schema(model: type[BaseModel]) -> dict[str, Any]:
    """``openapi_extra`` documenting a body parsed by ``parse_body``."""
    ref = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}
