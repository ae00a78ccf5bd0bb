"""/v1/videos: video generation as jobs, in OpenAI's shape.

``POST /v1/videos`` stores a queued job and answers at once; the head's job runner
(``jobs.runner``) runs it on the pipeline's video stage; ``GET /v1/videos/{id}`` polls it
(status, ``progress`` in percent of the denoising steps; ``openai-poll-after-ms`` tells
the SDK's ``create_and_poll`` how often), ``GET /v1/videos/{id}/content`` downloads the
MP4 (``variant=thumbnail``: a PNG of the first frame), ``GET /v1/videos`` lists them and
``DELETE`` removes a job and its media (a running one stops). The seed is fixed when the
job is created, so a job run again after a restart makes the same video.
"""

from __future__ import annotations

import json
import secrets
import time
import uuid
from typing import Any

from fastapi import APIRouter, Request
from pydantic import ValidationError
from starlette.datastructures import UploadFile
from starlette.responses import Response

from omnistage.api.body import read_body
from omnistage.api.errors import invalid_body
from omnistage.api.owner import owner_of
from omnistage.api.routes.common import (
    check_model,
    engine_stages,
    json_response,
    persistence,
    pick_stage,
    service,
)
from omnistage.api.schemas.videos import VideoCreateRequest
from omnistage.config.engine_args import VideoArgs
from omnistage.jobs.video import input_key, media_keys, video_object
from omnistage.protocol.enums import EngineName
from omnistage.protocol.errors import ApiError
from omnistage.protocol.params import SEED_LIMIT
from omnistage.protocol.video_params import video_job
from omnistage.store.records import Job, JobKind, JobStatus

router = APIRouter()

POLL_AFTER_MS = 500
MAX_REFERENCE_BYTES = 16 * 1024 * 1024
_VARIANTS = {"video": ("video", "video/mp4"), "thumbnail": ("thumbnail", "image/png")}


def video_stage(request: Request, wanted: str | None = None) -> int:
    omni = service(request)
    missing = "video stage (engine video); /v1/videos needs one (e.g. the built-in video pipeline)"
    stages = engine_stages(omni, EngineName.VIDEO, missing, "no_video_stage")
    return int(pick_stage(omni, stages, wanted, "video stage", "no_video_stage").stage_id)


@router.post("/v1/videos")
async def create_video(request: Request) -> Response:
    persist = persistence(request)
    sid = video_stage(request)
    fields, reference = await _read_request(request)
    check_model(service(request), fields.model)
    seed = fields.seed if fields.seed is not None else secrets.randbelow(SEED_LIMIT)
    # The stage's checks of size and length, before the job is queued.
    stage = service(request).graph.stages[sid]
    video_job(fields.video_params(seed), VideoArgs.model_validate(stage.engine_args))
    job_id = f"video_{uuid.uuid4().hex}"
    spec = {**fields.spec(seed), "model": service(request).served_model, "stage": sid}
    if reference is not None:
        spec["input_reference"] = input_key(job_id)
        await persist.media.put(spec["input_reference"], reference)
    job = Job(
        id=job_id,
        kind=JobKind.VIDEO,
        owner=owner_of(request),
        request=spec,
        created_at=time.time(),
    )
    await persist.store.create_job(job)
    persist.wake()
    return json_response(video_object(job))


