"""Stored responses: ``GET`` and ``DELETE /v1/responses/{id}``,
``GET /v1/responses/{id}/input_items`` and ``POST /v1/responses/{id}/cancel`` (a
background response that has not finished). Another key's responses are not found."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from omnistage.api.owner import owner_of
from omnistage.api.routes.common import json_response, persistence
from omnistage.jobs.state import Persistence
from omnistage.protocol.errors import ApiError
from omnistage.store.records import JobKind, JobStatus, ResponseStatus, StoredResponse

router = APIRouter()


async def _stored(request: Request, response_id: str) -> StoredResponse:
    found = await persistence(request).store.get_response(response_id, owner_of(request))
    if found is None:
        raise _not_found(response_id)
    return found


@router.get("/v1/responses/{response_id}")
async def get_response(request: Request, response_id: str, stream: bool = False) -> Response:
    if stream:
        raise ApiError(
            400,
            "stream: a stored response is read back whole here, not streamed again",
            "invalid_request_error",
            "stream",
        )
    stored = await _stored(request, response_id)
    if stored.status.running:
        stored = await _settled(persistence(request), stored)
    return json_response(stored.body)


async def _settled(persist: Persistence, stored: StoredResponse) -> StoredResponse:
    """A background response still marked running whose job has ended without storing
    its result (failed after its last interruption, cancelled, removed) is stored as
    what its job became, so it never reads "in progress" for ever."""
    job = await persist.store.get_job(stored.id, stored.owner)
    if job is not None and not job.status.final:
        return stored
    if job is not None and job.status == JobStatus.COMPLETED:
        return stored  # its handler stores the final body before the job completes
    cancelled = job is not None and job.status == JobStatus.CANCELLED
    status = ResponseStatus.CANCELLED if cancelled else ResponseStatus.FAILED
    error = None
    if status == ResponseStatus.FAILED:
        error = (job.error if job is not None else None) or {
            "code": "interrupted",
            "message": "the response's job was lost before it finished",
        }
    stored.status = status
    stored.body = {**stored.body, "status": status, "error": error}
    await persist.store.put_response(stored)
    return stored


@router.delete("/v1/responses/{response_id}")
async def delete_response(request: Request, response_id: str) -> Response:
    persist = persistence(request)
    owner = owner_of(request)
    # A background response still running stops at its next lease renewal.
    job = await persist.store.get_job(response_id, owner)
    if job is not None and job.kind == JobKind.RESPONSE:
        await persist.store.delete_job(response_id, owner)
    if not await persist.store.delete_response(response_id, owner):
        raise _not_found(response_id)
    return json_response({"id": response_id, "object": "response", "deleted": True})


@router.get("/v1/responses/{response_id}/input_items")
async def input_items(
    request: Request,
    response_id: str,
    after: str | None = None,
    limit: int = 20,
    order: str = "desc",
) -> Response:
    if not 1 <= limit <= 100:
        raise ApiError(400, f"limit must be 1..100, got {limit}", "invalid_request_error", "limit")
    if order not in ("asc", "desc"):
        raise ApiError(400, "order must be 'asc' or 'desc'", "invalid_request_error", "order")
    items = list((await _stored(request, response_id)).input_items)
    if order == "desc":
        items.reverse()
    if after is not None:
        ids = [i.get("id") for i in items]
        if after not in ids:
            raise ApiError(
                400, f"no input item {after!r} in this response", "invalid_request_error", "after"
            )
        items = items[ids.index(after) + 1 :]
    page = items[:limit]
    return json_response(_list(page, len(items) > limit))


def _list(data: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    return {
        "object": "list",
        "data": data,
        "first_id": data[0].get("id") if data else None,
        "last_id": data[-1].get("id") if data else None,
        "has_more": has_more,
    }


@router.post("/v1/responses/{response_id}/cancel")
async def cancel_response(request: Request, response_id: str) -> Response:
    persist = persistence(request)
    owner = owner_of(request)
    stored = await _stored(request, response_id)
    if not stored.body.get("background"):
        raise ApiError(
            400,
            f"response {response_id!r} was not created with background: true; only "
            "background responses can be cancelled",
            "invalid_request_error",
            "response_id",
        )
    job = await persist.store.cancel_job(response_id, owner, time.time())
    if stored.status.running and job is not None:
        # The runner stops at its next renewal and stores nothing after this.
        stored.body = {**stored.body, "status": ResponseStatus.CANCELLED}
        stored.status = ResponseStatus.CANCELLED
        await persist.store.put_response(stored)
    return json_response(stored.body)


def _not_found(response_id: str) -> ApiError:
    return ApiError(
        404,
        f"no stored response {response_id!r}",
        "invalid_request_error",
        "response_id",
        "not_found",
    )
