"""The exception tree shared by every omnistage component."""

from __future__ import annotations

from typing import Any


class OmniError(Exception):
    """Base class of every error omnistage raises on purpose."""


class ConfigError(OmniError):
    """A deploy config or CLI value is invalid; ``path`` names the offending field."""

    def __init__(self, path: str, message: str) -> None:
        self.path = path
        self.message = message
        super().__init__(f"{path}: {message}" if path else message)


class ProtocolError(OmniError):
    """A peer sent bytes that are not a valid message of the expected type."""


class RegistrationError(OmniError):
    """The master refused or did not answer a registration."""


class IdConflict(RegistrationError):
    """A head refused a fleet-assigned replica id another replica holds there.
    ``held_by``: that replica's instance ("" for a head's own replica)."""

    def __init__(self, message: str, held_by: str) -> None:
        super().__init__(message)
        self.held_by = held_by


class Redirected(RegistrationError):
    """A head of a fleet answered an auto-assign registration with the master URL of
    the head that hands out ids (``RegisterRedirect``)."""

    def __init__(self, master: str, head_instance: str) -> None:
        super().__init__(f"ids are handed out by the head at {master}")
        self.master = master
        self.head_instance = head_instance


class HandshakeError(OmniError):
    """HELLO/READY did not complete (timeout, refusal, engine failure)."""


class StageUnavailableError(OmniError):
    """No live replica of a stage could take a request within the bounded wait."""

    def __init__(
        self, stage_id: int, stage_name: str, waited_s: float, why: str = "has no live replica"
    ) -> None:
        self.stage_id = stage_id
        self.stage_name = stage_name
        super().__init__(f"stage {stage_id} ({stage_name}) {why} (waited {waited_s:.1f}s)")


class StageOverloadedError(OmniError):
    """Every live replica of a stage is at capacity and its wait queue is full (429)."""

    def __init__(self, stage_id: int, stage_name: str, why: str) -> None:
        self.stage_id = stage_id
        self.stage_name = stage_name
        super().__init__(f"stage {stage_id} ({stage_name}) is overloaded: {why}")


class StageFailedError(OmniError):
    """A stage replica reported an error for a request, or died while holding it."""

    def __init__(self, stage_id: int, stage_name: str, message: str) -> None:
        self.stage_id = stage_id
        self.stage_name = stage_name
        super().__init__(f"stage {stage_id} ({stage_name}) failed: {message}")


class EngineError(OmniError):
    """An engine could not start or could not serve a request."""


class BadRequestError(OmniError):
    """A request the deployment cannot serve as asked (maps to HTTP 400)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        self.param = param
        # OpenAI's error code where it has one clients key on (context_length_exceeded).
        self.code = code
        super().__init__(message)


# The HTTP form of an error: OpenAI's error body and the status it goes with.
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
