"""OpenAI-shaped error responses, and the mapping from omnistage errors to them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec
from fastapi import Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from omnistage.protocol.errors import (
    ApiError,
    BadRequestError,
    StageFailedError,
    StageOverloadedError,
    StageUnavailableError,
    as_api_error,
    error_body,
)


def error_response(
    status: int,
    message: str,
    type_: str,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> Response:
    return Response(
        msgspec.json.encode(error_body(message, type_, param, code)),
        status_code=status,
        media_type="application/json",
        headers=headers,
    )


def answer_error(exc: Exception) -> Response:
    """The response to an error raised while serving a request."""
    e = as_api_error(exc)
    headers = {"Retry-After": "1"} if e.status in (429, 503) else None
    return error_response(e.status, e.message, e.type, e.param, e.code, headers)


async def _api_error(_: Request, exc: Exception) -> Response:
    return answer_error(exc)


def invalid_body(errors: Sequence[Any]) -> ApiError:
    """A 400 naming the first bad field of a request body."""
    first = errors[0] if errors else {}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    if first.get("type") == "json_invalid":
        message = "request body is not valid JSON"
    else:
        message = f"{param + ': ' if param else ''}{first.get('msg', 'invalid request')}"
    return ApiError(400, message, "invalid_request_error", param)


async def _validation_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    return await _api_error(request, invalid_body(exc.errors()))


async def _http_error(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, StarletteHTTPException)
    type_ = "invalid_request_error" if exc.status_code < 500 else "server_error"
    code = "not_found" if exc.status_code == 404 else None
    return error_response(exc.status_code, str(exc.detail), type_, code=code)


def install(app) -> None:  # type: ignore[no-untyped-def]
    # A bug still answers in OpenAI's error shape, not Starlette's plain-text 500 (the
    # exception is re-raised after the response, so it is still logged).
    app.add_exception_handler(Exception, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    for cls in (
        ApiError,
        BadRequestError,
        StageUnavailableError,
        StageOverloadedError,
        StageFailedError,
    ):
        app.add_exception_handler(cls, _api_error)
