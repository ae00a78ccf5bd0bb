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
    BadRequestError,
    StageFailedError,
    StageOverloadedError,
    StageUnavailableError,
)


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type_: str,
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code
        super().__init__(message)


def error_body(
    message: str, type_: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


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


def as_api_error(exc: Exception) -> ApiError:
    """Translate an error raised while serving a request into its HTTP form."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, BadRequestError):
        return ApiError(400, str(exc), "invalid_request_error", exc.param, exc.code)
    if isinstance(exc, StageOverloadedError):
        return ApiError(429, str(exc), "rate_limit_exceeded", code="stage_overloaded")
    if isinstance(exc, StageUnavailableError):
        return ApiError(503, str(exc), "service_unavailable", code="stage_unavailable")
    if isinstance(exc, StageFailedError):
        return ApiError(500, str(exc), "server_error", code="stage_failed")
    return ApiError(500, f"internal error: {type(exc).__name__}", "server_error")


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