async def _read_request(request: Request) -> tuple[VideoCreateRequest, bytes | None]:
    """The fields, from a multipart form (as the SDK sends them) or a JSON body, and the
    ``input_reference`` image's bytes if one was uploaded."""
    kind = request.headers.get("content-type", "")
    reference: bytes | None = None
    if kind.startswith("multipart/form-data") or kind.startswith(
        "application/x-www-form-urlencoded"
    ):
        form = await request.form(max_files=1, max_fields=64)
        try:
            values: dict[str, Any] = {}
            for key, value in form.multi_items():
                if isinstance(value, UploadFile):
                    if key != "input_reference":
                        raise _bad(f"unexpected file field {key!r}", key)
                    reference = await value.read(MAX_REFERENCE_BYTES + 1)
                elif key == "input_reference":
                    raise _bad("input_reference must be an uploaded image file", key)
                else:
                    values[key] = value
        finally:
            await form.close()
    else:
        try:
            values = json.loads(await read_body(request) or b"{}")
        except ValueError:
            raise _bad("the body is not JSON (or send a multipart form)", None) from None
        if not isinstance(values, dict):
            raise _bad("the body must be a JSON object", None)
        if values.get("input_reference") is not None:
            raise _bad(
                "input_reference must be uploaded as a file (multipart form)", "input_reference"
            )
    if reference is not None and len(reference) > MAX_REFERENCE_BYTES:
        raise _bad(f"input_reference is larger than {MAX_REFERENCE_BYTES} bytes", "input_reference")
    if reference is not None and not reference:
        raise _bad("input_reference is empty", "input_reference")
    try:
        return VideoCreateRequest.model_validate(values), reference
    except ValidationError as exc:
        raise invalid_body(exc.errors()) from None


@router.get("/v1/videos/{video_id}")
async def get_video(request: Request, video_id: str) -> Response:
    job = await _job(request, video_id)
    response = json_response(video_object(job))
    if not job.status.final:
        response.headers["openai-poll-after-ms"] = str(POLL_AFTER_MS)
    return response


@router.get("/v1/videos")
async def list_videos(
    request: Request, after: str | None = None, limit: int = 20, order: str = "desc"
) -> Response:
    if not 1 <= limit <= 100:
        raise _bad(f"limit must be 1..100, got {limit}", "limit")
    if order not in ("asc", "desc"):
        raise _bad(f"order must be 'asc' or 'desc', got {order!r}", "order")
    persist = persistence(request)
    page = await persist.store.list_jobs(
        JobKind.VIDEO, owner_of(request), after=after, limit=limit, newest_first=order == "desc"
    )
    data = [video_object(job) for job in page.items]
    return json_response(
        {
            "object": "list",
            "data": data,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
            "has_more": page.has_more,
        }
    )


@router.delete("/v1/videos/{video_id}")
async def delete_video(request: Request, video_id: str) -> Response:
    persist = persistence(request)
    await _job(request, video_id)  # a video of this key's, not another kind of job
    job = await persist.store.delete_job(video_id, owner_of(request))
    if job is None:
        raise _not_found(video_id)
    # A running job sees its row gone at its next lease renewal and stops.
    for key in media_keys(job):
        await persist.media.delete(key)
    return json_response({"id": video_id, "object": "video.deleted", "deleted": True})


@router.get("/v1/videos/{video_id}/content")
async def video_content(request: Request, video_id: str, variant: str = "video") -> Response:
    if variant not in _VARIANTS:
        raise _bad(f"variant must be one of {', '.join(_VARIANTS)}, got {variant!r}", "variant")
    job = await _job(request, video_id)
    if job.status != JobStatus.COMPLETED or not job.result:
        raise ApiError(
            409,
            f"video {video_id} is {job.status}; its content is ready once it is completed",
            "invalid_request_error",
            code="video_not_ready",
        )
    field, media_type = _VARIANTS[variant]
    data = await persistence(request).media.get(job.result[field])
    if data is None:
        raise ApiError(
            404,
            f"the {variant} of video {video_id} has expired",
            "invalid_request_error",
            code="media_expired",
        )
    return Response(data, media_type=media_type)


async def _job(request: Request, video_id: str) -> Job:
    job = await persistence(request).store.get_job(video_id, owner_of(request))
    if job is None or job.kind != JobKind.VIDEO:
        raise _not_found(video_id)
    return job


def _not_found(video_id: str) -> ApiError:
    return ApiError(404, f"no video {video_id!r}", "invalid_request_error", "video_id", "not_found")


def _bad(message: str, param: str | None) -> ApiError:
    return ApiError(400, message, "invalid_request_error", param)
